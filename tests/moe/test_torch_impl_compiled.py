"""The seed op's compiled CPU kernel (``sparseops._compile``, torch.compile / inductor) against the float64
reference and against the eager path; its switches and its fallback.

The kernel is taken from ``R * H >= compiled_min_elements`` elements (``torch_impl.SETTINGS``); these tests
lower that threshold to 0 so that small odd shapes reach it. Each dtype compiles once per process (a few seconds).
"""

import warnings

import pytest
import torch

from sparseops import _compile, moe_token_permute_with_ep, moe_token_unpermute_with_ep_grad
from sparseops.moe import torch_impl
from sparseops.testing import assert_close, make_moe_inputs

F64 = torch.float64
DTYPES = [pytest.param(d, id=str(d)[6:]) for d in (torch.float32, torch.bfloat16, torch.float16)]

# (T, K, H, range): each tuple covers one edge
SHAPES = [
    pytest.param(7, 2, 33, None, id="T7-K2-H33-full"),
    pytest.param(33, 8, 96, [20, 200], id="T33-K8-partial-window"),
    pytest.param(64, 4, 130, [-200, -56], id="negative-range-H130-vector-tail"),
    pytest.param(5, 3, 17, [2, 4], id="window-of-two-rows"),
    pytest.param(2, 16, 2, None, id="T2-H2-smallest-compiled"),
]


@pytest.fixture
def compiled(override, monkeypatch):
    override(torch_impl.SETTINGS, compiled_min_elements=0)
    monkeypatch.delenv("SPARSEOPS_COMPILE", raising=False)
    return torch_impl._unpermute_grad_fused


def _seed_case(T, K, H, rng, dtype, seed=0, zero_probs=False):
    d = make_moe_inputs(T, K, H, num_experts=max(8, K + 1), dtype=dtype, seed=seed, distinct_experts=True)
    probs = d["probs"].clone()
    if zero_probs:
        probs[::2, 0] = 0
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], probs, rng, backend="torch")
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1), dtype=F64).to(dtype)
    return g, si, pt, probs


def _seed(g, si, pt, probs, rng, K, backend="torch"):
    return moe_token_unpermute_with_ep_grad(g, si, pt, probs, range=rng, topk_num=K, backend=backend)


@pytest.mark.parametrize("T,K,H,rng", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernel_matches_float64_reference(compiled, T, K, H, rng, dtype):
    g, si, pt, probs = _seed_case(T, K, H, rng, dtype, zero_probs=True)
    before = compiled.calls
    ptg, pg = _seed(g, si, pt, probs, rng, K)
    assert compiled.failed is None
    assert compiled.calls == before + 1, "the compiled kernel was not taken"
    want_ptg, want_pg = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), rng, K, backend="reference")
    assert ptg.dtype == dtype and pg.dtype == dtype
    assert_close(ptg, want_ptg, dtype, name="permuted_tokens_grad")
    assert_close(pg, want_pg, dtype, name="probs_grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_and_eager_paths_agree(compiled, monkeypatch, dtype):
    """Same expressions, fp32 math, one rounding: ptg is bitwise the eager result; probs_grad sums in another
    order, so it agrees to the dtype's tolerance."""
    T, K, H, rng = 40, 8, 72, [30, 290]
    g, si, pt, probs = _seed_case(T, K, H, rng, dtype, seed=3)
    before = compiled.calls
    a = _seed(g, si, pt, probs, rng, K)
    assert compiled.calls == before + 1
    monkeypatch.setenv("SPARSEOPS_COMPILE", "0")
    b = _seed(g, si, pt, probs, rng, K)
    assert compiled.calls == before + 1, "SPARSEOPS_COMPILE=0 must keep the eager path"
    assert torch.equal(a[0], b[0])
    assert_close(a[1], b[1], dtype, name="probs_grad")


def test_compiled_kernel_is_deterministic(compiled):
    T, K, H, rng = 50, 8, 256, None
    g, si, pt, probs = _seed_case(T, K, H, rng, torch.bfloat16, seed=4)
    a = _seed(g, si, pt, probs, rng, K)
    b = _seed(g, si, pt, probs, rng, K)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_compiled_kernel_writes_every_output_element(compiled, monkeypatch):
    """Outputs start as NaN; every element must be overwritten (window rows by the kernel, probs_grad of
    slots outside the window by the zero fill)."""
    T, K, H, rng = 33, 4, 40, [7, 100]
    g, si, pt, probs = _seed_case(T, K, H, rng, torch.float32, seed=6)
    _seed(g, si, pt, probs, rng, K)  # compiled before torch.empty is patched
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch_impl.torch, "empty", poisoned_empty)
    ptg, pg = _seed(g, si, pt, probs, rng, K)
    monkeypatch.undo()
    assert not torch.isnan(ptg).any() and not torch.isnan(pg).any()


