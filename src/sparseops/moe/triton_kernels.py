"""Triton kernels for MoE permute / unpermute with an expert-parallel window (spec/moe.md §3).

Every kernel runs one program per token ``t`` and owns all ``K`` slots ``i = t*K + k`` of that token, so every
output element has exactly one writer (no atomics, deterministic). A slot is live when
``s <= sorted_indices[i] < e``; its local row is ``v - s``. The hidden dim is walked in ``BLOCK_H`` chunks.
Math is in ``ACC`` (fp32, or fp64 for fp64 inputs); each output element is rounded once on store.
Addresses are int64: ``T*K*H`` exceeds 2**31 at real sizes.

``H`` and ``K`` are compile-time constants: they are fixed per model (a handful of compilations), and the
Triton interpreter under numpy >= 2.4 cannot run a ``range`` whose bound is a runtime argument.
"""

import triton
import triton.language as tl


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
    BLOCK_H: tl.constexpr,
):
    """The seed op. ``ptg[v-s] = grad[t] * probs[t,k]`` (or an exact copy of ``grad[t]`` without probs) and
    ``probs_grad[t,k] = <x[v-s], grad[t]>`` (0 for dead slots). Slots go in chunks of ``BLOCK_K``; a chunk
    with no live slot reads nothing (an EP rank skips the tokens it does not own)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        # [BLOCK_K]
        b_v = tl.load(p_si + i_t * K + o_k, mask=m_k, other=-1).to(tl.int64)
        m_live = m_k & (b_v >= s) & (b_v < e)
        # [BLOCK_K] local rows, 0 for dead slots (never dereferenced: every access is masked by m_live)
        b_row = tl.where(m_live, b_v - s, 0)
        # [BLOCK_K]
        b_dot = tl.zeros([BLOCK_K], dtype=ACC)
        if tl.sum(m_live.to(tl.int32), axis=0) > 0:
            if HAS_PROBS:
                # [BLOCK_K]
                b_p = tl.load(p_probs + i_t * K + o_k, mask=m_live, other=0).to(ACC)
            for h0 in range(0, H, BLOCK_H):
                o_hh = h0 + o_h
                m_h = o_hh < H
                # [BLOCK_H]
                b_g = tl.load(p_grad + i_t * H + o_hh, mask=m_h, other=0)
                m_kh = m_live[:, None] & m_h[None, :]
                o_rows = b_row[:, None] * H + o_hh[None, :]
                if HAS_PROBS:
                    b_gf = b_g.to(ACC)
                    # [BLOCK_K, BLOCK_H]
                    b_x = tl.load(p_x + o_rows, mask=m_kh, other=0).to(ACC)
                    b_dot += tl.sum(b_x * b_gf[None, :], axis=1)
                    # [BLOCK_K, BLOCK_H]
                    b_out = b_gf[None, :] * b_p[:, None]
                    tl.store(p_ptg + o_rows, b_out.to(p_ptg.dtype.element_ty), mask=m_kh)
                else:
                    # [BLOCK_K, BLOCK_H] an exact copy: no arithmetic on the values
                    b_out = tl.broadcast_to(b_g[None, :], (BLOCK_K, BLOCK_H))
                    tl.store(p_ptg + o_rows, b_out, mask=m_kh)
        if HAS_PROBS:
            tl.store(p_pg + i_t * K + o_k, b_dot.to(p_pg.dtype.element_ty), mask=m_k)


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
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_k probs[t,k] * x[v-s]`` over live slots (plain sum without probs), k ascending, terms
    with ``probs == 0`` skipped, zeros where no slot is live. The same walk is permute's backward
    (``tokens_grad``); with ``GATHER_PG`` it also writes ``probs_grad[t,k] = ppg[v-s]`` (0 for dead slots).

    Slots are unrolled ``BLOCK_K`` at a time so the row loads of one chunk are in flight together while the
    adds still run strictly in k order."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    if GATHER_PG:
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            # [BLOCK_K]
            b_v = tl.load(p_si + i_t * K + o_k, mask=m_k, other=-1).to(tl.int64)
            m_live = m_k & (b_v >= s) & (b_v < e)
            # [BLOCK_K]
            b_pg = tl.load(p_ppg + tl.where(m_live, b_v - s, 0), mask=m_live, other=0)
            tl.store(p_pg + i_t * K + o_k, b_pg.to(p_pg.dtype.element_ty), mask=m_k)
    for h0 in range(0, H, BLOCK_H):
        o_hh = h0 + o_h
        m_h = o_hh < H
        # [BLOCK_H]
        b_acc = tl.zeros([BLOCK_H], dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            for kk in tl.static_range(BLOCK_K):
                i_k = k0 + kk
                m_k = i_k < K
                b_v = tl.load(p_si + i_t * K + i_k, mask=m_k, other=-1).to(tl.int64)
                m_live = m_k & (b_v >= s) & (b_v < e)
                if HAS_PROBS:
                    b_p = tl.load(p_probs + i_t * K + i_k, mask=m_k, other=0).to(ACC)
                    m_live = m_live & (b_p != 0)
                b_row = tl.where(m_live, b_v - s, 0)
                # [BLOCK_H]
                b_x = tl.load(p_x + b_row * H + o_hh, mask=m_h & m_live, other=0).to(ACC)
                if HAS_PROBS:
                    b_acc += tl.where(m_live, b_p * b_x, 0)
                else:
                    b_acc += b_x
        tl.store(p_out + i_t * H + o_hh, b_acc.to(p_out.dtype.element_ty), mask=m_h)


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
    BLOCK_H: tl.constexpr,
):
    """``out[v-s] = tokens[t]`` and ``permuted_probs[v-s] = probs[t,k]`` for every live slot: a token row is
    read once per chunk of ``BLOCK_K`` slots and stored to each live slot's row (exact copies)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        # [BLOCK_K]
        b_v = tl.load(p_si + i_t * K + o_k, mask=m_k, other=-1).to(tl.int64)
        m_live = m_k & (b_v >= s) & (b_v < e)
        b_row = tl.where(m_live, b_v - s, 0)
        if tl.sum(m_live.to(tl.int32), axis=0) > 0:
            if HAS_PROBS:
                # [BLOCK_K]
                b_p = tl.load(p_probs + i_t * K + o_k, mask=m_live, other=0)
                tl.store(p_pprobs + b_row, b_p, mask=m_live)
            for h0 in range(0, H, BLOCK_H):
                o_hh = h0 + o_h
                m_h = o_hh < H
                # [BLOCK_H]
                b_tok = tl.load(p_tok + i_t * H + o_hh, mask=m_h, other=0)
                # [BLOCK_K, BLOCK_H]
                b_out = tl.broadcast_to(b_tok[None, :], (BLOCK_K, BLOCK_H))
                tl.store(p_out + b_row[:, None] * H + o_hh[None, :], b_out, mask=m_live[:, None] & m_h[None, :])
