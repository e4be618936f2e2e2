"""compressed_attention against the float64 dense-mask reference: output, lse and gradients; queries that see no
complete block; every dtype; fp32 / fp16 / bf16 gradients on both CPU paths with non-contiguous inputs; small
chunks; gradcheck; bad input."""

import pytest
import torch

from sparseops import _cpu_attention
from sparseops.nsa_branches import chunked_attention, compress_kv, compressed_attention, reference
from sparseops.testing import assert_close

CASES = [
    # id: what edge it covers; cu_seqlens, N1, N2, Dqk, Dv, l, d
    ("paper-blocks-G1", [0, 130], 2, 2, 8, 8, 32, 16),
    ("packed-short-len0-G3", [0, 20, 20, 75, 140], 6, 2, 8, 4, 16, 8),
    ("fla-l-eq-d-G16", [0, 90], 16, 1, 8, 8, 16, 16),
    ("all-too-short", [0, 5, 12], 2, 1, 8, 8, 16, 8),
    ("G8-packed-len0", [0, 40, 40, 120], 16, 2, 8, 8, 16, 8),
]


@pytest.fixture(autouse=True, params=["cpu-kernels", "chunks"])
def _paths(request, nan_uninitialised):
    """Every test twice: the C++ range kernels wherever they build, any G (the cost model's kernel cost set to 0),
    and the chunked torch path (the kernels off)."""
    knob = {"kernel_pair_ns": 0.0} if request.param == "cpu-kernels" else {"cpu_kernels": False}
    with chunked_attention.SETTINGS.override(**knob):
        yield


