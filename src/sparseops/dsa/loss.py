"""The indexer's KL training loss over the selected keys (docs/dsa.md), from chunks: never ``[T, T]``.

The target ``p_t`` is the main attention's distribution over the selected set, averaged over its query heads,
computed without gradient in chunks of :data:`CHUNK_BYTES` (each chunk gathers its tokens' selected keys);
the loss is then ``O(T * topk)`` autograd on the indexer's scores alone.
"""

from __future__ import annotations

import torch

from .. import _autograd, _checks
from .._numerics import exp_floor
from ..nsa import cpu_gather
from .checks import DTYPES, acc_dtype, check_attention_qk, check_positions, cu_seqlens_list
from .indexer import EXTENSION

#: bytes of one chunk's gathered keys and logits while computing the target, on the CPU (a few tokens: they stay
#: in the cache) and on other devices (where a chunk's launches cost more)
CHUNK_BYTES = 4 * 2**20
DEVICE_CHUNK_BYTES = 32 * 2**20


def _check(q, k, indices, scores, scale, head_num, cu_seqlens):
    scale = check_attention_qk(q, k, scale, head_num)
    indices = _checks.check_tensor("indices", indices, ndim=2, dtypes=_checks.INDEX_DTYPES)
    scores = _checks.check_tensor("scores", scores, ndim=2, dtypes=DTYPES)
    T = q.shape[0]
    _checks.check_shape("indices", indices, [("T", T), ("topk", -1)])
    _checks.check_shape("scores", scores, [("T", T), ("topk", indices.shape[1])])
    if indices.shape[1] < 1:
        raise ValueError("indices: expected topk = indices.shape[1] >= 1, got 0")
    _checks.check_same_device(q=q, k=k, indices=indices, scores=scores)
    cu = cu_seqlens_list(cu_seqlens, T)
    check_positions(indices, cu)
    return scale, cu


