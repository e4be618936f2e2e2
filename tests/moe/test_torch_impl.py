"""The MoE torch backend (`sparseops.moe.torch_impl`) against the float64 reference: every op and gradient, odd
shapes, windows, dtype pairs, its chunked and sparse paths, fully written outputs."""

import pytest
import torch

from sparseops import (
    moe_token_permute_with_ep,
    moe_token_permute_with_ep_grad,
    moe_token_unpermute_with_ep,
    moe_token_unpermute_with_ep_grad,
)
from sparseops.moe import checks, reference, torch_impl
from sparseops.testing import assert_close, make_moe_inputs, poison_

F64 = torch.float64

# (T, K, H, range, num_out_tokens, with_probs, index dtype): each tuple covers one edge, named by its id
CASES = [
    pytest.param(0, 2, 5, None, 0, True, torch.int32, id="T0-empty-tokens"),
    pytest.param(1, 1, 1, None, 0, True, torch.int64, id="T1-K1-H1"),
    pytest.param(7, 2, 5, None, 0, True, torch.int32, id="T7-K2-full-default"),
    pytest.param(7, 2, 5, [0, 14], 0, True, torch.int64, id="T7-K2-explicit-full"),
    pytest.param(7, 2, 5, [3, 9], 0, True, torch.int32, id="T7-K2-partial"),
    pytest.param(7, 2, 5, [-10, -2], 0, True, torch.int32, id="T7-K2-negative"),
    pytest.param(7, 2, 5, [4, 4], 0, True, torch.int32, id="T7-K2-empty-window"),
    pytest.param(7, 2, 5, [-100, 10**6], 0, True, torch.int64, id="T7-K2-clamped"),
    pytest.param(33, 8, 96, [20, 200], 0, True, torch.int32, id="T33-K8-H96-partial"),
    pytest.param(33, 8, 5, None, 0, False, torch.int64, id="T33-K8-no-probs"),
    pytest.param(7, 2, 5, [3, 9], 0, False, torch.int32, id="T7-K2-partial-no-probs"),
    pytest.param(7, 2, 5, None, 9, True, torch.int32, id="num-out-positive"),
    pytest.param(7, 2, 5, None, -4, True, torch.int32, id="num-out-negative"),
    pytest.param(7, 2, 5, None, 100, True, torch.int32, id="num-out-above-N"),
    pytest.param(7, 2, 5, None, -100, True, torch.int32, id="num-out-drops-all"),
    pytest.param(33, 8, 1, None, 150, False, torch.int64, id="num-out-no-probs"),
    pytest.param(2, 512, 3, [100, 900], 0, True, torch.int32, id="K512-max-topk"),
    pytest.param(5, 3, 5, None, 0, True, torch.int32, id="duplicate-experts"),
]


def _moe_inputs(T, K, H, dtype=F64, probs_dtype=None, index_dtype=torch.int32, seed=0):
    dup = K == 3  # the duplicate-experts case draws ids with repeats within a token
    return make_moe_inputs(T, K, H, num_experts=max(8, K + 1) if not dup else 2, dtype=dtype,
                           probs_dtype=probs_dtype, index_dtype=index_dtype, seed=seed, distinct_experts=not dup)


