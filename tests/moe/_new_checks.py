"""``sparseops.moe.checks``: the misuse that used to pass silently (a contradicting ``topk_num``, expert ids past
``num_experts``), on every backend, before anything is written; the window default documented where it bites."""

import pytest
import torch

import sparseops
from sparseops import moe_token_permute_with_ep, moe_token_unpermute_with_ep, moe_token_unpermute_with_ep_grad
from sparseops.moe import checks
from sparseops.testing import make_moe_inputs

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
    from sparseops.moe import api

    assert api.check_permute_args is checks.check_permute_args  # the old import path, for one step
