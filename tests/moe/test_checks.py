"""``sparseops.moe.checks`` through the public ops: bad input (docs/moe.md) raises the right exception with a message
naming the argument and leaves the caller's tensors untouched; misuse that used to pass silently (a contradicting
``topk_num``, expert ids past ``num_experts``) raises on every backend before anything is written."""

import pytest
import torch

import sparseops
from sparseops import (
    moe_token_permute_with_ep,
    moe_token_permute_with_ep_grad,
    moe_token_unpermute_with_ep,
    moe_token_unpermute_with_ep_grad,
)
from sparseops.moe import checks
from sparseops.testing import assert_close, make_moe_inputs

T, K, H = 3, 2, 4
N = T * K


def _good():
    return {
        "tokens": torch.randn(T, H),
        "indices": torch.tensor([[1, 2], [3, 1], [2, 3]], dtype=torch.int32),
        "probs": torch.rand(T, K),
        "si": torch.tensor([0, 2, 4, 1, 3, 5], dtype=torch.int32),
        "pt": torch.randn(N, H),
        "grad": torch.randn(T, H),
        "ppg": torch.randn(N),
    }


def permute(d, **kw):
    args = {"tokens": d["tokens"], "indices": d["indices"], "probs": d["probs"]}
    args.update(kw)
    return moe_token_permute_with_ep(**args)


def unpermute(d, **kw):
    args = {"permuted_tokens": d["pt"], "sorted_indices": d["si"], "probs": d["probs"]}
    args.update(kw)
    return moe_token_unpermute_with_ep(**args)


def unpermute_grad(d, **kw):
    args = {"unpermuted_tokens_grad": d["grad"], "sorted_indices": d["si"], "permuted_tokens": d["pt"],
            "probs": d["probs"]}
    args.update(kw)
    return moe_token_unpermute_with_ep_grad(**args)


def permute_grad(d, **kw):
    args = {"permuted_tokens_grad": d["pt"], "sorted_indices": d["si"], "permuted_probs_grad": d["ppg"],
            "topk_num": K}
    args.update(kw)
    return moe_token_permute_with_ep_grad(**args)


