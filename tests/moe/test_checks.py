"""Bad input (spec/moe.md §5): the exception type, a message that names the argument, caller tensors untouched."""

import sys

import pytest
import torch

from sparseops import (
    moe_token_permute_with_ep,
    moe_token_permute_with_ep_grad,
    moe_token_unpermute_with_ep,
    moe_token_unpermute_with_ep_grad,
)

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


@pytest.mark.parametrize("op,override,exc,text", BAD)
def test_bad_input(op, override, exc, text):
    d = _good()
    kw = override(d)
    before = {k: v.clone() for k, v in d.items()}
    before_kw = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as info:
        op(d, backend=kw.pop("backend", "torch"), **kw)
    assert text in str(info.value), str(info.value)
    for k, v in before.items():
        assert torch.equal(d[k], v), f"caller tensor {k} was modified"
    for k, v in before_kw.items():
        assert torch.equal(_dense(kw[k]), _dense(v)), f"caller tensor {k} was modified"


def _dense(t):
    return t.to_dense() if t.layout != torch.strided else t


def test_good_inputs_pass():
    d = _good()
    permute(d, backend="torch")
    unpermute(d, backend="torch")
    unpermute_grad(d, backend="torch")
    permute_grad(d, backend="torch")


def test_validate_false_skips_value_checks_only():
    d = _good()
    # a duplicate row passes with validate=False (undefined result, but no error and no crash) ...
    unpermute(d, sorted_indices=_si([0, 2, 4, 1, 3, 3]), validate=False, backend="torch")
    # ... while shape checks still run
    with pytest.raises(ValueError, match="sorted_indices"):
        unpermute(d, sorted_indices=d["si"][:5], validate=False, backend="torch")


def test_triton_on_cpu_is_a_clear_error():
    d = _good()
    with pytest.raises(ValueError, match="backend"):
        unpermute_grad(d, backend="triton")


def _without_triton_module(monkeypatch):
    """``from .moe import triton_impl`` in ``sparseops._backend`` fails, even after another test imported it."""
    import sparseops.moe

    monkeypatch.setitem(sys.modules, "sparseops.moe.triton_impl", None)
    monkeypatch.delattr(sparseops.moe, "triton_impl", raising=False)


def test_missing_triton_module_is_a_clear_error(monkeypatch):
    from sparseops import _backend

    _without_triton_module(monkeypatch)
    with pytest.raises(ValueError, match="backend: 'triton'"):
        _backend.module("moe", "triton")


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


def test_auto_falls_back_to_torch_when_the_triton_module_is_missing(monkeypatch):
    from sparseops import _backend, _checks

    _without_triton_module(monkeypatch)
    monkeypatch.setattr(_checks, "resolve_backend", lambda backend, device: "triton" if backend == "auto" else backend)
    d = _good()
    assert _backend.resolve("moe", "auto", d["grad"].device) == ("torch", False)
    with pytest.raises(ValueError, match="backend: 'triton'"):
        _backend.resolve("moe", "triton", d["grad"].device)
