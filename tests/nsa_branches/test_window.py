"""sliding_window_attention against the float64 dense-mask reference: output and gradients, every dtype, packed
sequences, small chunks, fp32 / fp16 / bf16 gradients on both CPU paths with non-contiguous inputs, gradcheck,
torch.compile, bad input."""

import pytest
import torch

from sparseops import _cpu_attention
from sparseops.nsa_branches import chunked_attention, reference, sliding_window_attention
from sparseops.testing import assert_close

CASES = [
    # id: what edge it covers; cu_seqlens, N1, N2, Dqk, Dv, window
    ("w1-itself-only", [0, 9], 2, 1, 8, 8, 1),
    ("w3-G3-Dv-smaller", [0, 20], 6, 2, 8, 4, 3),
    ("packed-len0-len1", [0, 7, 7, 8, 40], 4, 2, 16, 8, 5),
    ("window-longer-than-seq", [0, 13, 30], 3, 3, 8, 8, 100),
    ("G16", [0, 50], 16, 1, 8, 8, 17),
    ("G8-packed-len0", [0, 30, 30, 95], 16, 2, 16, 8, 9),
    ("G16-w100-visits-across-64", [0, 150, 301], 16, 1, 8, 12, 100),  # each token's keys in up to 3 visits
]


@pytest.fixture(autouse=True, params=["cpu-kernels", "chunks"])
def _paths(request, nan_uninitialised):
    """Every test twice: the C++ range kernels wherever they build, any G (the cost model's kernel cost set to 0),
    and the chunked torch path (the kernels off)."""
    knob = {"kernel_pair_ns": 0.0} if request.param == "cpu-kernels" else {"cpu_kernels": False}
    with chunked_attention.SETTINGS.override(**knob):
        yield


def _inputs(cu, N1, N2, Dqk, Dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    return [torch.randn(T, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n, D in ((N1, Dqk), (N2, Dqk), (N2, Dv))]


# (chunk_bytes, window_rows): one chunk per sequence; chunks of 5 tokens (a band with keys every query sees
# between the two masked edges when w > 5); chunks of one token
CHUNKINGS = {"one-chunk": (16 << 20, 256), "mid-chunks": (16 << 20, 5), "many-chunks": (1, 3)}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_float64_forward_backward(case, chunking):
    _, cu, N1, N2, Dqk, Dv, w = case
    q, k, v = _inputs(cu, N1, N2, Dqk, Dv)
    chunk_bytes, rows = CHUNKINGS[chunking]
    with chunked_attention.SETTINGS.override(chunk_bytes=chunk_bytes, window_rows=rows):
        o = sliding_window_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), w)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref = reference.sliding_window_attention(q, k, v, cu, w, Dqk ** -0.5)
    ref_grads = torch.autograd.grad(o_ref, (q, k, v), do)
    assert_close(o, o_ref, name="o")
    for name, a, e in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(a, e, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_forward(dtype):
    q, k, v = _inputs([0, 30, 64], 4, 2, 16, 16, dtype=dtype)
    o = sliding_window_attention(q, k, v, [0, 30, 64], 9)
    assert o.dtype == dtype
    assert_close(o, reference.sliding_window_attention(q, k, v, [0, 30, 64], 9, 0.25), dtype=dtype)


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_float32_extreme_scores(chunking):
    # scores of std ~40: a hidden key's exp(s - max) overflows, visible keys' underflow; the masked edges are
    # clamped before exp and zeroed after, so neither an inf nor a NaN reaches the result
    q, k, v = _inputs([0, 40], 4, 1, 8, 8)
    q = (q.detach() * 40).requires_grad_()
    chunk_bytes, rows = CHUNKINGS[chunking]
    x = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with chunked_attention.SETTINGS.override(chunk_bytes=chunk_bytes, window_rows=rows):
        o = sliding_window_attention(*x, None, 9)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, x, do)
    o_ref = reference.sliding_window_attention(q, k, v, [0, 40], 9, 8 ** -0.5)
    ref_grads = torch.autograd.grad(o_ref, (q, k, v), do.double())
    assert_close(o, o_ref, name="o", dtype=torch.float32)
    for name, a, e in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(a, e, name=name, dtype=torch.float32)


def _strided(cu, N1, N2, Dqk, Dv, dtype, seed=0):
    """q, k, v as non-contiguous leaves: every other element of ``[T, N, 2 * D]``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(cu[-1], n, 2 * D, generator=g, dtype=torch.float64).to(dtype)[..., ::2].requires_grad_()
            for n, D in ((N1, Dqk), (N2, Dqk), (N2, Dv))]


def _gradients_against_reference(cu, N1, N2, Dqk, Dv, w, dtype, monkeypatch, rows):
    """o, dq, dk, dv of ``dtype`` inputs against the float64 reference on the same values, and which path ran: the
    C++ kernels where the settings allow them and G fills a vector (16 in fp32 / fp16 / bf16), else the chunks
    (of ``rows`` tokens)."""
    calls = []
    for fn in ("forward_ranges", "backward_ranges"):
        real = getattr(_cpu_attention, fn)
        monkeypatch.setattr(_cpu_attention, fn, lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))
    q, k, v = _strided(cu, N1, N2, Dqk, Dv, dtype)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    kernels = chunked_attention.SETTINGS.get().cpu_kernels and _cpu_attention.available(q)
    with chunked_attention.SETTINGS.override(window_rows=rows):
        o = sliding_window_attention(q, k, v, cu, w)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        grads = torch.autograd.grad(o, (q, k, v), do)
    assert calls == (["forward_ranges", "backward_ranges"] if kernels else [])
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_ref = reference.sliding_window_attention(*x64, cu, w, Dqk ** -0.5)
    ref_grads = torch.autograd.grad(o_ref, x64, do.double())
    assert_close(o, o_ref, name="o")
    for name, a, e in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert a.dtype == dtype, name
        assert_close(a, e, name=name)


@pytest.mark.parametrize("N1, N2", [(16, 1), (4, 2)], ids=["G16", "G2"])
def test_float32_gradients(N1, N2, monkeypatch):
    """fp32 o, dq, dk, dv on both CPU paths (the C++ kernels at G = 16, a full vector of query heads, and G = 2; the
    chunks of 2 tokens), non-contiguous inputs: an empty sequence, one shorter
    than the window, one longer."""
    _gradients_against_reference([0, 0, 3, 47], N1, N2, 16, 8, 9, torch.float32, monkeypatch, rows=2)


@pytest.mark.parametrize("N1, N2", [(16, 1), (4, 2)], ids=["G16", "G2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_gradients(dtype, N1, N2, monkeypatch):
    """fp16 / bf16 gradients where nearly every query sees many keys (w = 16; only each sequence's first 7
    positions see fewer). Where a query sees 1-3 keys bf16 dq can pass the tolerance: delta = rowsum(dO * O) uses
    the bf16-rounded O, as flash-attention 2 and CANN's grad op (which takes attention_out) do."""
    _gradients_against_reference([0, 0, 40, 96], N1, N2, 16, 16, 16, dtype, monkeypatch, rows=16)