def test_small_and_float64_calls_stay_eager(override, monkeypatch):
    kern = torch_impl._unpermute_grad_fused
    before = kern.calls
    g, si, pt, probs = _seed_case(7, 2, 5, None, torch.float32)  # R * H = 70, under the default threshold
    _seed(g, si, pt, probs, None, 2)
    override(torch_impl.SETTINGS, compiled_min_elements=0)
    _seed(g.to(F64), si, pt.to(F64), probs.to(F64), None, 2)  # float64: eager
    g1, si1, pt1, p1 = _seed_case(1, 4, 8, None, torch.float32)  # T = 1: inductor would specialise, eager
    _seed(g1, si1, pt1, p1, None, 4)
    assert kern.calls == before


@pytest.mark.parametrize("dtype,probs_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_compiled_kernel_with_a_probs_dtype_of_its_own(compiled, dtype, probs_dtype):
    T, K, H, rng = 21, 4, 40, [3, 70]
    g, si, pt, probs = _seed_case(T, K, H, rng, dtype, seed=7)
    probs = probs.to(probs_dtype)
    before = compiled.calls
    ptg, pg = _seed(g, si, pt, probs, rng, K)
    assert compiled.calls == before + 1
    want_ptg, want_pg = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), rng, K, backend="reference")
    assert ptg.dtype == dtype and pg.dtype == probs_dtype
    assert_close(ptg, want_ptg, dtype, name="permuted_tokens_grad")
    assert_close(pg, want_pg, probs_dtype, name="probs_grad")


def test_a_failed_compile_warns_once_and_falls_back(override, monkeypatch):
    """No C++ compiler (or any inductor failure): one RuntimeWarning, then the eager path, same results."""

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return run

    monkeypatch.setattr(_compile.torch, "compile", broken_compile)
    kern = _compile.CompiledKernel(torch_impl._unpermute_grad_fused.fn, "test_kernel")
    monkeypatch.setattr(torch_impl, "_unpermute_grad_fused", kern)
    override(torch_impl.SETTINGS, compiled_min_elements=0)
    T, K, H, rng = 9, 2, 12, None
    g, si, pt, probs = _seed_case(T, K, H, rng, torch.float32, seed=8)
    with pytest.warns(RuntimeWarning, match="test_kernel failed for dtypes .*no C\\+\\+ compiler found"):
        got = _seed(g, si, pt, probs, rng, K)
    assert kern.failed == "RuntimeError: no C++ compiler found"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        again = _seed(g, si, pt, probs, rng, K)
    want = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), rng, K, backend="reference")
    for x, y, name in zip(got, want, ("permuted_tokens_grad", "probs_grad")):
        assert_close(x, y, torch.float32, name=name)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    monkeypatch.setattr(_compile, "KERNELS", [kern])
    assert "test_kernel (RuntimeError: no C++ compiler found)" in _compile.status()


def test_status_line_reports_the_switch(monkeypatch):
    monkeypatch.setenv("SPARSEOPS_COMPILE", "0")
    assert _compile.status().startswith("off (SPARSEOPS_COMPILE=0)")
    assert not _compile.enabled()
    monkeypatch.delenv("SPARSEOPS_COMPILE")
    assert _compile.enabled()


def test_compiled_kernel_inside_a_compiled_caller(compiled):
    """A user's torch.compile'd function calls the op: the custom op runs its kernel at run time, where the
    compiled CPU kernel is used as in eager mode."""
    T, K, H, rng = 24, 4, 48, [5, 80]
    g, si, pt, probs = _seed_case(T, K, H, rng, torch.float32, seed=9)

    @torch.compile(fullgraph=True, dynamic=False)
    def step(g, pt, probs):
        ptg, pg = moe_token_unpermute_with_ep_grad(g, si, pt, probs, range=rng, topk_num=K, backend="torch")
        return ptg * 2, pg.sum()

    got = step(g, pt, probs)
    want = _seed(g, si, pt, probs, rng, K)
    assert_close(got[0], want[0] * 2, torch.float32)
    assert_close(got[1], want[1].sum(), torch.float32)