def _si(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# (op, keyword overrides built from the good inputs, exception, text the message must contain)
BAD = [
    # wrong type / rank / dtype
    pytest.param(permute, lambda d: {"tokens": d["tokens"].tolist()}, TypeError, "tokens", id="permute-tokens-not-tensor"),
    pytest.param(permute, lambda d: {"tokens": d["tokens"][0]}, ValueError, "tokens", id="permute-tokens-1d"),
    pytest.param(permute, lambda d: {"tokens": d["tokens"].int()}, TypeError, "tokens", id="permute-tokens-int"),
    pytest.param(permute, lambda d: {"indices": d["indices"].float()}, TypeError, "indices", id="permute-indices-float"),
    pytest.param(permute, lambda d: {"indices": d["indices"][None]}, ValueError, "indices", id="permute-indices-3d"),
    pytest.param(permute, lambda d: {"indices": d["indices"][:2]}, ValueError, "indices", id="permute-indices-rows"),
    pytest.param(permute, lambda d: {"indices": -d["indices"]}, ValueError, "indices", id="permute-negative-expert"),
    pytest.param(permute, lambda d: {"probs": d["probs"][:, :1]}, ValueError, "probs", id="permute-probs-shape"),
    pytest.param(permute, lambda d: {"probs": d["probs"].long()}, TypeError, "probs", id="permute-probs-int"),
    pytest.param(permute, lambda d: {"num_out_tokens": 1.5}, TypeError, "num_out_tokens", id="permute-num-out-float"),
    pytest.param(permute, lambda d: {"indices": torch.zeros(T, 513, dtype=torch.int32), "probs": None},
                 ValueError, "K", id="permute-K-over-512"),
    pytest.param(permute, lambda d: {"padded_mode": True}, NotImplementedError, "padded_mode", id="permute-padded"),
    pytest.param(permute, lambda d: {"padded_mode": 1}, TypeError, "padded_mode", id="permute-padded-not-bool"),
    # range
    pytest.param(permute, lambda d: {"range": [1, 2, 3]}, ValueError, "range", id="range-three-values"),
    pytest.param(permute, lambda d: {"range": [1]}, ValueError, "range", id="range-one-value"),
    pytest.param(permute, lambda d: {"range": [4, 2]}, ValueError, "range", id="range-end-before-start"),
    pytest.param(permute, lambda d: {"range": [-1, 2]}, ValueError, "range", id="range-negative-start-after-end"),
    pytest.param(permute, lambda d: {"range": [0.5, 2]}, TypeError, "range", id="range-float"),
    pytest.param(permute, lambda d: {"range": 3}, TypeError, "range", id="range-scalar"),
    pytest.param(unpermute, lambda d: {"range": [5, 1]}, ValueError, "range", id="unpermute-range-reversed"),
    # sorted_indices
    pytest.param(unpermute, lambda d: {"sorted_indices": d["si"][None]}, ValueError, "sorted_indices", id="si-2d"),
    pytest.param(unpermute, lambda d: {"sorted_indices": d["si"][:5]}, ValueError, "sorted_indices", id="si-length"),
    pytest.param(unpermute, lambda d: {"sorted_indices": d["si"].float()}, TypeError, "sorted_indices", id="si-float"),
    pytest.param(unpermute, lambda d: {"sorted_indices": _si([0, 2, 4, 1, 3, 6])}, ValueError, "sorted_indices",
                 id="si-out-of-range-high"),
    pytest.param(unpermute, lambda d: {"sorted_indices": _si([0, 2, 4, 1, 3, -1])}, ValueError, "sorted_indices",
                 id="si-out-of-range-negative"),
    pytest.param(unpermute, lambda d: {"sorted_indices": _si([0, 2, 4, 1, 3, 3], torch.int64)}, ValueError,
                 "sorted_indices", id="si-repeated"),
    pytest.param(unpermute_grad, lambda d: {"sorted_indices": _si([0, 0, 4, 1, 3, 5])}, ValueError, "sorted_indices",
                 id="unpermute-grad-si-repeated"),
    pytest.param(permute_grad, lambda d: {"sorted_indices": _si([0, 2, 4, 1, 3, 9])}, ValueError, "sorted_indices",
                 id="permute-grad-si-out-of-range"),
    pytest.param(permute_grad, lambda d: {"topk_num": 4}, ValueError, "sorted_indices", id="permute-grad-N-not-multiple-of-K"),
    # unpermute
    pytest.param(unpermute, lambda d: {"probs": d["probs"][:2]}, ValueError, "sorted_indices", id="unpermute-probs-T"),
    pytest.param(unpermute, lambda d: {"probs": d["probs"][0]}, ValueError, "probs", id="unpermute-probs-1d"),
    pytest.param(unpermute, lambda d: {"permuted_tokens": torch.randn(N + 1, H)}, ValueError, "permuted_tokens",
                 id="unpermute-pt-more-rows-than-N"),
    pytest.param(unpermute, lambda d: {"permuted_tokens": d["pt"], "range": [1, 5]}, ValueError, "permuted_tokens",
                 id="unpermute-pt-rows-vs-range"),
    pytest.param(unpermute, lambda d: {"topk_num": 0, "probs": None}, ValueError, "topk_num", id="unpermute-topk-0"),
    pytest.param(unpermute, lambda d: {"topk_num": 513, "probs": None}, ValueError, "topk_num", id="unpermute-topk-513"),
    pytest.param(unpermute, lambda d: {"restore_shape": (T, H + 1)}, ValueError, "restore_shape",
                 id="unpermute-restore-shape"),
    pytest.param(unpermute, lambda d: {"padded_mode": True}, NotImplementedError, "padded_mode", id="unpermute-padded"),
    # unpermute_grad (the seed op)
    pytest.param(unpermute_grad, lambda d: {"permuted_tokens": None}, ValueError, "permuted_tokens",
                 id="ug-probs-without-permuted-tokens"),
    pytest.param(unpermute_grad, lambda d: {"permuted_tokens": d["pt"].half()}, TypeError, "permuted_tokens",
                 id="ug-mixed-token-dtypes"),
    pytest.param(unpermute_grad, lambda d: {"permuted_tokens": d["pt"][:, :3]}, ValueError, "permuted_tokens",
                 id="ug-hidden-mismatch"),
    pytest.param(unpermute_grad, lambda d: {"probs": d["probs"][:2]}, ValueError, "probs", id="ug-probs-rows"),
    pytest.param(unpermute_grad, lambda d: {"probs": torch.rand(T, 513), "sorted_indices": torch.arange(T * 513)},
                 ValueError, "K", id="ug-K-over-512"),
    pytest.param(unpermute_grad, lambda d: {"unpermuted_tokens_grad": d["grad"].to(torch.int16)}, TypeError,
                 "unpermuted_tokens_grad", id="ug-grad-dtype"),
    pytest.param(unpermute_grad, lambda d: {"restore_shape": [T + 1, H]}, ValueError, "restore_shape",
                 id="ug-restore-shape"),
    pytest.param(unpermute_grad, lambda d: {"range": [0, 1, 2]}, ValueError, "range", id="ug-range-length"),
    pytest.param(unpermute_grad, lambda d: {"padded_mode": True}, NotImplementedError, "padded_mode", id="ug-padded"),
    pytest.param(unpermute_grad, lambda d: {"backend": "cuda"}, ValueError, "backend", id="ug-unknown-backend"),
    pytest.param(unpermute_grad, lambda d: {"validate": "yes"}, TypeError, "validate", id="ug-validate-not-bool"),
    pytest.param(unpermute_grad, lambda d: {"permuted_tokens": d["pt"].to_sparse()}, TypeError, "permuted_tokens",
                 id="ug-sparse-layout"),
    # permute_grad
    pytest.param(permute_grad, lambda d: {"permuted_probs_grad": d["ppg"][:4]}, ValueError, "permuted_probs_grad",
                 id="pg-ppg-rows"),
    pytest.param(permute_grad, lambda d: {"permuted_probs_grad": d["ppg"][None]}, ValueError, "permuted_probs_grad",
                 id="pg-ppg-2d"),
    pytest.param(permute_grad, lambda d: {"range": [1, 5]}, ValueError, "permuted_tokens_grad", id="pg-rows-vs-range"),
    pytest.param(permute_grad, lambda d: {"topk_num": 513}, ValueError, "topk_num", id="pg-topk-513"),
    pytest.param(permute_grad, lambda d: {"padded_mode": True}, NotImplementedError, "padded_mode", id="pg-padded"),
]


@pytest.mark.parametrize("op,change,exc,text", BAD)
def test_bad_input(op, change, exc, text, untouched):
    d = _good()
    kw = change(d)
    check = untouched({**d, **{k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}})
    with pytest.raises(exc) as info:
        op(d, backend=kw.pop("backend", "torch"), **kw)
    assert text in str(info.value), str(info.value)
    check()


@pytest.mark.parametrize("op", [permute, unpermute, unpermute_grad, permute_grad],
                         ids=["permute", "unpermute", "unpermute-grad", "permute-grad"])
def test_good_inputs_pass(op):
    # the inputs every bad case starts from are valid: the torch path returns the reference's result
    d = _good()
    got, want = op(d, backend="torch"), op(d, backend="reference")
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want) and all(g is not None for g in got)
    for x, y in zip(got, want):
        if x.is_floating_point():
            assert_close(x, y, x.dtype)
        else:
            assert torch.equal(x, y)  # sorted_indices