def _chain(backend, d, rng, num_out, with_probs, extra):
    """permute -> unpermute -> both grad ops, plus autograd through permute and unpermute."""
    probs = d["probs"] if with_probs else None
    t = d["tokens"].clone().requires_grad_()
    p = probs.clone().requires_grad_() if with_probs else None
    pt, si, pp = moe_token_permute_with_ep(t, d["indices"], p, rng, num_out, backend=backend)
    res = {"permuted_tokens": pt, "sorted_indices": si}
    if with_probs:
        res["permuted_probs"] = pp
    # autograd through permute
    loss = (pt * extra["w_pt"][: pt.shape[0]]).sum() + ((pp * extra["w_pp"][: pp.shape[0]]).sum() if with_probs else 0)
    if pt.numel() or with_probs:
        grads = torch.autograd.grad(loss, [t] + ([p] if with_probs else []), allow_unused=True)
        res["permute.tokens.grad"] = grads[0] if grads[0] is not None else torch.zeros_like(t)
        if with_probs:
            res["permute.probs.grad"] = grads[1] if grads[1] is not None else torch.zeros_like(p)
    K = d["indices"].shape[1]
    R = pt.shape[0]
    x = extra["x"][:R].clone().requires_grad_()
    p2 = probs.clone().requires_grad_() if with_probs else None
    out = moe_token_unpermute_with_ep(x, si, p2, K, rng, backend=backend)
    res["unpermute"] = out
    g_out = extra["g"]
    grads = torch.autograd.grad(out, [x] + ([p2] if with_probs else []), g_out, allow_unused=True)
    res["unpermute.x.grad"] = grads[0]
    if with_probs:
        res["unpermute.probs.grad"] = grads[1]
    ptg, pg = moe_token_unpermute_with_ep_grad(g_out, si, x.detach(), probs, range=rng, topk_num=K, backend=backend)
    res["unpermute_grad.ptg"] = ptg
    if with_probs:
        res["unpermute_grad.probs_grad"] = pg
    tg, pg2 = moe_token_permute_with_ep_grad(extra["w_pt"][:R], si, extra["w_pp"][:R] if with_probs else None, K,
                                             rng, backend=backend)
    res["permute_grad.tokens_grad"] = tg
    if with_probs:
        res["permute_grad.probs_grad"] = pg2
    return res