def _inputs(cu, N1, N2, Dqk, Dv, l, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q = torch.randn(T, N1, Dqk, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(T, N2, Dqk, generator=g, dtype=torch.float64)
    v = torch.randn(T, N2, Dv, generator=g, dtype=torch.float64)
    kc, vc, cu_cmp = compress_kv(k, v, cu, l, d)
    # spread the compressed keys so that the scores are not all alike
    kc = (kc * 3).to(dtype).requires_grad_()
    return q, kc, vc.to(dtype).requires_grad_(), cu_cmp.tolist()


@pytest.mark.parametrize("small_chunks", [False, True], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_float64_forward_backward(case, small_chunks):
    _, cu, N1, N2, Dqk, Dv, l, d = case
    q, kc, vc, cu_cmp = _inputs(cu, N1, N2, Dqk, Dv, l, d)
    with chunked_attention.SETTINGS.override(chunk_bytes=1 if small_chunks else 16 << 20):
        o, lse = compressed_attention(q, kc, vc, cu, cu_cmp, l, d)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, kc, vc), do, allow_unused=True)
    o_ref, lse_ref = reference.compressed_attention(q, kc, vc, cu, cu_cmp, l, d, Dqk ** -0.5)
    ref_grads = torch.autograd.grad(o_ref, (q, kc, vc), do, allow_unused=True)
    assert_close(o, o_ref, name="o")
    assert_close(lse, lse_ref, name="lse")
    assert not lse.requires_grad
    for name, a, e in zip(("dq", "dk_cmp", "dv_cmp"), grads, ref_grads):
        assert_close(a if a is not None else torch.zeros_like(e), e if e is not None else torch.zeros_like(a),
                     name=name)


def test_queries_before_the_first_complete_block():
    cu = [0, 40]
    q, kc, vc, cu_cmp = _inputs(cu, 2, 1, 8, 8, 16, 8)
    o, lse = compressed_attention(q, kc, vc, cu, cu_cmp, 16, 8)
    # position 14 sees nothing; position 15 sees block 0 ([0, 16)) only, so its output is v_cmp[0]
    assert torch.equal(o[:15], torch.zeros_like(o[:15]))
    assert bool((lse[:15] == float("-inf")).all()) and bool(torch.isfinite(lse[15:]).all())
    assert_close(o[15], vc[0].expand(2, 8), name="o[15]")
    (dq,) = torch.autograd.grad(o.sum(), (q,))
    assert torch.equal(dq[:15], torch.zeros_like(dq[:15]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_forward(dtype):
    cu = [0, 70, 100]
    q, kc, vc, cu_cmp = _inputs(cu, 4, 2, 16, 16, 16, 8, dtype=dtype)
    o, lse = compressed_attention(q, kc, vc, cu, cu_cmp, 16, 8)
    o_ref, lse_ref = reference.compressed_attention(q, kc, vc, cu, cu_cmp, 16, 8, 0.25)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, dtype=dtype)
    assert_close(lse, lse_ref, dtype=dtype, name="lse")


def _gradients_against_reference(cu, N1, N2, l, d, dtype, monkeypatch, chunk_bytes):
    """o, lse, dq, dk_cmp, dv_cmp of ``dtype`` inputs (non-contiguous: every other element of ``[.., 2 * D]``)
    against the float64 reference on the same values, and which path ran: the C++ kernels where the settings allow
    them and G fills a vector (16 in fp32 / fp16 / bf16), else the chunks (of ``chunk_bytes``)."""
    calls = []
    for fn in ("forward_ranges", "backward_ranges"):
        real = getattr(_cpu_attention, fn)
        monkeypatch.setattr(_cpu_attention, fn, lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))
    Dqk, Dv = 16, 8
    q, kc, vc, cu_cmp = _inputs(cu, N1, N2, Dqk, Dv, l, d)
    q, kc, vc = (torch.stack((t, torch.zeros_like(t)), -1).flatten(-2).to(dtype)[..., ::2].detach().requires_grad_()
                 for t in (q, kc, vc))
    assert not (q.is_contiguous() or kc.is_contiguous() or vc.is_contiguous())
    kernels = chunked_attention.SETTINGS.get().cpu_kernels and _cpu_attention.available(q)
    with chunked_attention.SETTINGS.override(chunk_bytes=chunk_bytes):
        o, lse = compressed_attention(q, kc, vc, cu, cu_cmp, l, d)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        grads = torch.autograd.grad(o, (q, kc, vc), do)
    assert calls == (["forward_ranges", "backward_ranges"] if kernels else [])
    x64 = [t.detach().double().requires_grad_() for t in (q, kc, vc)]
    o_ref, lse_ref = reference.compressed_attention(*x64, cu, cu_cmp, l, d, Dqk ** -0.5)
    ref_grads = torch.autograd.grad(o_ref, x64, do.double())
    assert_close(o, o_ref, name="o")
    assert_close(lse, lse_ref, dtype=dtype, name="lse")
    for name, a, e in zip(("dq", "dk_cmp", "dv_cmp"), grads, ref_grads):
        assert a.dtype == dtype, name
        assert_close(a, e, name=name)


@pytest.mark.parametrize("N1, N2", [(16, 1), (4, 2)], ids=["G16", "G2"])
def test_float32_gradients(N1, N2, monkeypatch):
    """fp32 on both CPU paths (the C++ kernels at G = 16, a full vector of query heads, and G = 2; the chunks of
    one token): an empty sequence, one shorter than a block (l = 8), one longer."""
    _gradients_against_reference([0, 0, 5, 70], N1, N2, 8, 4, torch.float32, monkeypatch, chunk_bytes=1)


@pytest.mark.parametrize("N1, N2", [(16, 1), (4, 2)], ids=["G16", "G2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_gradients(dtype, N1, N2, monkeypatch):
    """fp16 / bf16 gradients where most queries see many blocks (l = d = 4: position p sees (p + 1) // 4 of them, only
    the first 31 positions of a sequence fewer than 8). Where a query sees 1-3 blocks bf16 dq can pass the
    tolerance: delta = rowsum(dO * O) uses the bf16-rounded O, as flash-attention 2 and CANN's grad op do."""
    _gradients_against_reference([0, 0, 100, 160], N1, N2, 4, 4, dtype, monkeypatch, chunk_bytes=16 << 20)


def test_gradcheck():
    cu = [0, 14, 23]
    q, kc, vc, cu_cmp = _inputs(cu, 2, 1, 4, 3, 4, 2)
    assert torch.autograd.gradcheck(
        lambda q, kc, vc: compressed_attention(q, kc, vc, cu, cu_cmp, 4, 2)[0], (q, kc, vc), fast_mode=True)


BAD = [
    ("cu-cmp-mismatch", dict(cu_seqlens_cmp=[0, 2]), ValueError, "cu_seqlens_cmp"),
    ("stride-not-dividing", dict(stride=3), ValueError, "stride"),
    ("k-cmp-head-dim", dict(k_cmp=torch.zeros(3, 1, 5)), ValueError, "k_cmp"),
    ("Dqk-0", dict(q=torch.zeros(16, 2, 0), k_cmp=torch.zeros(3, 1, 0)), ValueError, "q"),  # scale 0 ** -0.5
    ("Dv-0", dict(v_cmp=torch.zeros(3, 1, 0)), ValueError, "v_cmp"),
    ("v-cmp-blocks", dict(v_cmp=torch.zeros(2, 1, 8)), ValueError, "v_cmp"),
    ("v-cmp-dtype", dict(v_cmp=torch.zeros(3, 1, 8, dtype=torch.bfloat16)), TypeError, "v_cmp"),
    ("scale-nan", dict(scale=float("nan")), ValueError, "scale"),
    ("cu-tuple-of-floats", dict(cu_seqlens=(0, 16.0)), TypeError, "cu_seqlens"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    _, changes, exc, name = case
    # T = 16, l = 8, d = 4: C = 3
    args = dict(q=torch.zeros(16, 2, 8), k_cmp=torch.zeros(3, 1, 8), v_cmp=torch.zeros(3, 1, 8), cu_seqlens=None,
                cu_seqlens_cmp=[0, 3], block_size=8, stride=4)
    args.update(changes)
    with pytest.raises(exc, match=f"^{name}:"):
        compressed_attention(**args)