def test_compiled_kernel_under_autograd_and_inference_mode(compiled):
    """The kernel runs inside the autograd backward of ``moe_token_unpermute_with_ep`` and under
    ``torch.inference_mode``."""
    from sparseops import moe_token_unpermute_with_ep

    T, K, H, rng = 30, 4, 40, [9, 101]
    g, si, pt, probs = _seed_case(T, K, H, rng, torch.float32, seed=10)
    x = pt.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    before = compiled.calls
    out = moe_token_unpermute_with_ep(x, si, p, K, rng, backend="torch")
    dx, dp = torch.autograd.grad(out, [x, p], g)
    assert compiled.calls == before + 1
    want = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), rng, K, backend="reference")
    assert_close(dx, want[0], torch.float32, name="permuted_tokens.grad")
    assert_close(dp, want[1], torch.float32, name="probs.grad")
    with torch.inference_mode():
        got = _seed(g, si, pt, probs, rng, K)
    assert compiled.calls == before + 2
    assert torch.equal(got[0], dx)


def test_each_dtype_has_its_own_recompile_budget(override, monkeypatch):
    """With dynamo's recompile limit at 1, fp32 then bf16 calls both compile: each dtype combination gets its
    own code object (its own cache), so one dtype never uses up another's budget."""
    import torch._dynamo

    kern = _compile.CompiledKernel(torch_impl._unpermute_grad_fused.fn, "budget_test")
    monkeypatch.setattr(torch_impl, "_unpermute_grad_fused", kern)
    override(torch_impl.SETTINGS, compiled_min_elements=0)
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        g, si, pt, probs = _seed_case(11, 2, 24, None, dtype, seed=12)
        with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=1):
            warnings.simplefilter("error", RuntimeWarning)
            got = _seed(g, si, pt, probs, None, 2)
        assert kern.calls == i + 1 and kern.failed is None
        want = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), None, 2, backend="reference")
        assert_close(got[0], want[0], dtype, name="permuted_tokens_grad")


def test_disabled_dynamo_keeps_the_eager_path(compiled):
    """With dynamo disabled torch.compile would run the kernel's lines unfused (full-size temporaries): the
    eager chunk loop is used instead."""
    import torch._dynamo

    g, si, pt, probs = _seed_case(9, 2, 12, None, torch.float32, seed=13)
    before = compiled.calls
    with torch._dynamo.config.patch(disable=True):
        got = _seed(g, si, pt, probs, None, 2)
    assert compiled.calls == before
    want = _seed(g.to(F64), si, pt.to(F64), probs.to(F64), None, 2, backend="reference")
    assert_close(got[0], want[0], torch.float32, name="permuted_tokens_grad")


# ---- the k-ordered sums (unpermute, permute_grad) -------------------------------------------------------------
# K is unrolled in the kernel (one compile per K and dtype): the cases share K in {2, 8, 16} to bound CI time.

KSUM_SHAPES = [
    pytest.param(7, 2, 33, None, True, id="T7-K2-H33-full-probs"),
    pytest.param(33, 8, 96, [20, 200], True, id="T33-K8-partial-window"),
    pytest.param(64, 8, 130, [200, 260], True, id="sparse-window-most-slots-dead"),
    pytest.param(40, 2, 17, [-70, -10], False, id="no-probs-negative-range"),
    pytest.param(9, 16, 5, None, True, id="K16-largest-compiled"),
]


@pytest.fixture
def ksum(override, monkeypatch):
    override(torch_impl.SETTINGS, compiled_min_elements=0)
    monkeypatch.delenv("SPARSEOPS_COMPILE", raising=False)
    return torch_impl._sum_over_k_fused


