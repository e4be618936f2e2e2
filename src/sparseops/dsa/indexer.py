"""The lightning indexer's exact top-k (docs/dsa.md): chunked, never ``[T, T]``, the scores differentiable.

Per sequence, query tokens run in chunks of :data:`CHUNK_BYTES` of score work: a chunk scores its queries
against the keys it can see (causal: the prefix up to its last query), ``[C, Hi, S] -> [C, S]``, and keeps the
``topk`` best keys of each row. The selection is exact with ties going to the smaller position: the first ``k``
of a stable descending sort of the row (:func:`sparseops._topk.stable_topk`, its host-synchronising path). The
returned scores are the chunk's values at those keys; their backward recomputes
``w . relu(q . k)`` at the selected keys, again in chunks, and adds ``dk_idx`` with ``index_add_`` in chunk order
(CPU: index order; bitwise repeatable), ``index_put_(accumulate=True)`` on CUDA. On the CPU C++ kernels do both
(:data:`EXTENSION`, where it builds): the scores of a row with its keys in vector lanes and an exact
``nth_element`` selection, and the backward per token with its keys read in place.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import _autograd, _checks
from .._cpp import TASK_BYTES, Extension
from .._topk import stable_topk
from .._varlen import token_key_rows
from .checks import acc_dtype, check_indexer_args

#: bytes of one chunk's score work tensors (forward; the backward's gathered keys off the CPU)
CHUNK_BYTES = 32 * 2**20
#: bytes of one chunk's gathered keys in the CPU backward: a few tokens, so that they stay in the cache
BACKWARD_CHUNK_BYTES = 4 * 2**20

#: the score backward on the CPU (``cpu_indexer.cpp``, built on first use; the torch ops where it cannot be)
EXTENSION = Extension("dsa_indexer", Path(__file__).with_name("cpu_indexer.cpp"), "the DSA indexer")

_NEG_INF = float("-inf")


def _chunk_scores(q, k, w, acc, dots_buf, sc_buf):
    """``w . relu(q k^T)``: ``q [C, Hi, Di]``, ``k [S, Di]``, ``w [C, Hi]`` -> ``[C, S]`` in ``acc``, written into
    the call's flat buffers (a fresh tensor per chunk faults its pages in)."""
    C, Hi, Di = q.shape
    S = k.shape[0]
    dots = torch.mm(q.reshape(C * Hi, Di).to(acc), k.to(acc).T, out=dots_buf[:C * Hi * S].view(C * Hi, S))
    dots = dots.relu_().view(C, Hi, S)
    return torch.bmm(w.to(acc).view(C, 1, Hi), dots, out=sc_buf[:C * S].view(C, 1, S)).view(C, S)


def _cpu_select(q_idx, k_idx, weights, topk, cu, causal, acc):
    """:func:`_select` by the C++ kernel (``cpu_indexer.cpp``): each row's scores with the keys in vector lanes
    (the keys transposed once, with two vectors of padding), then an exact ``nth_element`` selection."""
    T, Hi, Di = q_idx.shape
    indices = torch.full((T, topk), -1, dtype=torch.int32)
    scores = torch.full((T, topk), _NEG_INF, dtype=acc)
    if T == 0:
        return indices, scores
    kT = torch.zeros(Di, T + 32, dtype=acc)
    kT[:, :T] = k_idx.to(acc).T
    start, lens, pos = token_key_rows(cu, cu)
    nvis = (pos + 1 if causal else lens).contiguous()
    EXTENSION.module().select(q_idx.to(acc).contiguous(), kT, weights.to(acc).contiguous(), start, nvis,
                              indices, scores, torch.get_num_threads())
    return indices, scores


