"""Every transformers MoE family whose experts use the experts interface: sparseops against eager, module level.

Tiny experts (H 16, F 12, E 5; ``transformers_cases``), every parameter random, float64 and fp32, forward and
every gradient (hidden states, routing weights, each parameter), and EP sentinel ids.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")

from sparseops.testing import assert_close  # noqa: E402

from .transformers_cases import (  # noqa: E402
    build_experts,
    eager_computes_in_fp32,
    eager_forward,
    experts_families,
    family_experts,
    routing,
    run_experts,
)

T, K = 7, 2  # odd token count; K <= E
#: experts classes whose eager forward takes one route per row with unit weight (``top_k_index [T, 1]``, the
#: weights unread): their model class repeats each token per route and weights the routes itself (ErgoExperts)
ONE_ROUTE = {"ErgoExpertProjections"}

def _tol_dtype(fp32_inside, dtype):
    # an experts class whose own eager code computes in fp32 (found by running it, so a new transformers release
    # needs no list here) gives a float64 reference that is only fp32-exact
    return torch.float32 if dtype == torch.float64 and fp32_inside else dtype


@pytest.fixture(scope="module", autouse=True)
def _register():
    import sparseops.integrations.transformers  # noqa: F401


def _cases(family):
    out = family_experts(family)
    assert out, f"{family}: no decorated experts class found"
    return out


def _sparseops(module):
    module.config._experts_implementation = "sparseops"
    return module


@pytest.mark.parametrize("family", experts_families())
def test_family_matches_eager(family):
    for cls, configs in _cases(family):
        module = build_experts(cls, configs)
        E, H = module.num_experts, module.down_proj.shape[2 if module.is_transposed else 1]
        g = torch.Generator().manual_seed(3)
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        one_route = cls.__name__ in ONE_ROUTE
        idx, w = routing(T, E, 1 if one_route else K)
        if one_route:
            w = torch.ones_like(w)
        y_ref, g_ref = run_experts(module, eager_forward(module), x, idx, w)
        if one_route:
            assert g_ref.pop("top_k_weights") is None  # the weights are unread by eager: nothing to compare
        fp32_inside = eager_computes_in_fp32(module, x, idx, w)
        for dtype in (torch.float64, torch.float32):
            m = _sparseops(copy.deepcopy(module).to(dtype))
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a fallback warning fails the family
                y, grads = run_experts(m, m, x.to(dtype), idx, w.to(dtype))
            assert_close(y, y_ref, _tol_dtype(fp32_inside, dtype), f"{cls.__name__} {dtype} output")
            for name, ref in g_ref.items():
                assert grads[name] is not None, f"{cls.__name__}: no gradient for {name}"
                assert_close(grads[name], ref, _tol_dtype(fp32_inside, dtype), f"{cls.__name__} {dtype} grad {name}")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "nemotron_h", "muse_spark", "openai_privacy_filter"])
def test_ep_sentinels_contribute_nothing(family):
    # transformers' EP hands the experts local ids, >= num_experts for off-rank slots: they must add 0 and give
    # their routing weights a zero gradient; the reference routes them to expert 0 with weight 0
    for cls, configs in _cases(family):
        module = build_experts(cls, configs)
        module._is_expert_parallel = True
        E, H = module.num_experts, module.down_proj.shape[2 if module.is_transposed else 1]
        g = torch.Generator().manual_seed(4)
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        idx, w = routing(T, E, K)
        sentinel = torch.zeros_like(idx, dtype=torch.bool)
        sentinel[::2, 0] = True
        sentinel[3, :] = True  # a token with no real expert
        idx_s = idx.masked_fill(sentinel, E)
        idx_s[5, 1] = E + 3  # any id >= E is a sentinel
        sentinel[5, 1] = True
        y_ref, g_ref = run_experts(module, eager_forward(module), x, idx.masked_fill(sentinel, 0),
                                   w.masked_fill(sentinel, 0.0))
        fp32_inside = eager_computes_in_fp32(module, x, idx, w)
        m = _sparseops(module)
        y, grads = run_experts(m, m, x, idx_s, w)
        tol = _tol_dtype(fp32_inside, torch.float64)
        assert_close(y, y_ref, tol, "output")
        assert torch.count_nonzero(y[3]) == 0
        for name, ref in g_ref.items():
            if name == "top_k_weights":
                assert torch.count_nonzero(grads[name][sentinel]) == 0
                assert_close(grads[name][~sentinel], ref[~sentinel], tol, "grad top_k_weights")
            else:
                assert_close(grads[name], ref, tol, f"grad {name}")
