"""indexer_dense_kl_loss (the dense warm-up loss) against a direct float64 oracle from index_scores and dense
softmaxes and against indexer_kl_loss over indexer_topk's every visible key: forward and every gradient, packed
sequences (empty ones, one-token ones), causal and not, GQA, chunks down to one row and chunks straddling
sequences, low-precision inputs, zero and -inf weights, bad input, and memory bounded by the chunk budget."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseops.dsa import dense_loss, index_scores, indexer_dense_kl_loss, indexer_kl_loss, indexer_topk
from sparseops.testing import assert_close


def _oracle(q, k, q_idx, k_idx, weights, scale, cu, causal):
    """float64, dense: ``p`` the head mean of the masked softmaxes of ``scale * q . k`` over ``[T, T]``, the KL
    against ``log_softmax(index_scores)``, differentiable in the indexer's inputs through index_scores."""
    T, N1, _ = q.shape
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff(), output_size=T)
    see = seq[:, None] == seq[None, :]
    if causal:
        see &= torch.ones(T, T, dtype=torch.bool).tril()
    kk = k.double().repeat_interleave(N1 // k.shape[1], dim=1)
    logits = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    p = torch.softmax(logits.masked_fill(~see, float("-inf")), dim=-1).mean(dim=0)
    scores = index_scores(q_idx.double(), k_idx.double(), weights.double(), cu_seqlens=cu, causal=causal)
    logq = torch.log_softmax(scores, dim=-1)
    kl = torch.where(p > 0, p * (torch.log(torch.where(p > 0, p, 1.0)) - logq), 0.0)
    return kl.sum() / T


def _inputs(T, N1, N2, Hi, Di, seed=0, dtype=torch.float64, D=8):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k = r(T, N1, D), r(T, N2, D)
    q_idx, k_idx, w = (t.requires_grad_() for t in (r(T, Hi, Di), r(T, Di), r(T, Hi)))
    return q, k, q_idx, k_idx, w


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


#: (T, cu, N1, N2, Hi, Di, causal); small budgets force chunks of one row and chunks across sequences
CASES = {
    "one-sequence": (20, None, 4, 1, 2, 8, True),
    "packed-empty-gqa": (23, [0, 7, 7, 23], 4, 2, 3, 5, True),
    "packed-noncausal": (23, [0, 7, 23], 2, 2, 2, 7, False),
    "one-token-sequences": (6, [0, 1, 2, 2, 3, 6], 3, 1, 1, 4, True),  # rows whose only visible key is their own
    "one-token-noncausal": (4, [0, 1, 2, 4], 2, 1, 2, 3, False),
    "T1": (1, None, 1, 1, 1, 1, True),
    "odd-heads": (13, [0, 13], 6, 3, 5, 3, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("budget", [None, 1, 600], ids=["default-chunks", "one-row-chunks", "straddling-chunks"])
def test_matches_the_oracle_and_the_listed_keys_loss(case, budget, monkeypatch):
    T, cu, N1, N2, Hi, Di, causal = case
    if budget is not None:
        monkeypatch.setattr(dense_loss, "CHUNK_BYTES", budget)
    q, k, q_idx, k_idx, w = _inputs(T, N1, N2, Hi, Di)
    q.requires_grad_()
    k.requires_grad_()
    ind = (q_idx, k_idx, w)
    cu_l = cu or [0, T]
    got = indexer_dense_kl_loss(q, k, *ind, scale=0.4, head_num=N1, cu_seqlens=cu, causal=causal)
    assert got.dim() == 0 and got.dtype == torch.float64
    g_got = torch.autograd.grad(got, (q, k, *ind), allow_unused=True, materialize_grads=False)
    assert g_got[0] is None and g_got[1] is None  # the target is a constant
    want = _oracle(q.detach(), k.detach(), *ind, 0.4, cu_l, causal)
    assert_close(got, want, name="loss")
    for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), g_got[2:], _grads(want, ind)):
        assert_close(a, b, name=name)
    # the listed-keys path: indexer_kl_loss over every visible key
    longest = max(b - a for a, b in zip(cu_l[:-1], cu_l[1:]))
    indices, scores = indexer_topk(*ind, longest, cu_seqlens=cu, causal=causal)
    listed = indexer_kl_loss(q.detach(), k.detach(), indices, scores, scale=0.4, head_num=N1, cu_seqlens=cu)
    assert_close(got, listed, name="loss vs listed")
    for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), g_got[2:], _grads(listed, ind)):
        assert_close(a, b, name=f"{name} vs listed")


