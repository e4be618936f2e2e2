"""Triton kernels for MoE permute / unpermute with an expert-parallel window (docs/moe.md).

Every kernel runs one program per token ``t`` (times a hidden-dim chunk where no reduction over H is needed)
and owns all ``K`` slots ``i = t*K + k`` of that token, so every output element has exactly one writer (no
atomics, deterministic). A slot is live when ``s <= sorted_indices[i] < e``; its local row is ``v - s``.

Live slots are compacted: slots are read in chunks of ``BLOCK_K``, the live ones are ranked in k order
(``cumsum``), and rows are then moved ``BLOCK_J`` live slots at a time. The launcher sizes ``BLOCK_J`` to the
expected live slots per token (``K * R / N``), so on an EP rank's window the registers and memory requests go
to rows that exist rather than to masked lanes; a token with more live slots runs more ``BLOCK_J`` groups, and
a token with none reads nothing.

Math is in ``ACC`` (fp32, or fp64 for fp64 inputs); each output element is rounded once on store, a bf16 one
from fp64 through fp32 (``_narrow``), as torch rounds it. Addresses
are int64: ``T*K*H`` exceeds 2**31 at real sizes. ``H`` and ``K`` are compile-time constants: they are fixed
per model (a handful of compilations), and the Triton interpreter under numpy >= 2.4 cannot run a ``range``
whose bound is a runtime argument.
"""

import triton
import triton.language as tl