def test_validate_false_skips_value_checks_only():
    d = _good()
    # a duplicate row passes with validate=False (undefined result, but no error and no crash) ...
    unpermute(d, sorted_indices=_si([0, 2, 4, 1, 3, 3]), validate=False, backend="torch")
    # ... while shape checks still run
    with pytest.raises(ValueError, match="sorted_indices"):
        unpermute(d, sorted_indices=d["si"][:5], validate=False, backend="torch")


def test_empty_tokens_are_legal():
    tokens = torch.empty(0, H)
    indices = torch.empty(0, K, dtype=torch.int64)
    probs = torch.empty(0, K)
    pt, si, pp = moe_token_permute_with_ep(tokens, indices, probs, backend="torch")
    assert pt.shape == (0, H) and si.shape == (0,) and pp.shape == (0,)
    out = moe_token_unpermute_with_ep(pt, si, probs, backend="torch")
    assert out.shape == (0, H)
    ptg, pg = moe_token_unpermute_with_ep_grad(torch.empty(0, H), si, pt, probs, backend="torch")
    assert ptg.shape == (0, H) and pg.shape == (0, K)
    tg, pg2 = moe_token_permute_with_ep_grad(pt, si, pp, K, backend="torch")
    assert tg.shape == (0, H) and pg2.shape == (0, K)


# ---- misuse that used to pass silently ----

BACKENDS = ["torch", "reference"]