def test_the_chunk_plan():
    """Consecutive rows covering [0, T), each chunk's keys the union of its rows' visible keys, the budget kept
    by every chunk of more than one row, and chunks that straddle sequences at a small budget."""
    cu = [0, 7, 7, 23, 24, 40]
    for causal in (True, False):
        for pair_bytes, budget in ((10, 600), (10, 1), (10, 10**9), (3, 100)):
            chunks = dense_loss.plan_chunks(cu, causal, pair_bytes, budget)
            assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == 40
            for t0, t1, k0, k1 in chunks:
                assert t1 - t0 == 1 or (t1 - t0) * (k1 - k0) * pair_bytes <= budget
                firsts = [max(a for a in cu[:-1] if a <= t) for t in range(t0, t1)]
                ends = [t + 1 if causal else min(b for b in cu[1:] if b > t) for t in range(t0, t1)]
                assert (k0, k1) == (min(firsts), max(ends))
            straddle = [c for c in chunks if any(c[0] < b < c[1] for b in cu)]
            if budget in (1, 600):  # one row per chunk; a few rows, some of two sequences
                assert bool(straddle) == (budget == 600), chunks
    assert dense_loss.plan_chunks([0], True, 8, 100) == []
    assert dense_loss.plan_chunks([0, 0, 0], False, 8, 100) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_within_the_table(dtype, monkeypatch):
    monkeypatch.setattr(dense_loss, "CHUNK_BYTES", 700)
    T, cu = 19, [0, 4, 4, 19]
    q, k, q_idx, k_idx, w = _inputs(T, 4, 2, 2, 8, seed=3, dtype=dtype)
    got = indexer_dense_kl_loss(q, k, q_idx, k_idx, w, scale=0.3, head_num=4, cu_seqlens=cu)
    assert got.dtype == torch.float32
    g_got = _grads(got, (q_idx, k_idx, w))
    assert [g.dtype for g in g_got] == [dtype] * 3
    # the oracle of the same (rounded) values in float64
    ind = tuple(t.detach().double().requires_grad_() for t in (q_idx, k_idx, w))
    want = _oracle(q, k, *ind, 0.3, cu, True)
    assert_close(got, want, dtype, name="loss")
    for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), g_got, _grads(want, ind)):
        assert_close(a, b, dtype, name=name)


def test_empty_input_and_an_empty_sequence_list():
    for cu in (None, [0, 0, 0]):
        q, k, q_idx, k_idx, w = _inputs(0, 2, 1, 2, 4)
        got = indexer_dense_kl_loss(q, k, q_idx, k_idx, w, scale=1.0, head_num=2, cu_seqlens=cu)
        assert got.dtype == torch.float64 and got.item() == 0.0
        for g, t in zip(_grads(got, (q_idx, k_idx, w)), (q_idx, k_idx, w)):
            assert g.shape == t.shape