def _extra(T, K, H, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    N = T * K
    return {
        "w_pt": torch.randn(N, H, generator=g, dtype=F64).to(dtype),
        "w_pp": torch.randn(N, generator=g, dtype=F64).to(dtype),
        "x": torch.randn(N, H, generator=g, dtype=F64).to(dtype),
        "g": torch.randn(T, H, generator=g, dtype=F64).to(dtype),
    }


@pytest.mark.parametrize("T,K,H,rng,num_out,with_probs,index_dtype", CASES)
def test_torch_matches_reference_float64(T, K, H, rng, num_out, with_probs, index_dtype):
    d = _moe_inputs(T, K, H, index_dtype=index_dtype)
    extra = _extra(T, K, H)
    got = _chain("torch", d, rng, num_out, with_probs, extra)
    want = _chain("reference", d, rng, num_out, with_probs, extra)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == want[name].dtype, name
        if name == "sorted_indices":
            assert torch.equal(got[name], want[name])
        else:
            assert_close(got[name], want[name], F64, name=name)


def _window(T, K, rng, num_out):
    N = T * K
    if rng is None:
        e = N if num_out == 0 else (min(num_out, N) if num_out > 0 else max(N + num_out, 0))
        return 0, e
    s, e = [min(max(v + N if v < 0 else v, 0), N) for v in rng]
    return s, e


@pytest.mark.parametrize("T,K,H,rng,num_out,with_probs,index_dtype", CASES)
def test_permute_rows_and_shapes(T, K, H, rng, num_out, with_probs, index_dtype):
    """R = e - s rows; the no-probs and with-probs permute rows are bitwise copies of token rows."""
    d = _moe_inputs(T, K, H, index_dtype=index_dtype)
    s, e = _window(T, K, rng, num_out)
    pt, si, pp = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"] if with_probs else None, rng,
                                           num_out, backend="torch")
    assert pt.shape == (e - s, H) and si.shape == (T * K,) and si.dtype == torch.int32
    assert (pp is None) == (not with_probs)
    inv = torch.empty(T * K, dtype=torch.long)
    inv[si.long()] = torch.arange(T * K)
    slots = inv[s:e]
    assert torch.equal(pt, d["tokens"][slots // K])
    if with_probs:
        assert torch.equal(pp, d["probs"].reshape(-1)[slots])


INVARIANT_CASES = [
    pytest.param(1, 1, torch.int32, id="T1-K1"),
    pytest.param(33, 8, torch.int64, id="T33-K8-distinct"),
    pytest.param(64, 4, torch.int32, id="T64-K4-with-repeats"),
]


@pytest.mark.parametrize("T,K,index_dtype", INVARIANT_CASES)
def test_sorted_indices_invariants(T, K, index_dtype):
    g = torch.Generator().manual_seed(3)
    indices = torch.randint(0, 5, (T, K), generator=g).to(index_dtype)
    _, si, _ = moe_token_permute_with_ep(torch.zeros(T, 1), indices, backend="torch")
    N = T * K
    assert torch.equal(si.sort().values, torch.arange(N, dtype=torch.int32))  # a permutation
    inv = torch.empty(N, dtype=torch.long)
    inv[si.long()] = torch.arange(N)  # row -> slot
    experts = indices.reshape(-1)[inv]
    assert bool((experts[1:] >= experts[:-1]).all())  # each expert's rows are contiguous
    same = experts[1:] == experts[:-1]
    assert bool((inv[1:] > inv[:-1])[same].all())  # token-ascending (stable) inside an expert
    assert torch.bincount(experts, minlength=5).sum() == N


def _torch_and_float64_reference(d, extra, rng):
    """The op chain on the torch backend in the inputs' dtypes, and on the reference in float64 (upcast
    inputs); ``sorted_indices`` is checked bitwise here and left out of both results."""
    got = _chain("torch", d, rng, 0, True, extra)
    up = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in d.items()}
    want = _chain("reference", up, rng, 0, True, {k: v.to(F64) for k, v in extra.items()})
    assert torch.equal(got.pop("sorted_indices"), want.pop("sorted_indices"))
    return got, want


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_PAIRS = [pytest.param(a, b, id=f"tokens-{str(a)[6:]}-probs-{str(b)[6:]}") for a in DTYPES for b in DTYPES]


@pytest.mark.parametrize("dtype,probs_dtype", DTYPE_PAIRS)
def test_dtype_pairs_against_float64_reference(dtype, probs_dtype):
    T, K, H, rng = 33, 4, 96, [10, 120]
    d = _moe_inputs(T, K, H, dtype=dtype, probs_dtype=probs_dtype, seed=5)
    extra = _extra(T, K, H, dtype=dtype, seed=6)
    extra["w_pp"] = extra["w_pp"].to(probs_dtype)
    got, want = _torch_and_float64_reference(d, extra, rng)
    for name in want:
        out_dtype = got[name].dtype
        assert out_dtype == (probs_dtype if "prob" in name else dtype), name
        assert_close(got[name], want[name], out_dtype, name=name)
        assert not torch.isnan(got[name]).any(), name


def test_no_probs_paths_are_exact_copies():
    d = _moe_inputs(33, 8, 96, dtype=torch.bfloat16)
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], None, [5, 200], backend="torch")
    g = torch.randn(33, 96).to(torch.bfloat16)
    ptg, pg = moe_token_unpermute_with_ep_grad(g, si, None, None, range=[5, 200], topk_num=8, backend="torch")
    assert pg is None
    inv = torch.empty(264, dtype=torch.long)
    inv[si.long()] = torch.arange(264)
    assert torch.equal(pt, d["tokens"][inv[5:200] // 8])
    assert torch.equal(ptg, g[inv[5:200] // 8])
    # K = 1 unpermute without probs is the inverse permutation, exactly
    d1 = _moe_inputs(7, 1, 5, dtype=torch.float16)
    pt1, si1, _ = moe_token_permute_with_ep(d1["tokens"], d1["indices"], backend="torch")
    assert torch.equal(moe_token_unpermute_with_ep(pt1, si1, backend="torch"), d1["tokens"])


def test_zero_prob_rows_never_leak_inf_or_nan():
    T, K, H = 7, 2, 5
    d = _moe_inputs(T, K, H, dtype=torch.float32)
    probs = d["probs"].clone()
    probs[3, 1] = 0.0
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], probs, backend="torch")
    pt = pt.clone()
    pt[int(si[3 * K + 1])] = float("inf")
    pt[int(si[5 * K + 0])] = float("nan")
    probs[5, 0] = 0.0
    for backend in ("torch", "reference"):
        out = moe_token_unpermute_with_ep(pt, si, probs, backend=backend)
        assert torch.isfinite(out).all(), backend
    assert_close(moe_token_unpermute_with_ep(pt, si, probs, backend="torch"),
                 moe_token_unpermute_with_ep(pt, si, probs, backend="reference"))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_prob_of_a_slot_outside_the_window_is_never_read(bad):
    # token 3's slots (rows 6, 7) lie outside the window [0, 6): their probs belong to another rank and may hold
    # anything. 6 of 8 slots live and a tiny shape: the dense k loop (not the sparse or the fused one)
    si = torch.arange(8, dtype=torch.int32)
    pt = torch.ones(6, 3)
    probs = torch.full((4, 2), 0.5)
    probs[3, 1] = bad
    for backend in ("torch", "reference"):
        out = moe_token_unpermute_with_ep(pt, si, probs, range=[0, 6], backend=backend)
        assert torch.equal(out, torch.tensor([[1.0] * 3] * 3 + [[0.0] * 3])), backend


def test_tokens_without_valid_slot_get_zeros_not_nan():
    d = _moe_inputs(7, 2, 5, dtype=torch.float32)
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], [4, 4], backend="torch")
    assert pt.shape == (0, 5)
    out = moe_token_unpermute_with_ep(pt, si, d["probs"], range=[4, 4], backend="torch")
    assert torch.equal(out, torch.zeros(7, 5))
    ptg, pg = moe_token_unpermute_with_ep_grad(torch.randn(7, 5), si, pt, d["probs"], range=[4, 4], backend="torch")
    assert ptg.shape == (0, 5) and torch.equal(pg, torch.zeros(7, 2))
    tg, pg2 = moe_token_permute_with_ep_grad(pt, si, torch.empty(0), 2, [4, 4], backend="torch")
    assert torch.equal(tg, torch.zeros(7, 5)) and torch.equal(pg2, torch.zeros(7, 2))