def _route_of(N1, cu, w, D):
    q = torch.zeros(cu[-1], N1, D)
    k = v = torch.zeros(cu[-1], 1, D)
    return chunked_attention._route(q, k, v, cu, cu, 0, 0, w)[0]


def test_route_by_cost():
    """The default cost model: a full vector of query heads always takes the kernels; below it, many short
    sequences or a small window take the kernels (the chunks pay per chunk, at least one per sequence, and a window
    chunk computes ``rows + w - 1`` keys for ``w``), one long sequence with a wide window the chunks."""
    if not _cpu_attention.available(torch.zeros(1, 1, 1)):
        pytest.skip("the C++ kernels do not build here")
    defaults = {f: getattr(chunked_attention.ChunkSettings(), f) for f in ("cpu_kernels", "kernel_pair_ns")}
    with chunked_attention.SETTINGS.override(**defaults):
        assert _route_of(16, [0, 4096], 512, 64) == "ranges"
        assert _route_of(4, list(range(0, 4097, 2)), 512, 64) == "ranges"
        assert _route_of(4, [0, 4096], 32, 32) == "ranges"
        assert _route_of(1, [0, 4096], 512, 64) == "chunks"


def test_gradcheck():
    q, k, v = _inputs([0, 5, 11], 2, 1, 4, 3)
    assert torch.autograd.gradcheck(lambda q, k, v: sliding_window_attention(q, k, v, [0, 5, 11], 3), (q, k, v),
                                     fast_mode=True)


def test_torch_compile_matches_eager():
    q, k, v = _inputs([0, 24, 40], 4, 2, 8, 8, dtype=torch.float32)
    fn = torch.compile(lambda q, k, v: sliding_window_attention(q, k, v, [0, 24, 40], 7), backend="eager",
                       fullgraph=True)
    o = fn(q, k, v)
    o.sum().backward()
    o_eager = sliding_window_attention(q, k, v, [0, 24, 40], 7)
    assert torch.equal(o, o_eager)


BAD = [
    ("window-0", dict(window=0), ValueError, "window"),
    ("cu-no-leading-0", dict(cu_seqlens=[3, 10]), ValueError, "cu_seqlens"),
    ("cu-decreasing", dict(cu_seqlens=[0, 6, 4, 10]), ValueError, "cu_seqlens"),
    ("cu-wrong-total", dict(cu_seqlens=[0, 9]), ValueError, "cu_seqlens"),
    ("cu-float", dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens"),
    ("k-dtype", dict(k=torch.zeros(10, 1, 8, dtype=torch.float64)), TypeError, "k"),
    ("k-2d", dict(k=torch.zeros(10, 8)), ValueError, "k"),
    ("v-length", dict(v=torch.zeros(9, 1, 8)), ValueError, "v"),
    ("G-over-32", dict(q=torch.zeros(10, 33, 8)), ValueError, "q"),
    ("N2-not-dividing", dict(q=torch.zeros(10, 3, 8), k=torch.zeros(10, 2, 8), v=torch.zeros(10, 2, 8)),
     ValueError, "k"),
    ("q-int", dict(q=torch.zeros(10, 2, 8, dtype=torch.int32)), TypeError, "q"),
    ("Dqk-0", dict(q=torch.zeros(10, 2, 0), k=torch.zeros(10, 1, 0)), ValueError, "q"),  # scale 0 ** -0.5
    ("Dv-0", dict(v=torch.zeros(10, 1, 0)), ValueError, "v"),
    ("cu-meta", dict(cu_seqlens=torch.tensor([0, 10], device="meta")), ValueError, "cu_seqlens"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    _, changes, exc, name = case
    args = dict(q=torch.zeros(10, 2, 8), k=torch.zeros(10, 1, 8), v=torch.zeros(10, 1, 8), cu_seqlens=None,
                window=4)
    args.update(changes)
    with pytest.raises(exc, match=f"^{name}:"):
        sliding_window_attention(**args)


def test_double_backward_is_a_clear_error():
    q, k, v = _inputs([0, 5, 11], 2, 1, 4, 3)
    (dq,) = torch.autograd.grad(sliding_window_attention(q, k, v, [0, 5, 11], 3).pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="backward of sliding_window_attention .* not differentiable"):
        dq.pow(2).sum().backward()