@triton.jit
def _live_slots(p_si, i_t, k0, s, e, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slots ``k0 .. k0+BLOCK_K`` of token ``i_t``: ``(o_k, m_k, m_live, b_row, b_rank, n_live)`` where ``b_row`` is
    the local row (0 when dead) and ``b_rank`` the rank of a live slot among the live ones, in k order."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    # [BLOCK_K]
    b_v = tl.load(p_si + i_t * K + o_k, mask=m_k, other=-1).to(tl.int64)
    m_live = m_k & (b_v >= s) & (b_v < e)
    b_row = tl.where(m_live, b_v - s, 0)
    b_rank = tl.cumsum(m_live.to(tl.int32), axis=0) - 1
    n_live = tl.sum(m_live.to(tl.int32), axis=0)
    return o_k, m_k, m_live, b_row, b_rank, n_live


@triton.jit
def _narrow(b_x, p_out):
    """``b_x`` in ``p_out``'s element type. To bf16 through fp32: what torch's fp64 -> bf16 cast does, and the
    Triton interpreter's direct fp64 -> bf16 cast returns garbage (zeros, denormals, NaN)."""
    if p_out.dtype.element_ty == tl.bfloat16:
        return b_x.to(tl.float32).to(tl.bfloat16)
    return b_x.to(p_out.dtype.element_ty)


@triton.jit
def moe_unpermute_grad_kernel(
    p_grad,
    p_si,
    p_x,
    p_probs,
    p_ptg,
    p_pg,
    s,
    e,
    H: tl.constexpr,
    K: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The seed op. ``ptg[v-s] = grad[t] * probs[t,k]`` (or an exact copy of ``grad[t]`` without probs) and
    ``probs_grad[t,k] = <x[v-s], grad[t]>`` (0 for dead slots). One program per token walks the whole hidden
    dim for each group of ``BLOCK_J`` live slots, reading the ``grad[t]`` chunk once per group and holding a
    ``[BLOCK_J, BLOCK_H]`` tile of rows; the dot products accumulate in a fixed order (tree within a chunk,
    chunks in order)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    o_j = tl.arange(0, BLOCK_J)
    for k0 in range(0, K, BLOCK_K):
        o_k, m_k, m_live, b_row, b_rank, n_live = _live_slots(p_si, i_t, k0, s, e, K, BLOCK_K)
        if HAS_PROBS:
            # [BLOCK_K]
            b_p = tl.load(p_probs + i_t * K + o_k, mask=m_live, other=0).to(ACC)
        # [BLOCK_K]
        b_dot = tl.zeros([BLOCK_K], dtype=ACC)
        for j0 in range(0, BLOCK_K, BLOCK_J):
            if j0 < n_live:
                # [BLOCK_K, BLOCK_J] slot k is live slot number j0 + j
                m_sel = m_live[:, None] & (b_rank[:, None] == (j0 + o_j)[None, :])
                # [BLOCK_J]
                m_j = (j0 + o_j) < n_live
                b_row_j = tl.sum(tl.where(m_sel, b_row[:, None], 0), axis=0)
                if HAS_PROBS:
                    b_p_j = tl.sum(tl.where(m_sel, b_p[:, None], 0), axis=0)
                b_dot_j = tl.zeros([BLOCK_J], dtype=ACC)
                for h0 in range(0, H, BLOCK_H):
                    o_hh = h0 + o_h
                    m_h = o_hh < H
                    # [BLOCK_H]
                    b_g = tl.load(p_grad + i_t * H + o_hh, mask=m_h, other=0)
                    m_jh = m_j[:, None] & m_h[None, :]
                    o_rows = b_row_j[:, None] * H + o_hh[None, :]
                    if HAS_PROBS:
                        b_gf = b_g.to(ACC)
                        # [BLOCK_J, BLOCK_H]
                        b_x = tl.load(p_x + o_rows, mask=m_jh, other=0).to(ACC)
                        b_dot_j += tl.sum(b_x * b_gf[None, :], axis=1)
                        # [BLOCK_J, BLOCK_H]
                        b_out = b_gf[None, :] * b_p_j[:, None]
                        tl.store(p_ptg + o_rows, _narrow(b_out, p_ptg), mask=m_jh)
                    else:
                        # [BLOCK_J, BLOCK_H] an exact copy: no arithmetic on the values
                        b_out = tl.broadcast_to(b_g[None, :], (BLOCK_J, BLOCK_H))
                        tl.store(p_ptg + o_rows, b_out, mask=m_jh)
                # back to slot order: each live slot picks its one dot (exact, a single nonzero term)
                b_dot += tl.sum(tl.where(m_sel, b_dot_j[None, :], 0), axis=1)
        if HAS_PROBS:
            tl.store(p_pg + i_t * K + o_k, _narrow(b_dot, p_pg), mask=m_k)


@triton.jit
def moe_unpermute_kernel(
    p_x,
    p_si,
    p_probs,
    p_out,
    p_ppg,
    p_pg,
    s,
    e,
    H: tl.constexpr,
    K: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    GATHER_PG: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_k probs[t,k] * x[v-s]`` over live slots (plain sum without probs), k ascending, terms
    with ``probs == 0`` skipped, zeros where no slot is live. The same walk is permute's backward
    (``tokens_grad``); with ``GATHER_PG`` it also writes ``probs_grad[t,k] = ppg[v-s]`` (0 for dead slots).

    Grid ``(T, cdiv(H, BLOCK_H))``: no reduction runs over H. The ``BLOCK_J`` row loads of a group are unrolled
    so they are in flight together, while the adds still run strictly in k order."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_hh = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_hh < H
    if GATHER_PG:
        if i_h == 0:
            for k0 in range(0, K, BLOCK_K):
                o_k, m_k, m_live, b_row, b_rank, n_live = _live_slots(p_si, i_t, k0, s, e, K, BLOCK_K)
                # [BLOCK_K]
                b_pg = tl.load(p_ppg + b_row, mask=m_live, other=0)
                tl.store(p_pg + i_t * K + o_k, _narrow(b_pg, p_pg), mask=m_k)
    # [BLOCK_H]
    b_acc = tl.zeros([BLOCK_H], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        o_k, m_k, m_live, b_row, b_rank, n_live = _live_slots(p_si, i_t, k0, s, e, K, BLOCK_K)
        if HAS_PROBS:
            # [BLOCK_K]
            b_p = tl.load(p_probs + i_t * K + o_k, mask=m_live, other=0).to(ACC)
            # an exactly-0 prob drops its term (an inf/NaN row must not leak): rank only the others
            m_live = m_live & (b_p != 0)
            b_rank = tl.cumsum(m_live.to(tl.int32), axis=0) - 1
            n_live = tl.sum(m_live.to(tl.int32), axis=0)
        for j0 in range(0, BLOCK_K, BLOCK_J):
            if j0 < n_live:
                for jj in tl.static_range(BLOCK_J):
                    m_sel = m_live & (b_rank == j0 + jj)
                    # [BLOCK_H] whether live slot j0 + jj exists, compared on every lane: a mask is a block of
                    # comparisons, never a scalar condition broadcast (an int32 array to Triton 3.9's interpreter)
                    m_j = tl.zeros_like(o_hh) + (j0 + jj) < n_live
                    i_row = tl.sum(tl.where(m_sel, b_row, 0), axis=0)
                    # [BLOCK_H]
                    b_x = tl.load(p_x + i_row * H + o_hh, mask=m_h & m_j, other=0).to(ACC)
                    if HAS_PROBS:
                        b_pj = tl.sum(tl.where(m_sel, b_p, 0), axis=0)
                        b_acc += tl.where(m_j, b_pj * b_x, 0)
                    else:
                        b_acc += b_x
    tl.store(p_out + i_t * H + o_hh, _narrow(b_acc, p_out), mask=m_h)


@triton.jit
def moe_permute_kernel(
    p_tok,
    p_si,
    p_probs,
    p_out,
    p_pprobs,
    s,
    e,
    H: tl.constexpr,
    K: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[v-s] = tokens[t]`` and ``permuted_probs[v-s] = probs[t,k]`` for every live slot (exact copies).
    Grid ``(T, cdiv(H, BLOCK_H))``: a program reads its token chunk once and stores it to ``BLOCK_J`` live rows
    at a time; a token with no live slot reads nothing."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_hh = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_hh < H
    o_j = tl.arange(0, BLOCK_J)
    for k0 in range(0, K, BLOCK_K):
        o_k, m_k, m_live, b_row, b_rank, n_live = _live_slots(p_si, i_t, k0, s, e, K, BLOCK_K)
        if HAS_PROBS:
            if i_h == 0:
                # [BLOCK_K]
                b_p = tl.load(p_probs + i_t * K + o_k, mask=m_live, other=0)
                tl.store(p_pprobs + b_row, b_p, mask=m_live)
        if n_live > 0:
            # [BLOCK_H]
            b_tok = tl.load(p_tok + i_t * H + o_hh, mask=m_h, other=0)
            for j0 in range(0, BLOCK_K, BLOCK_J):
                if j0 < n_live:
                    # [BLOCK_K, BLOCK_J]
                    m_sel = m_live[:, None] & (b_rank[:, None] == (j0 + o_j)[None, :])
                    # [BLOCK_J]
                    b_row_j = tl.sum(tl.where(m_sel, b_row[:, None], 0), axis=0)
                    m_j = (j0 + o_j) < n_live
                    # [BLOCK_J, BLOCK_H]
                    b_out = tl.broadcast_to(b_tok[None, :], (BLOCK_J, BLOCK_H))
                    tl.store(p_out + b_row_j[:, None] * H + o_hh[None, :], b_out, mask=m_j[:, None] & m_h[None, :])