@pytest.mark.parametrize("dtype", [pytest.param(d, id=str(d)[6:]) for d in DTYPES])
def test_repeated_calls_are_bitwise_identical(dtype):
    T, K, H, rng = 33, 8, 96, [7, 250]
    d = _moe_inputs(T, K, H, dtype=dtype)
    ex = _extra(T, K, H, dtype=dtype)
    a = _chain("torch", d, rng, 0, True, ex)
    b = _chain("torch", d, rng, 0, True, ex)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_chunked_paths_match_reference(override):
    """Shrink the chunk so that every loop runs many chunks with a ragged tail."""
    override(torch_impl.SETTINGS, chunk_bytes=1)
    for dtype in (F64, torch.bfloat16):
        d = _moe_inputs(40, 3, 5, dtype=dtype)
        ex = _extra(40, 3, 5, dtype=dtype)
        got = _chain("torch", d, [3, 100], 0, True, ex)
        up = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in d.items()}
        want = _chain("reference", up, [3, 100], 0, True, {k: v.to(F64) for k, v in ex.items()})
        for name in want:
            if name != "sorted_indices":
                assert_close(got[name], want[name], got[name].dtype, name=name)


def test_non_contiguous_inputs():
    d = _moe_inputs(7, 2, 10)
    tokens = d["tokens"][:, ::2]
    probs = d["probs"].t().contiguous().t()
    got = moe_token_permute_with_ep(tokens, d["indices"], probs, [2, 12], backend="torch")
    want = moe_token_permute_with_ep(tokens.contiguous(), d["indices"], probs.contiguous(), [2, 12], backend="reference")
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    g = torch.randn(5, 7, dtype=F64).t()
    a = moe_token_unpermute_with_ep_grad(g, got[1], got[0], probs, range=[2, 12], backend="torch")
    b = moe_token_unpermute_with_ep_grad(g.contiguous(), got[1], got[0], probs.contiguous(), range=[2, 12],
                                         backend="reference")
    for x, y in zip(a, b):
        assert_close(x, y, F64)


