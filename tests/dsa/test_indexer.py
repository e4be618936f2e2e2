"""indexer_topk against the dense float64 scores (index_scores): the exact selection with ties to the smaller
position, short sequences, varlen, causal and not, chunking, the scores' gradients, fp16 selection; bad input."""

import pytest
import torch

from sparseops.dsa import index_scores, indexer, indexer_topk
from sparseops.testing import assert_close

# every test on both CPU paths: the C++ kernels (where they build) and the torch ops
pytestmark = pytest.mark.usefixtures("cpu_paths")


def _inputs(T, Hi=3, Di=8, dtype=torch.float64, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hi, Di, generator=g, dtype=torch.float64)
    k = torch.randn(T, Di, generator=g, dtype=torch.float64)
    w = torch.randn(T, Hi, generator=g, dtype=torch.float64)
    if ties:  # few distinct keys: many equal scores in every row, on quarter-integers so that every sum is
        # exact: a GEMM may round identical columns differently (edge tiles), which would break the dense
        # reference's ties
        q, k, w = ((x * 4).round() / 4 for x in (q, k[torch.randint(0, 3, (T,), generator=g)], w))
    return [t.to(dtype).requires_grad_() for t in (q, k, w)]


def _expected(q, k, w, topk, cu, causal):
    """Per row of the dense scores: a stable descending sort (ties keep position order), the finite ones first."""
    dense = index_scores(q, k, w, cu_seqlens=cu, causal=causal)
    T = dense.shape[0]
    starts = torch.zeros(T, dtype=torch.int64)
    for a, b in zip(cu[:-1], cu[1:]):
        starts[a:b] = a
    order = torch.sort(dense.detach(), dim=1, descending=True, stable=True).indices[:, :topk]
    val = dense.gather(1, order)
    idx = torch.where(torch.isfinite(val), order - starts[:, None], -1)
    width = min(topk, T)
    full_idx = torch.full((T, topk), -1, dtype=torch.int64)
    full_idx[:, :width] = idx
    return full_idx, dense, starts


CASES = [
    # T, cu, topk, causal, ties
    (12, None, 5, True, False),
    (12, None, 40, True, False),  # topk > T: -1 fill
    (17, [0, 5, 5, 17], 4, True, True),  # an empty sequence, ties
    (17, [0, 9, 17], 6, False, True),
    (30, [0, 1, 30], 30, False, False),  # every key: the dense warm-up selection
]


@pytest.mark.parametrize("T, cu, topk, causal, ties", CASES)
def test_topk_matches_dense_reference(T, cu, topk, causal, ties, monkeypatch):
    q, k, w = _inputs(T, ties=ties)
    cu_l = cu if cu is not None else [0, T]
    for chunk in (indexer.CHUNK_BYTES, 1):  # one chunk per sequence, and one query row per chunk
        exp_idx, dense, starts = _expected(q, k, w, topk, cu_l, causal)
        monkeypatch.setattr(indexer, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(indexer, "BACKWARD_CHUNK_BYTES", chunk)
        idx, sc = indexer_topk(q, k, w, topk, cu_seqlens=cu, causal=causal)
        assert idx.dtype == torch.int32 and idx.shape == (T, topk)
        assert torch.equal(idx.long(), exp_idx)
        live = idx >= 0
        rows = torch.where(live, idx.long() + starts[:, None], 0)
        exp_sc = torch.where(live, dense.gather(1, rows), float("-inf"))
        assert_close(sc, exp_sc, torch.float64, name="scores")
        # gradients: autograd through the dense scores at the same slots
        g = torch.randn(T, topk, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        got = torch.autograd.grad((sc.masked_fill(~live, 0) * g).sum(), (q, k, w))
        want = torch.autograd.grad((exp_sc.masked_fill(~live, 0) * g).sum(), (q, k, w))
        for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), got, want):
            assert_close(a, b, torch.float64, name=name)


@pytest.mark.parametrize("Hi, Di, dtype", [
    (4, 32, torch.float64), (5, 64, torch.float64), (6, 20, torch.float64),  # float64: 4, 8 vectors, a tail
    (3, 64, torch.float32), (4, 128, torch.float32), (2, 24, torch.float32),  # fp32: likewise
], ids=str)
def test_gradients_at_vector_widths(Hi, Di, dtype):
    """The C++ backward's fixed-width rows (4 and 8 vectors of d), any width, head counts around its groups of
    four, more selected keys than one of its key blocks: against autograd through the dense float64 scores."""
    T, topk = 70, 40
    q, k, w = _inputs(T, Hi=Hi, Di=Di, dtype=dtype, seed=5)
    idx, sc = indexer_topk(q, k, w, topk)
    live = idx >= 0
    g = torch.randn(T, topk, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = torch.autograd.grad((sc.double().masked_fill(~live, 0) * g).sum(), (q, k, w))
    q64, k64, w64 = (t.detach().double().requires_grad_() for t in (q, k, w))
    dense = index_scores(q64, k64, w64).gather(1, idx.long().clamp(min=0)).masked_fill(~live, 0)
    want = torch.autograd.grad((dense * g).sum(), (q64, k64, w64))
    for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), got, want):
        assert_close(a, b, dtype, name=name)