def _permuted(T=6, K=2, H=4):
    d = make_moe_inputs(T, K, H, num_experts=4, dtype=torch.float32, seed=1)
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], backend="torch")
    return d, pt, si


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_num_contradicting_probs_is_an_error(backend):
    d, pt, si = _permuted()
    with pytest.raises(ValueError, match=r"topk_num: expected 1 \(the default\) or K = probs.shape\[1\] = 2 .*got 3"):
        moe_token_unpermute_with_ep(pt, si, d["probs"], topk_num=3, backend=backend)
    g = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"topk_num: .*= 2 .*got 3"):
        moe_token_unpermute_with_ep_grad(g, si, pt, d["probs"], topk_num=3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_num_agreeing_with_probs_or_left_at_1_gives_the_same_result(backend):
    # 1 is the default and what CANN's own example passes with K = 3 probs: it defers to probs
    d, pt, si = _permuted()
    want = moe_token_unpermute_with_ep(pt, si, d["probs"], backend=backend)
    assert torch.equal(moe_token_unpermute_with_ep(pt, si, d["probs"], topk_num=2, backend=backend), want)
    g = torch.randn(6, 4)
    a = moe_token_unpermute_with_ep_grad(g, si, pt, d["probs"], backend=backend)
    b = moe_token_unpermute_with_ep_grad(g, si, pt, d["probs"], topk_num=2, backend=backend)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_ids_past_num_experts_are_an_error_before_anything_is_written(backend, monkeypatch):
    d = make_moe_inputs(5, 2, 3, num_experts=4, dtype=torch.float32, seed=2)
    idx = d["indices"].clone()
    idx[3, 1] = 10**6
    calls = []
    monkeypatch.setattr(sparseops.moe.api, "_permute_op", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match=r"indices: expected expert ids < num_experts = 4, got 1000000 at \[3, 1\]"):
        moe_token_permute_with_ep(d["tokens"], idx, d["probs"], num_experts=4, backend=backend)
    assert calls == []  # no backend ran
    with pytest.raises(ValueError, match="num_experts: expected >= 1, got 0"):
        moe_token_permute_with_ep(d["tokens"], d["indices"], num_experts=0, backend=backend)
    with pytest.raises(TypeError, match="num_experts: expected an int"):
        moe_token_permute_with_ep(d["tokens"], d["indices"], num_experts=4.0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_experts_accepts_ids_below_it_and_changes_nothing(backend):
    d = make_moe_inputs(5, 2, 3, num_experts=4, dtype=torch.float32, seed=2)
    a = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], backend=backend)
    b = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], num_experts=4, backend=backend)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    one_d = moe_token_permute_with_ep(d["tokens"], d["indices"][:, 0], num_experts=4, backend=backend)
    assert one_d[0].shape == (5, 3)


def test_num_experts_is_checked_with_the_other_index_values():
    # validate=False skips the data-dependent checks, this one too (the type is still checked)
    d = make_moe_inputs(5, 2, 3, num_experts=4, dtype=torch.float32, seed=2)
    idx = d["indices"].clone()
    idx[0, 0] = 7
    moe_token_permute_with_ep(d["tokens"], idx, num_experts=4, validate=False, backend="torch")
    assert checks.check_num_experts(idx, None, True) is None
    with pytest.raises(ValueError, match=r"got 7 at \[0, 0\]"):
        checks.check_num_experts(idx, 4, True)


def test_unpermute_docstrings_say_the_window_default_first():
    # after a windowed permute, an unpermute without range reads [0, R): said in the docstring's first lines
    for fn in (moe_token_unpermute_with_ep, moe_token_unpermute_with_ep_grad):
        head = "\n".join(fn.__doc__.strip().splitlines()[:5])
        assert "Without ``range`` the window is ``[0, R)``" in head, fn.__name__
        assert "pass" in head and "range" in head


def test_public_check_names():
    # the CANN layer reuses these instead of a copy of its own
    for name in ("check_permute_args", "check_unpermute_args", "check_unpermute_grad_args",
                 "check_permute_grad_args", "normalize_range", "check_num_experts"):
        assert callable(getattr(checks, name)), name


def test_meta_tensors_skip_the_data_checks():
    # shape inference on meta tensors: the checks that read index data cannot run (there is none)
    m = {"device": "meta"}
    pt, si, pp = moe_token_permute_with_ep(torch.empty(3, 4, **m), torch.empty(3, 2, dtype=torch.int32, **m),
                                           torch.empty(3, 2, **m), backend="torch")
    assert (pt.shape, si.shape, pp.shape) == ((6, 4), (6,), (6,))
    out = moe_token_unpermute_with_ep(pt, si, torch.empty(3, 2, **m), backend="torch")
    assert out.shape == (3, 4) and out.device.type == "meta"