class _PoisonedTorch:
    """``torch`` with ``empty`` / ``empty_like`` returning NaN-filled (ints: -1) tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return poison_(torch.empty(*args, **kwargs))

    @staticmethod
    def empty_like(*args, **kwargs):
        return poison_(torch.empty_like(*args, **kwargs))


@pytest.mark.parametrize("rng", [pytest.param(None, id="full"), pytest.param([3, 100], id="partial"),
                                 pytest.param([50, 50], id="empty")])
@pytest.mark.parametrize("dtype", [pytest.param(F64, id="float64"), pytest.param(torch.bfloat16, id="bfloat16")])
def test_poisoned_buffers_are_fully_written(override, monkeypatch, rng, dtype):
    """Every buffer torch_impl allocates without initialising starts as NaN: an element that no code path
    writes shows up as NaN in the outputs."""
    monkeypatch.setattr(torch_impl, "torch", _PoisonedTorch())
    override(torch_impl.SETTINGS, chunk_bytes=64)  # many chunks, ragged tail
    d = _moe_inputs(40, 3, 5, dtype=dtype)
    ex = _extra(40, 3, 5, dtype=dtype)
    got, want = _torch_and_float64_reference(d, ex, rng)
    for name in want:
        assert not torch.isnan(got[name]).any(), name
        assert_close(got[name], want[name], got[name].dtype, name=name)


def test_huge_page_advice_changes_no_value(override, monkeypatch):
    """With every output advised ``MADV_HUGEPAGE`` (threshold 1 byte) the results are bitwise those without
    advice, and the advice is actually given on Linux."""
    import sys

    d = _moe_inputs(40, 3, 70, dtype=torch.bfloat16)
    ex = _extra(40, 3, 70, dtype=torch.bfloat16)
    monkeypatch.setattr(torch_impl, "_madvise", None)
    plain = _chain("torch", d, [3, 100], 0, True, ex)
    calls = []

    def counting(addr, length, advice):
        calls.append((addr, length, advice))
        assert addr % 64 == 0 and length % 64 == 0 and length > 0
        return 0

    monkeypatch.setattr(torch_impl, "_madvise", counting)
    override(torch_impl.SETTINGS, huge_min_bytes=1)
    override(torch_impl.SETTINGS, page_bytes=64)  # small test buffers hold whole "pages"
    advised = _chain("torch", d, [3, 100], 0, True, ex)
    for name in plain:
        assert torch.equal(plain[name], advised[name]), name
    assert calls
    # the real advice on a real 4 MiB buffer: the tensor is usable and holds what is written
    monkeypatch.setattr(torch_impl, "_madvise", torch_impl._load_madvise())
    override(torch_impl.SETTINGS, page_bytes=4096)
    x = torch_impl._empty_rows(1024, 1024, torch.float32, torch.device("cpu"))
    assert x.shape == (1024, 1024) and x.dtype == torch.float32
    x.fill_(2.5)
    assert bool((x == 2.5).all())
    if sys.platform.startswith("linux"):
        assert torch_impl._madvise is not None


@pytest.mark.parametrize("fraction", [0.0, 2.0], ids=["walk-all-slots", "live-slots-only"])
@pytest.mark.parametrize("rng", [None, [5, 40], [30, 31], [-9, -9]], ids=["full", "partial", "one-row", "empty"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_both_k_sum_paths_match_reference(override, fraction, rng, with_probs):
    """unpermute and permute_grad sum over k either by walking every slot or by gathering live slots only
    (chosen by the live share); force each path on every window and compare with the float64 oracle."""
    override(torch_impl.SETTINGS, sparse_fraction=fraction)
    d = make_moe_inputs(11, 5, 7, num_experts=6, dtype=torch.float64, seed=3)
    probs = d["probs"].clone()
    probs[2, 1] = 0.0  # a zero prob is skipped on both paths
    probs = probs if with_probs else None
    _, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], backend="reference")
    s, e = checks.normalize_range(rng, si.numel(), si.numel())
    x = torch.randn(e - s, 7, dtype=torch.float64)
    got = torch_impl.unpermute(x, si, probs, 5, s, e)
    want = reference.unpermute(x, si, probs, 5, s, e)
    assert_close(got, want, torch.float64, name="unpermute")
    tg, _ = torch_impl.permute_grad(x, si, None, 5, s, e)
    tg_ref, _ = reference.permute_grad(x, si, None, 5, s, e)
    assert_close(tg, tg_ref, torch.float64, name="permute_grad")