@pytest.mark.parametrize("T,K,H,rng,with_probs", KSUM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ksum_kernel_matches_float64_reference(ksum, T, K, H, rng, with_probs, dtype):
    """unpermute (weighted, zero probs skipped) and permute_grad (plain sum) through the compiled kernel."""
    from sparseops import moe_token_permute_with_ep_grad, moe_token_unpermute_with_ep

    g, si, pt, probs = _seed_case(T, K, H, rng, dtype, zero_probs=True)
    p = probs if with_probs else None
    before = ksum.calls
    out = moe_token_unpermute_with_ep(pt, si, p, K, rng, backend="torch")
    tg, _ = moe_token_permute_with_ep_grad(pt, si, None, K, rng, backend="torch")
    assert ksum.failed is None
    assert ksum.calls == before + 2, "the compiled k-sum was not taken"
    p64 = None if p is None else p.to(F64)
    want = moe_token_unpermute_with_ep(pt.to(F64), si, p64, K, rng, backend="reference")
    want_tg, _ = moe_token_permute_with_ep_grad(pt.to(F64), si, None, K, rng, backend="reference")
    assert out.dtype == dtype and tg.dtype == dtype
    assert_close(out, want, dtype, name="unpermuted_tokens")
    assert_close(tg, want_tg, dtype, name="tokens_grad")


def test_ksum_kernel_never_multiplies_dead_or_zero_prob_rows(ksum):
    """A row that only zero-prob slots point at may hold inf / NaN: the outputs stay finite, as on the
    reference."""
    from sparseops import moe_token_unpermute_with_ep

    T, K, H = 20, 2, 40
    g, si, pt, probs = _seed_case(T, K, H, None, torch.float32, seed=14)
    probs = probs.clone()
    probs[3, 1] = 0.0
    probs[5, 0] = 0.0
    pt = pt.clone()
    pt[int(si[3 * K + 1])] = float("inf")
    pt[int(si[5 * K + 0])] = float("nan")
    before = ksum.calls
    got = moe_token_unpermute_with_ep(pt, si, probs, K, backend="torch")
    assert ksum.calls == before + 1
    assert torch.isfinite(got).all()
    assert_close(got, moe_token_unpermute_with_ep(pt, si, probs, K, backend="reference"), torch.float32)


def test_ksum_kernel_is_deterministic_and_skips_large_k(ksum):
    from sparseops import moe_token_unpermute_with_ep

    g, si, pt, probs = _seed_case(30, 8, 64, [10, 200], torch.bfloat16, seed=15)
    a = moe_token_unpermute_with_ep(pt, si, probs, 8, [10, 200], backend="torch")
    b = moe_token_unpermute_with_ep(pt, si, probs, 8, [10, 200], backend="torch")
    assert torch.equal(a, b)
    g, si, pt, probs = _seed_case(6, 17, 8, None, torch.float32, seed=16)  # K = 17 > _COMPILED_MAX_K: eager
    before = ksum.calls
    got = moe_token_unpermute_with_ep(pt, si, probs, 17, backend="torch")
    assert ksum.calls == before
    want = moe_token_unpermute_with_ep(pt.to(F64), si, probs.to(F64), 17, backend="reference")
    assert_close(got, want, torch.float32)


def test_ksum_kernel_under_autograd(ksum):
    """The forward ops' autograd: unpermute's forward and permute's backward both run the k-sum kernel."""
    T, K, H, rng = 24, 2, 40, [5, 40]
    d = make_moe_inputs(T, K, H, num_experts=8, dtype=torch.float32, seed=17, distinct_experts=True)
    t = d["tokens"].clone().requires_grad_()
    before = ksum.calls
    pt, si, _ = moe_token_permute_with_ep(t, d["indices"], None, rng, backend="torch")
    w = torch.randn(pt.shape, generator=torch.Generator().manual_seed(18))
    (gt,) = torch.autograd.grad((pt * w).sum(), [t])
    assert ksum.calls == before + 1
    t64 = d["tokens"].to(F64).requires_grad_()
    pt64, _, _ = moe_token_permute_with_ep(t64, d["indices"], None, rng, backend="reference")
    (want,) = torch.autograd.grad((pt64 * w.to(F64)).sum(), [t64])
    assert_close(gt, want, torch.float32, name="tokens.grad")


@pytest.mark.parametrize("T,K,H,rng,with_probs", KSUM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ksum_compiled_and_eager_paths_agree_bitwise(ksum, monkeypatch, T, K, H, rng, with_probs, dtype):
    """Each product rounded, then added in k order, on both paths: a token's sum does not depend on which path
    its call's size picks (the expert-parallel run's per-rank calls are smaller than one process's)."""
    from sparseops import moe_token_permute_with_ep_grad, moe_token_unpermute_with_ep

    g, si, pt, probs = _seed_case(T, K, H, rng, dtype, zero_probs=True)
    p = probs if with_probs else None
    before = ksum.calls
    a = moe_token_unpermute_with_ep(pt, si, p, K, rng, backend="torch")
    ta, _ = moe_token_permute_with_ep_grad(pt, si, None, K, rng, backend="torch")
    assert ksum.calls == before + 2
    monkeypatch.setenv("SPARSEOPS_COMPILE", "0")
    b = moe_token_unpermute_with_ep(pt, si, p, K, rng, backend="torch")
    tb, _ = moe_token_permute_with_ep_grad(pt, si, None, K, rng, backend="torch")
    assert ksum.calls == before + 2, "SPARSEOPS_COMPILE=0 must keep the eager path"
    assert torch.equal(a, b) and torch.equal(ta, tb)
