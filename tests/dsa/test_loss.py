"""indexer_kl_loss against a dense float64 oracle: KL of the head-averaged attention over the selected set,
gradient to the scores only, varlen, GQA, -1 slots, the dense warm-up selection, chunking; repeated positions
against a per-slot oracle; any value at -1 slots; bad input."""

import pytest
import torch

from sparseops.dsa import indexer_kl_loss, indexer_topk, loss
from sparseops.testing import assert_close

# every test on both CPU paths: the C++ kernels (where they build) and the torch ops
pytestmark = pytest.mark.usefixtures("cpu_paths")


def _dense_loss(q, k, indices, scores, scale, cu):
    """Dense: the [T, T] selected-set mask from ``indices``, per-head softmax over it, KL(p || softmax(scores))."""
    T, N1, _ = q.shape
    G = N1 // k.shape[1]
    starts = torch.zeros(T, dtype=torch.int64)
    for a, b in zip(cu[:-1], cu[1:]):
        starts[a:b] = a
    sel = torch.zeros(T, T, dtype=torch.bool)
    live = indices >= 0
    t_idx = torch.arange(T)[:, None].expand_as(indices)[live]
    sel[t_idx, (indices.long() + starts[:, None])[live]] = True
    kk = k.repeat_interleave(G, dim=1)
    logits = torch.einsum("thd,shd->ths", q, kk) * scale
    att = torch.softmax(logits.masked_fill(~sel[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    p = att.mean(dim=1)  # [T, T]
    full = torch.full((T, T), float("-inf"), dtype=scores.dtype)
    full[t_idx, (indices.long() + starts[:, None])[live]] = scores[live]
    logq = torch.log_softmax(full.masked_fill(~sel.any(1, keepdim=True), 0.0), dim=-1)
    kl = torch.where(sel & (p > 0), p * (torch.log(p.clamp_min(1e-300)) - logq), 0.0)
    return kl.sum() / T


def _case(T, cu, N1, N2, topk, seed=0, causal=True):
    g = torch.Generator().manual_seed(seed)
    d = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = d(T, N1, 16), d(T, N2, 16)
    qi, ki, wi = d(T, 2, 8), d(T, 8), d(T, 2)
    indices, scores = indexer_topk(qi, ki, wi.requires_grad_(), topk, cu_seqlens=cu, causal=causal)
    return q, k, indices, scores, wi


@pytest.mark.parametrize("T, cu, N1, N2, topk, causal", [
    (20, None, 4, 1, 6, True),
    (23, [0, 7, 7, 23], 4, 2, 5, True),
    (23, [0, 7, 23], 2, 2, 4, False),
    (16, None, 3, 1, 16, True),  # dense warm-up: every visible key
])
def test_matches_dense_oracle(T, cu, N1, N2, topk, causal, monkeypatch):
    q, k, indices, scores, wi = _case(T, cu, N1, N2, topk, causal=causal)
    cu_l = cu if cu is not None else [0, T]
    want = _dense_loss(q, k, indices, scores, 0.25, cu_l)
    (g_want,) = torch.autograd.grad(want, wi, retain_graph=True)
    for chunk in (loss.CHUNK_BYTES, 1):
        monkeypatch.setattr(loss, "CHUNK_BYTES", chunk)
        got = indexer_kl_loss(q, k, indices, scores, scale=0.25, head_num=N1, cu_seqlens=cu)
        assert got.dim() == 0 and got.dtype == torch.float64
        assert_close(got, want, torch.float64, name="loss")
        (g_got,) = torch.autograd.grad(got, wi, retain_graph=True)
        assert_close(g_got, g_want, torch.float64, name="dweights")


def test_zero_when_the_indexer_matches_and_no_grad_to_q_k():
    T, N1 = 10, 2
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, N1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[0, -1]] * T, dtype=torch.int32)  # one key each: p = 1 = softmax of one score
    scores = torch.randn(T, 2, generator=g, dtype=torch.float64, requires_grad=True)
    out = indexer_kl_loss(q, k, indices, scores, scale=1.0, head_num=N1)
    assert out.item() == 0.0
    out.backward()
    assert q.grad is None and k.grad is None and scores.grad.abs().max() == 0


def test_float32_scores_and_empty_rows():
    T = 12
    q, k, indices, scores, wi = _case(T, None, 2, 1, 4)
    indices = indices.clone()
    indices[3] = -1  # a token with no key adds 0
    got = indexer_kl_loss(q.float(), k.float(), indices, scores.float(), scale=0.3, head_num=2)
    want = _dense_loss(q, k, indices, scores, 0.3, [0, T])
    assert got.dtype == torch.float32
    assert_close(got, want, torch.float32)
    (g_got,) = torch.autograd.grad(got, wi, retain_graph=True)
    (g_want,) = torch.autograd.grad(want, wi)
    assert_close(g_got, g_want, torch.float32, name="dweights")


def _per_slot_loss(q, k, indices, scores, scale, cu):
    """Per token and slot in float64: each live slot (duplicates included) its own softmax entry, in the heads'
    attention and in softmax(scores), as docs/dsa.md defines them."""
    T, N1, _ = q.shape
    G = N1 // k.shape[1]
    total = scores.new_zeros((), dtype=torch.float64)
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            live = [j for j in range(indices.shape[1]) if indices[t, j] >= 0]
            if not live:
                continue
            rows = torch.tensor([cu[b] + int(indices[t, j]) for j in live])
            logits = torch.stack([scale * (k[rows, h // G].double() @ q[t, h].double()) for h in range(N1)])
            p = torch.softmax(logits, dim=-1).mean(0)
            total = total + (p * (p.log() - torch.log_softmax(scores[t, live].double(), -1))).sum()
    return total / T


def _duplicates_case(seed=4):
    """A varlen case (an empty sequence, a one-token one) whose rows repeat positions, some three times, with -1
    slots between them."""
    g = torch.Generator().manual_seed(seed)
    cu = [0, 9, 9, 10, 24]
    T, N1, N2, D = cu[-1], 4, 2, 8
    q = torch.randn(T, N1, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, N2, D, generator=g, dtype=torch.float64)
    indices = torch.full((T, 6), -1, dtype=torch.int64)
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            pos = torch.randint(0, t - cu[b] + 1, (5,), generator=g)
            pos[1] = pos[3] = pos[0]  # position pos[0] three times
            indices[t, :5] = pos
    indices[::3, 2] = -1
    scores = torch.randn(T, 6, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, indices, scores, cu


def test_duplicate_positions_count_as_separate_slots(monkeypatch):
    q, k, indices, scores, cu = _duplicates_case()
    assert (indices[:, 0] == indices[:, 3]).all() and (indices[:, 1] >= 0).all()
    want = _per_slot_loss(q, k, indices, scores, 0.3, cu)
    (g_want,) = torch.autograd.grad(want, scores)
    for chunk in (loss.CHUNK_BYTES, 1):
        monkeypatch.setattr(loss, "CHUNK_BYTES", chunk)
        got = indexer_kl_loss(q, k, indices, scores, scale=0.3, head_num=4, cu_seqlens=cu)
        assert_close(got, want, name="loss")
        (g_got,) = torch.autograd.grad(got, scores)
        assert_close(g_got, g_want, name="dscores")
    # fp32: the per-slot oracle of the same values
    q32, k32, s32 = q.float(), k.float(), scores.detach().float().requires_grad_()
    got = indexer_kl_loss(q32, k32, indices, s32, scale=0.3, head_num=4, cu_seqlens=cu)
    s64 = s32.detach().double().requires_grad_()
    want = _per_slot_loss(q32, k32, indices, s64, 0.3, cu)
    assert_close(got, want, name="loss")
    assert_close(torch.autograd.grad(got, s32)[0], torch.autograd.grad(want, s64)[0], name="dscores")


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf"), 1e30, -7.0], ids=str)
def test_scores_at_unused_slots_have_no_effect(fill):
    """``scores`` may hold anything at -1 slots (docs: "any value at -1"): the loss is the same bits, the gradient
    there 0 and elsewhere the same bits."""
    q, k, indices, scores, cu = _duplicates_case(seed=5)
    clean = scores.detach().masked_fill(indices < 0, 0.0).requires_grad_()
    dirty = scores.detach().masked_fill(indices < 0, fill).requires_grad_()
    ref = indexer_kl_loss(q, k, indices, clean, scale=0.3, head_num=4, cu_seqlens=cu)
    got = indexer_kl_loss(q, k, indices, dirty, scale=0.3, head_num=4, cu_seqlens=cu)
    assert torch.equal(got, ref)
    (g_ref,) = torch.autograd.grad(ref, clean)
    (g_got,) = torch.autograd.grad(got, dirty)
    assert torch.equal(g_got, g_ref)
    assert bool((g_got[indices < 0] == 0).all())


@pytest.mark.parametrize("edit, exc, msg", [
    (lambda a: a.update(head_num=3), ValueError, "head_num"),
    (lambda a: a.update(k=a["k"][:, :, :5]), ValueError, "k"),
    (lambda a: a.update(k=torch.zeros(8, 3, 16, dtype=torch.float64)), ValueError, "N2"),
    (lambda a: a.update(indices=a["indices"].clone().fill_(8)), ValueError, "indices"),
    (lambda a: a.update(indices=a["indices"].float()), TypeError, "indices"),
    (lambda a: a.update(scores=a["scores"][:, :2]), ValueError, "scores"),
    (lambda a: a.update(scale=float("nan")), ValueError, "scale"),
    (lambda a: a.update(cu_seqlens=[0, 3]), ValueError, "cu_seqlens"),
])
def test_bad_input(edit, exc, msg):
    q, k, indices, scores, _ = _case(8, None, 4, 2, 3)
    a = {"q": q, "k": k, "indices": indices, "scores": scores, "scale": 0.5, "head_num": 4}
    edit(a)
    with pytest.raises(exc, match=msg):
        indexer_kl_loss(**a)


def test_the_torch_target_takes_out_of_range_positions_as_empty(monkeypatch):
    """The torch path's target (the C++ kernels off): a position outside [0, S) of its sequence, which reaches it
    unchecked under torch.compile, gives 0 as -1 does (it indexed past k: an error eager, an abort compiled)."""
    from sparseops.nsa import cpu_gather

    monkeypatch.setattr(cpu_gather, "available", lambda *a: False)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(20, 4, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    cu = [0, 12, 20]
    idx = torch.randint(0, 8, (20, 5), generator=g)
    idx[:, 1] = torch.tensor([2**62, 12, 10**6, 20, 8])[torch.arange(20) % 5]
    lens = torch.tensor([12] * 12 + [8] * 8)[:, None]
    want = loss._target(q, k, torch.where((idx < 0) | (idx >= lens), -1, idx), 0.3, cu)
    assert torch.equal(loss._target(q, k, idx, 0.3, cu), want)


def test_second_derivative_is_exact_or_an_error():
    # the torch ops differentiate twice; the C++ kernels' backward runs outside autograd: an error, never a silent 0
    q, k, indices, scores, _ = _case(8, None, 4, 2, 3)
    s = scores.detach().masked_fill(indices < 0, 0.0).requires_grad_()

    def f(s):
        return indexer_kl_loss(q, k, indices, s, scale=0.5, head_num=4)

    if loss.EXTENSION.available(s):
        (g,) = torch.autograd.grad(f(s), s, create_graph=True)
        with pytest.raises(RuntimeError, match="indexer_kl_loss is not differentiable twice"):
            (g.pow(2).sum() + s.sum()).backward()
    else:
        assert torch.autograd.gradgradcheck(f, (s,))