def _select(q_idx, k_idx, weights, topk, cu, causal):
    """``(indices int32 [T, topk], scores [T, topk])``, -1 / -inf in unused slots."""
    T, Hi, _ = q_idx.shape
    acc = acc_dtype(q_idx.dtype)
    if EXTENSION.available(q_idx):
        return _cpu_select(q_idx, k_idx, weights, topk, cu, causal, acc)
    dev = q_idx.device
    indices = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    scores = torch.full((T, topk), _NEG_INF, dtype=acc, device=dev)
    elt = torch.finfo(acc).bits // 8
    for b in range(len(cu) - 1):
        s0, S = cu[b], cu[b + 1] - cu[b]
        if S == 0:
            continue
        # per query row: Hi + 1 score rows and the int64 tie count
        C = max(1, min(S, CHUNK_BYTES // ((Hi + 2) * elt + 8) // S))
        dots_buf = torch.empty(C * Hi * S, dtype=acc, device=dev)
        sc_buf = torch.empty(C * S, dtype=acc, device=dev)
        for c0 in range(0, S, C):
            c1 = min(S, c0 + C)
            nk = c1 if causal else S
            sc = _chunk_scores(q_idx[s0 + c0:s0 + c1], k_idx[s0:s0 + nk], weights[s0 + c0:s0 + c1], acc,
                               dots_buf, sc_buf)
            if causal:  # only the chunk's own last keys lie after some of its queries
                later = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=dev).triu_(1)
                sc[:, c0:c1].masked_fill_(later, _NEG_INF)
            kk = min(topk, nk)
            pos = stable_topk(sc, kk, sync=True)
            val = sc.gather(1, pos)
            dead = val == _NEG_INF
            indices[s0 + c0:s0 + c1, :kk] = pos.masked_fill(dead, -1).to(torch.int32)
            scores[s0 + c0:s0 + c1, :kk] = val
    return indices, scores


def _add_rows(buf, rows, src):
    if buf.device.type != "cpu":
        buf.index_put_((rows,), src, accumulate=True)  # sorted, fixed-order adds: deterministic on CUDA
    else:
        buf.index_add_(0, rows, src)


def _cpu_backward(q_idx, k_idx, weights, indices, start, d_scores, acc):
    """The C++ kernel (``cpu_indexer.cpp``): ``(dq, dk, dw)`` in ``acc``; dk from one buffer per thread, added in
    thread order (bitwise repeatable for a given thread count)."""
    T, Hi, Di = q_idx.shape
    P = max(1, min(torch.get_num_threads(), TASK_BYTES // max(1, k_idx.shape[0] * Di * torch.finfo(acc).bits // 8)))
    dq = torch.zeros(q_idx.shape, dtype=acc)
    dk = torch.zeros(P, *k_idx.shape, dtype=acc)
    dw = torch.zeros(weights.shape, dtype=acc)
    g = d_scores.to(acc).contiguous()
    EXTENSION.module().backward(q_idx.to(acc).contiguous(), k_idx.to(acc).contiguous(),
                                weights.to(acc).contiguous(), indices.to(torch.int64).contiguous(),
                                start.contiguous(), g, dq, dk, dw, P)
    return dq, dk[0] if P == 1 else dk.sum(dim=0), dw


class _IndexerTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, topk, cu, causal):
        indices, scores = _select(q_idx, k_idx, weights, topk, cu, causal)
        starts = torch.tensor(cu[:-1], dtype=torch.int64, device=q_idx.device)
        seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q_idx.device),
                                      torch.tensor(cu, device=q_idx.device).diff(), output_size=q_idx.shape[0])
        ctx.save_for_backward(q_idx, k_idx, weights, indices, starts[seq])
        ctx.mark_non_differentiable(indices)
        return indices, scores

    @staticmethod
    @_autograd.once_differentiable("indexer_topk")
    def backward(ctx, _d_indices, d_scores):
        q_idx, k_idx, weights, indices, start = ctx.saved_tensors
        T, Hi, Di = q_idx.shape
        topk = indices.shape[1]
        acc = acc_dtype(q_idx.dtype)
        dq = torch.zeros(q_idx.shape, dtype=acc, device=q_idx.device)
        dk = torch.zeros(k_idx.shape, dtype=acc, device=q_idx.device)
        dw = torch.zeros(weights.shape, dtype=acc, device=q_idx.device)
        if T == 0 or d_scores is None:
            return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype), None, None, None
        if EXTENSION.available(q_idx):
            dq, dk, dw = _cpu_backward(q_idx, k_idx, weights, indices, start, d_scores, acc)
            return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype), None, None, None
        elt = torch.finfo(acc).bits // 8
        budget = BACKWARD_CHUNK_BYTES if q_idx.device.type == "cpu" else CHUNK_BYTES
        C = max(1, min(T, budget // (topk * (2 * Di + 3 * Hi + 2) * elt)))
        kf = k_idx.to(acc)
        # one call's work buffers, written with out= chunk after chunk (a fresh tensor per chunk faults its pages in)
        kbuf = torch.empty(C * topk * Di, dtype=acc, device=q_idx.device)
        dbuf = torch.empty(C * Hi * topk, dtype=acc, device=q_idx.device)
        rbuf = torch.empty(C * Hi * topk, dtype=acc, device=q_idx.device)
        dkbuf = torch.empty(C * topk * Di, dtype=acc, device=q_idx.device)
        for t0 in range(0, T, C):
            t1 = min(T, t0 + C)
            c = t1 - t0
            idx = indices[t0:t1].to(torch.int64)
            live = idx >= 0
            rows = torch.where(live, idx + start[t0:t1, None], 0)
            g = torch.where(live, d_scores[t0:t1].to(acc), 0.0)  # [c, topk]
            kg = torch.index_select(kf, 0, rows.view(-1), out=kbuf[:c * topk * Di].view(-1, Di)).view(c, topk, Di)
            qs = q_idx[t0:t1].to(acc)
            dots = torch.bmm(qs, kg.transpose(1, 2), out=dbuf[:c * Hi * topk].view(c, Hi, topk))
            dr = rbuf[:c * Hi * topk].view(c, Hi, topk).copy_(dots > 0)
            dw[t0:t1] = torch.bmm(dots.relu_(), g[:, :, None])[..., 0]
            dr.mul_(weights[t0:t1].to(acc)[:, :, None]).mul_(g[:, None, :])
            dq[t0:t1] = torch.bmm(dr, kg)
            dkc = torch.bmm(dr.transpose(1, 2), qs, out=dkbuf[:c * topk * Di].view(c, topk, Di))
            _add_rows(dk, rows.view(-1), dkc.view(-1, Di))
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype), None, None, None


# eager also inside torch.compile: the exact top-k sizes its work by the visible keys it reads on the host, which
# would graph-break there (with dynamo's Tensor.item() warning at every compile)
@torch._disable_dynamo
def indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, topk: int, *, cu_seqlens=None,
                 causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's exact top-k keys per query (docs/dsa.md).

    ``I[t, s] = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])`` over the keys ``s`` of ``t``'s sequence (at or
    before ``t`` when causal); each query keeps its ``min(topk, #visible keys)`` largest, in descending ``I``, ties
    to the smaller position. Memory is ``O(chunk * T + T * topk)``, never ``[T, T]``.

    Args:
        q_idx: ``[T, Hi, Di]`` the indexer's queries; k_idx: ``[T, Di]`` its keys; weights: ``[T, Hi]`` its head
            weights (one dtype: fp16, bf16, fp32 or float64; scales folded in by the caller).
        topk: keys kept per query, ``>= 1``.
        cu_seqlens: flash-attention cumulative lengths with the leading 0 (int tensor or list), None: one sequence.
        causal: only keys at or before the query.

    Returns:
        ``indices [T, topk]`` int32 in-sequence key positions (-1 in unused slots) and ``scores [T, topk]`` fp32
        (float64 for float64 inputs; -inf at -1), differentiable in ``q_idx``, ``k_idx`` and ``weights``.
    """
    cu, causal = check_indexer_args(q_idx, k_idx, weights, cu_seqlens, causal)
    topk = _checks.check_int("topk", topk, lo=1)
    return _IndexerTopk.apply(q_idx, k_idx, weights, topk, cu, causal)