def test_ties_go_to_the_smaller_position():
    T = 8
    q = torch.ones(T, 1, 2, dtype=torch.float64)
    k = torch.ones(T, 2, dtype=torch.float64)  # every score equal
    w = torch.ones(T, 1, dtype=torch.float64)
    idx, sc = indexer_topk(q, k, w, 3, causal=False)
    assert idx.tolist() == [[0, 1, 2]] * T
    idx, _ = indexer_topk(q, k, w, 3, causal=True)
    assert idx[0].tolist() == [0, -1, -1] and idx[5].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_scores_are_fp32(dtype):
    q, k, w = _inputs(20, dtype=dtype, seed=1)
    idx, sc = indexer_topk(q, k, w, 6)
    assert sc.dtype == torch.float32
    dense = index_scores(q, k, w)
    live = idx >= 0
    assert_close(sc[live], dense.gather(1, idx.long().clamp(min=0))[live], torch.float32)
    g = torch.randn(sc.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (sc.masked_fill(~live, 0) * g).sum().backward()
    assert q.grad.dtype == dtype and k.grad.dtype == dtype
    q64, k64, w64 = (t.detach().double().requires_grad_() for t in (q, k, w))
    d64 = index_scores(q64, k64, w64).gather(1, idx.long().clamp(min=0)).masked_fill(~live, 0)
    want = torch.autograd.grad((d64 * g).sum(), (q64, k64, w64))
    for name, got, exp in zip(("dq_idx", "dk_idx", "dweights"), (q.grad, k.grad, w.grad), want):
        assert_close(got, exp, dtype, name=name)


@pytest.mark.parametrize("T, cu, topk, causal, ties", [
    (17, [0, 5, 5, 17], 4, True, True),  # an empty sequence, ties
    (17, [0, 9, 17], 6, False, True),
    (40, [0, 3, 40], 9, True, False),  # a sequence shorter than topk
    (30, None, 30, False, False),  # every key
])
def test_fp16_selection_is_the_exact_topk(T, cu, topk, causal, ties, monkeypatch):
    """fp16 inputs (fp32 arithmetic): the selection equals the exact top-k, ties to the smaller position, of the
    float64 scores of the same fp16 values (with ties: quarter-integers, every sum exact in fp32, so the equal
    scores stay equal), in one chunk and in one-row chunks; the scores within the fp32 tolerance."""
    q, k, w = _inputs(T, dtype=torch.float16, ties=ties, seed=7)
    cu_l = cu if cu is not None else [0, T]
    q64, k64, w64 = (t.detach().double() for t in (q, k, w))
    exp_idx, dense, starts = _expected(q64, k64, w64, topk, cu_l, causal)
    for chunk in (indexer.CHUNK_BYTES, 1):
        monkeypatch.setattr(indexer, "CHUNK_BYTES", chunk)
        idx, sc = indexer_topk(q, k, w, topk, cu_seqlens=cu, causal=causal)
        assert sc.dtype == torch.float32
        assert torch.equal(idx.long(), exp_idx)
        live = idx >= 0
        exp_sc = torch.where(live, dense.gather(1, torch.where(live, idx.long() + starts[:, None], 0)), float("-inf"))
        assert_close(sc, exp_sc, torch.float32, name="scores")


def test_backward_bitwise_repeatable():
    q, k, w = _inputs(40, seed=2)
    grads = []
    for _ in range(2):
        idx, sc = indexer_topk(q, k, w, 7)
        grads.append(torch.autograd.grad(sc[idx >= 0].sum(), (q, k, w)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_empty_input():
    q, k, w = _inputs(0)
    idx, sc = indexer_topk(q, k, w, 4)
    assert idx.shape == (0, 4) and sc.shape == (0, 4)


@pytest.mark.parametrize("edit, exc, msg", [
    (lambda a: a.update(topk=0), ValueError, "topk"),
    (lambda a: a.update(topk=2.0), TypeError, "topk"),
    (lambda a: a.update(k_idx=a["k_idx"][:-1]), ValueError, "k_idx"),
    (lambda a: a.update(weights=a["weights"][:, :2]), ValueError, "weights"),
    (lambda a: a.update(k_idx=a["k_idx"].float()), TypeError, "k_idx"),
    (lambda a: a.update(q_idx=a["q_idx"][0]), ValueError, "q_idx"),
    (lambda a: a.update(cu_seqlens=[0, 5]), ValueError, "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=[1, 10]), ValueError, "cu_seqlens"),
    (lambda a: a.update(causal=1), TypeError, "causal"),
    # the top-k reads the scores: no meta tensors
    (lambda a: a.update({n: a[n].to("meta") for n in ("q_idx", "k_idx", "weights")}), ValueError, "q_idx: .*meta"),
])
def test_bad_input(edit, exc, msg):
    q, k, w = _inputs(10)
    a = {"q_idx": q, "k_idx": k, "weights": w, "topk": 3}
    edit(a)
    with pytest.raises(exc, match=msg):
        indexer_topk(**a)


def test_second_derivative_is_an_error_not_a_silent_zero():
    # the backward runs outside autograd (C++ kernels, or ops writing into buffers)
    q, k, w = (t.requires_grad_() for t in _inputs(10))
    idx, sc = indexer_topk(q, k, w, 3)
    # an incoming gradient that is a constant: dw depends on q and k through the saved inputs only
    (dw,) = torch.autograd.grad(sc[idx >= 0].sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="indexer_topk is not differentiable twice"):
        (dw.pow(2).sum() + w.sum()).backward()