@torch.no_grad()
def _target(q, k, indices, scale, cu):
    """``p [T, topk]``: the head-averaged softmax of ``scale * q . k`` over each token's selected keys (0 at -1)."""
    if cpu_gather.available(q):  # the C++ kernel: each token's keys read in place, its heads in vector lanes
        return cpu_gather.head_mean_probs(q, k, indices, scale, cu)
    T, N1, D = q.shape
    N2 = k.shape[1]
    G, topk = N1 // N2, indices.shape[1]
    acc = acc_dtype(q.dtype)
    dev = q.device
    lens = torch.tensor(cu, dtype=torch.int64, device=dev).diff()
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=dev), lens, output_size=T)
    start = torch.tensor(cu[:-1], dtype=torch.int64, device=dev)[seq]
    length = lens[seq]
    p = torch.zeros(T, topk, dtype=acc, device=dev)
    elt = torch.finfo(acc).bits // 8
    budget = CHUNK_BYTES if dev.type == "cpu" else DEVICE_CHUNK_BYTES
    C = max(1, min(T, budget // (topk * (N2 * D + 2 * N1 + 1) * elt)))
    kf = k.reshape(T * N2, D).to(acc)
    heads = torch.arange(N2, device=dev)[:, None]
    # one call's work buffers, written with out= chunk after chunk (a fresh tensor per chunk faults its pages in)
    kbuf = torch.empty(C * N2 * topk * D, dtype=acc, device=dev)
    xbuf = torch.empty(C * N1 * topk, dtype=acc, device=dev)
    qbuf = torch.empty(C * N1 * D, dtype=acc, device=dev)
    for t0 in range(0, T, C):
        t1 = min(T, t0 + C)
        c = t1 - t0
        idx = indices[t0:t1].to(torch.int64)
        # a position outside [0, S) of the token's sequence is an empty slot, as -1 (unchecked under
        # torch.compile: an index past k would abort there)
        live = (idx >= 0) & (idx < length[t0:t1, None])
        rows = torch.where(live, idx + start[t0:t1, None], 0)  # [c, topk]
        kg = torch.index_select(kf, 0, (rows[:, None, :] * N2 + heads).view(-1),
                                out=kbuf[:c * N2 * topk * D].view(-1, D)).view(c * N2, topk, D)
        qs = qbuf[:c * N1 * D].view(c * N2, G, D).copy_(q[t0:t1].reshape(c * N2, G, D)).mul_(scale)
        x = torch.bmm(qs, kg.transpose(1, 2), out=xbuf[:c * N1 * topk].view(c * N2, G, topk)).view(c, N1, topk)
        x.masked_fill_(~live[:, None, :], float("-inf"))
        mx = x.amax(dim=-1, keepdim=True)
        e = x.sub_(torch.where(mx == float("-inf"), 0.0, mx)).exp_()
        sm = e.sum(dim=-1, keepdim=True)
        torch.mean(e.mul_(torch.where(sm > 0, 1.0 / sm, 0.0)), dim=1, out=p[t0:t1])
    return p


class _KLRows(torch.autograd.Function):
    """``(1 / T) sum_t KL(p_t || softmax(scores_t))`` by the C++ kernels (``cpu_indexer.cpp`` ``kl_rows``): one pass
    over each token's slots, no ``[T, topk]`` temporaries; the backward writes ``d scores`` in one more pass."""

    @staticmethod
    def forward(ctx, scores, p, ids):
        T = scores.shape[0]
        kl, lse, mass = (torch.empty(T, dtype=scores.dtype) for _ in range(3))
        EXTENSION.module().kl_rows(scores, p, ids, exp_floor(scores.dtype), kl, lse, mass, torch.get_num_threads())
        ctx.save_for_backward(scores, p, ids, lse, mass)
        return kl.sum() / T

    @staticmethod
    @_autograd.once_differentiable("indexer_kl_loss")
    def backward(ctx, g):
        scores, p, ids, lse, mass = ctx.saved_tensors
        ds = torch.empty_like(scores)
        EXTENSION.module().kl_rows_grad(scores, p, ids, lse, mass, float(g) / scores.shape[0],
                                        exp_floor(scores.dtype), ds, torch.get_num_threads())
        return ds, None, None


def _kl_torch(scores, p, indices, acc):
    live = indices >= 0
    any_live = live.any(dim=1, keepdim=True)
    # rows without a selected key get finite dummy logits; their p is 0, so they add 0
    logits = torch.where(live, scores.to(acc), float("-inf")).masked_fill(~any_live, 0.0)
    logq = torch.log_softmax(logits, dim=1)
    kl = torch.where(p > 0, p * (torch.log(torch.where(p > 0, p, 1.0)) - logq), 0.0)
    return kl.sum() / scores.shape[0]


def indexer_kl_loss(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor, *, scale: float,
                    head_num: int, cu_seqlens=None, target: torch.Tensor | None = None) -> torch.Tensor:
    """The lightning indexer's training loss (DeepSeek-V3.2, docs/dsa.md).

    ``(1 / T) sum_t KL(p_t || softmax(scores_t))`` over each token's selected keys ``S_t`` (the slots of ``indices``
    that are not -1), where ``p_t(s) = (1 / N1) sum_h softmax_{s' in S_t}(scale * q[t, h] . k[s', h // G])`` is the
    main attention's distribution over ``S_t`` averaged over its heads, a constant: the gradient flows to
    ``scores`` only. A token with no selected key adds 0. The dense warm-up is the same call with ``S_t`` every
    visible key (``indexer_topk`` with ``topk`` at least the longest sequence).

    Args:
        q: ``[T, N1, Dqk]`` the main attention's queries; k: ``[T, N2, Dqk]`` its keys (``N2`` divides ``N1``).
        indices: ``[T, topk]`` int32/int64 in-sequence key positions, -1 = unused (``indexer_topk``'s).
        scores: ``[T, topk]`` the indexer's scores at ``indices`` (any value at -1).
        scale: the attention's softmax scale. head_num: ``N1``.
        cu_seqlens: flash-attention cumulative lengths with the leading 0, or None for one sequence.
        target: ``p [T, topk]`` when the caller has it (:func:`sparseops.dsa.sparse_attention`'s
            ``return_target``: the same distribution from the attention's own pass), else None: computed here.

    Returns:
        a 0-dim tensor, fp32 (float64 for float64 scores).
    """
    scale, cu = _check(q, k, indices, scores, scale, head_num, cu_seqlens)
    if target is not None:
        target = _checks.check_tensor("target", target, ndim=2, dtypes=DTYPES)
        _checks.check_shape("target", target, [("T", q.shape[0]), ("topk", indices.shape[1])])
        _checks.check_same_device(q=q, target=target)
    T = q.shape[0]
    acc = acc_dtype(scores.dtype)
    if T == 0:
        return scores.new_zeros((), dtype=acc) + scores.sum() * 0
    p = (_target(q, k, indices, scale, cu) if target is None else target.detach()).to(acc)
    if EXTENSION.available(scores):
        return _KLRows.apply(scores.to(acc).contiguous(), p.contiguous(), indices.to(torch.int64).contiguous())
    return _kl_torch(scores, p, indices, acc)