def test_zero_and_minus_inf_weights():
    """Zero weights: every visible key scores 0, a uniform indexer, as the oracle. A -inf weight makes the scores
    NaN (-inf * relu(0), index_scores' own arithmetic) and the loss NaN as the oracle's; nothing raises."""
    T, cu = 11, [0, 5, 11]
    q, k, q_idx, k_idx, w = _inputs(T, 2, 1, 2, 4, seed=5)
    w0 = w.detach().clone()
    w0[[1, 6, 7]] = 0.0
    w0.requires_grad_()
    got = indexer_dense_kl_loss(q, k, q_idx, k_idx, w0, scale=0.5, head_num=2, cu_seqlens=cu)
    want = _oracle(q, k, q_idx, k_idx, w0, 0.5, cu, True)
    assert_close(got, want, name="loss")
    for name, a, b in zip(("dq_idx", "dk_idx", "dweights"), _grads(got, (q_idx, k_idx, w0)),
                          _grads(want, (q_idx, k_idx, w0))):
        assert_close(a, b, name=name)
    winf = w.detach().clone()
    winf[6, 0] = float("-inf")
    got = indexer_dense_kl_loss(q, k, q_idx, k_idx, winf, scale=0.5, head_num=2, cu_seqlens=cu)
    assert torch.isnan(got) and torch.isnan(_oracle(q, k, q_idx, k_idx, winf, 0.5, cu, True))


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("causal", [True, False])
def test_memory_is_bounded_by_the_chunk_budget(causal, monkeypatch):
    """Every tensor of the forward and the backward holds at most the budget's elements or an input's: never
    ``[T, T]`` (T^2 = 25600 elements here, the budget 4096 float64)."""
    budget, T = 32 * 2**10, 160
    monkeypatch.setattr(dense_loss, "CHUNK_BYTES", budget)
    q, k, q_idx, k_idx, w = _inputs(T, 2, 1, 1, 2, D=2)
    with _LargestTensor() as fwd:
        loss = indexer_dense_kl_loss(q, k, q_idx, k_idx, w, scale=0.5, head_num=2, cu_seqlens=[0, 60, T],
                                     causal=causal)
    with _LargestTensor() as bwd:
        loss.backward()
    bound = max(budget // 8, max(t.numel() for t in (q, k, q_idx, k_idx, w)))
    assert fwd.most <= bound and bwd.most <= bound, (fwd.most, bwd.most, bound)
    assert T * T > 6 * bound


@pytest.mark.parametrize("edit, exc, msg", [
    (lambda a: a.update(head_num=3), ValueError, "head_num: expected N1 = q.shape\\[1\\] = 4, got 3"),
    (lambda a: a.update(k=a["k"][:, :, :5]), ValueError, "k: expected shape"),
    (lambda a: a.update(k=torch.zeros(8, 3, 16, dtype=torch.float64)), ValueError, "k: expected N2"),
    (lambda a: a.update(k=a["k"].float()), TypeError, "k: expected dtype torch.float64"),
    (lambda a: a.update(q=a["q"][:5]), ValueError, "k: expected shape \\[T=5"),
    (lambda a: a.update(q_idx=a["q_idx"][:5]), ValueError, "q_idx: expected shape \\[T=8"),
    (lambda a: a.update(q_idx=a["q_idx"][0]), ValueError, "q_idx"),
    (lambda a: a.update(k_idx=a["k_idx"][:, :3]), ValueError, "k_idx: expected shape"),
    (lambda a: a.update(weights=a["weights"][:, :1]), ValueError, "weights: expected shape"),
    (lambda a: a.update(weights=a["weights"].float()), TypeError, "weights: expected dtype"),
    (lambda a: a.update(q=a["q"].int()), TypeError, "q"),
    (lambda a: a.update(scale=float("inf")), ValueError, "scale: expected a finite float, got inf"),
    (lambda a: a.update(cu_seqlens=[0, 3]), ValueError, "cu_seqlens"),
    (lambda a: a.update(causal=1), TypeError, "causal: expected a bool"),
])
def test_bad_input(edit, exc, msg):
    q, k, q_idx, k_idx, w = _inputs(8, 4, 2, 2, 4, D=16)
    a = {"q": q, "k": k, "q_idx": q_idx, "k_idx": k_idx, "weights": w, "scale": 0.5, "head_num": 4}
    edit(a)
    with pytest.raises(exc, match=msg):
        indexer_dense_kl_loss(**a)


def test_second_derivative_is_an_error():
    q, k, q_idx, k_idx, w = _inputs(9, 2, 1, 2, 4)
    (dw,) = torch.autograd.grad(indexer_dense_kl_loss(q, k, q_idx, k_idx, w, scale=0.5, head_num=2), w,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="indexer_dense_kl_loss is not differentiable twice"):
        (dw.pow(2).sum() + w.sum()).backward()
