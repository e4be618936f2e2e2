"""Triton kernels for the NSA selected attention backward: dQ, dK/dV, ``D = rowsum(dO * O)`` and the
deterministic reduction.

They share the tile helpers of ``triton_kernels.py`` (head-dim chunks, key masks, token packs); the launchers
are in ``triton_impl.py``, the design in docs/nsa.md (GPU section). ``DOT`` is the dtype fed to ``tl.dot``;
accumulation is always fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _block_keys, _head_dims, _load_split, _pack_block, _pack_rows, _pack_setup, _qk


@triton.jit
def _dq_step(
    k, v, o_row, m_k, m_s, b_f, b_q1, b_q2, b_do, b_m, b_delta, b_dq1, b_dq2, o_d1, m_d1, o_d2, m_d2, o_dv, m_dv,
    scale, Dqk: tl.constexpr, Dv: tl.constexpr, HAS_D2: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """One key block of dQ. ``b_f`` per row: 1/l (0 for a fully masked row) times the row's multiplicity."""
    # [BLOCK_BS, BLOCK_D1], [BLOCK_BS, BLOCK_D2]
    b_k1, b_k2 = _load_split(k, o_row, m_k, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)
    # [BLOCK_BS, BLOCK_DV]
    b_v = tl.load(v + o_row[:, None] * Dv + o_dv[None, :], mask=m_k[:, None] & m_dv[None, :], other=0.0).to(DOT)
    # [ROWS, BLOCK_BS]
    b_s = _qk(b_q1, b_k1, b_q2, b_k2, HAS_D2, PREC) * scale
    b_p = tl.where(m_s, tl.exp(b_s - b_m[:, None]) * b_f[:, None], 0.0)
    # [ROWS, BLOCK_BS]
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    b_ds = (b_p * (b_dp - b_delta[:, None])).to(DOT)
    b_dq1 += tl.dot(b_ds, b_k1, input_precision=PREC)
    if HAS_D2:
        b_dq2 += tl.dot(b_ds, b_k2, input_precision=PREC)
    return b_dq1, b_dq2


@triton.jit
def nsa_bwd_dq_kernel(
    q, k, v, o, do, m_in, l_in, delta, topk, dq,
    tok_pos, tok_kv0, tok_s2, pk_t0, pk_n, pk_ids, pk_nu, run,
    scale,
    N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BS: tl.constexpr, BLOCK_BS: tl.constexpr,
    Dqk: tl.constexpr, Dv: tl.constexpr,
    BLOCK_G: tl.constexpr, PACK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, HAS_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, USE_WHILE: tl.constexpr,
    GATE: tl.constexpr, BLOCK_KC: tl.constexpr,
):
    """dQ, query-major with the forward's grid, token packing and gating, no atomics.
    Also writes ``delta = rowsum(dO * O)`` (fp32) for the dK/dV kernel. A step takes ``BLOCK_KC`` keys of a block
    (the whole padded block, or a part of it where that does not fit the device's shared memory: with the softmax
    stats given, each key's dQ term is independent of the others)."""
    i_p = tl.program_id(0).to(tl.int64)
    i_n2 = tl.program_id(1).to(tl.int64)
    if GATE:
        if tl.load(run + i_p * N2 + i_n2) == 0:
            return
    t0, n_tok, s1, kv0, S2, o_h, m_x, o_xj = _pack_rows(i_p, i_n2, pk_t0, pk_n, tok_pos, tok_kv0, tok_s2, N1, G,
                                                        BLOCK_G, PACK)
    ROWS: tl.constexpr = PACK * BLOCK_G
    NKC: tl.constexpr = BLOCK_BS // BLOCK_KC
    o_r = tl.arange(0, BLOCK_KC)
    o_d1, m_d1, o_d2, m_d2, o_dv, m_dv = _head_dims(Dqk, Dv, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    # [ROWS, BLOCK_D1], [ROWS, BLOCK_D2]
    b_q1, b_q2 = _load_split(q, o_h, m_x, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)
    # [ROWS, BLOCK_DV]
    b_do32 = tl.load(do + o_h[:, None] * Dv + o_dv[None, :], mask=m_x[:, None] & m_dv[None, :], other=0.0).to(tl.float32)
    b_o32 = tl.load(o + o_h[:, None] * Dv + o_dv[None, :], mask=m_x[:, None] & m_dv[None, :], other=0.0).to(tl.float32)
    b_do = b_do32.to(DOT)
    # [ROWS]
    b_delta = tl.sum(b_do32 * b_o32, 1)
    tl.store(delta + o_h, b_delta, mask=m_x)
    b_m = tl.load(m_in + o_h, mask=m_x, other=0.0)
    b_l = tl.load(l_in + o_h, mask=m_x, other=0.0)
    b_il = tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)

    # [ROWS, BLOCK_D1]
    b_dq1 = tl.zeros([ROWS, BLOCK_D1], dtype=tl.float32)
    # [ROWS, BLOCK_D2]
    b_dq2 = tl.zeros([ROWS, BLOCK_D2], dtype=tl.float32)

    if PACK == 1:
        p_topk = topk + (t0 * N2 + i_n2) * K
        for i_s in range(K * NKC):
            idx = tl.load(p_topk + i_s // NKC).to(tl.int64)
            o_p, o_row, m_k = _block_keys(idx, (i_s % NKC) * BLOCK_KC + o_r, s1, kv0, S2, i_n2, N2, BS, CAUSAL)
            b_dq1, b_dq2 = _dq_step(k, v, o_row, m_k, m_k[None, :], b_il, b_q1, b_q2, b_do, b_m, b_delta, b_dq1,
                                    b_dq2, o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, DOT, PREC)
    else:
        b_tk, o_xs1, s1_last, p_ids, n_u = _pack_setup(topk, pk_ids, pk_nu, t0, i_p, o_xj, m_x, s1, n_tok, i_n2,
                                                       N2, K, BLOCK_K, PACK)
        if USE_WHILE:
            i_s = 0
            while i_s < n_u * NKC:
                o_row, m_k, m_s, b_w = _pack_block(p_ids, i_s // NKC, b_tk, o_xs1, s1_last,
                                                   (i_s % NKC) * BLOCK_KC + o_r, kv0, S2, i_n2, N2, BS, CAUSAL)
                b_dq1, b_dq2 = _dq_step(k, v, o_row, m_k, m_s, b_il * b_w, b_q1, b_q2, b_do, b_m, b_delta, b_dq1,
                                        b_dq2, o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, DOT, PREC)
                i_s += 1
        else:
            for i_s in range(0, n_u * NKC):
                o_row, m_k, m_s, b_w = _pack_block(p_ids, i_s // NKC, b_tk, o_xs1, s1_last,
                                                   (i_s % NKC) * BLOCK_KC + o_r, kv0, S2, i_n2, N2, BS, CAUSAL)
                b_dq1, b_dq2 = _dq_step(k, v, o_row, m_k, m_s, b_il * b_w, b_q1, b_q2, b_do, b_m, b_delta, b_dq1,
                                        b_dq2, o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, DOT, PREC)

    tl.store(dq + o_h[:, None] * Dqk + o_d1[None, :], (b_dq1 * scale).to(dq.dtype.element_ty),
             mask=m_x[:, None] & m_d1[None, :])
    if HAS_D2:
        tl.store(dq + o_h[:, None] * Dqk + o_d2[None, :], (b_dq2 * scale).to(dq.dtype.element_ty),
                 mask=m_x[:, None] & m_d2[None, :])


@triton.jit
def _dkv_step(
    i_p, p1, q, do, m_in, l_in, delta, ent_tok, tok_pos, p0, i_n2, o_r, m_r, o_xe, o_xg,
    o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, b_k1, b_k2, b_v, b_dk1, b_dk2, b_dv, dq, scale,
    N1: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, HG: tl.constexpr, Dqk: tl.constexpr,
    Dv: tl.constexpr, HAS_D2: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """One step of the dK/dV kernel: (entry, head group) pairs [i_p, i_p + BLOCK_E) of the chunk, the group's
    BLOCK_G heads as tile rows (pair p: entry p // HG, heads (p % HG) * BLOCK_G + 0..BLOCK_G-1; HG = 1 but
    where a token's heads are more rows than a step takes).
    DQ_ATOMIC: also add the entries' dQ rows ``scale * dS Kb`` into the fp32 ``dq`` with atomics."""
    o_p = i_p + o_xe
    o_e = o_p // HG
    o_g = (o_p % HG) * BLOCK_G + o_xg
    m_x = (o_p < p1) & (o_g < G)
    o_t = tl.load(ent_tok + o_e, mask=m_x, other=0).to(tl.int64)
    o_s1 = tl.load(tok_pos + o_t, mask=m_x, other=0).to(tl.int64)
    o_h = o_t * N1 + i_n2 * G + o_g
    # [ROWS, BLOCK_D1], [ROWS, BLOCK_D2]
    b_q1, b_q2 = _load_split(q, o_h, m_x, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)
    # [ROWS, BLOCK_DV]
    b_do = tl.load(do + o_h[:, None] * Dv + o_dv[None, :], mask=m_x[:, None] & m_dv[None, :], other=0.0).to(DOT)
    # [ROWS]
    b_m = tl.load(m_in + o_h, mask=m_x, other=0.0)
    b_l = tl.load(l_in + o_h, mask=m_x, other=0.0)
    b_il = tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)
    b_delta = tl.load(delta + o_h, mask=m_x, other=0.0)

    # [BLOCK_KR, ROWS]
    m_vis = m_r[:, None] & m_x[None, :]
    if CAUSAL:
        m_vis = m_vis & ((p0 + o_r)[:, None] <= o_s1[None, :])
    # [BLOCK_KR, ROWS]
    b_st = _qk(b_k1, b_q1, b_k2, b_q2, HAS_D2, PREC) * scale
    b_pt = tl.where(m_vis, tl.exp(b_st - b_m[None, :]) * b_il[None, :], 0.0)
    # [BLOCK_KR, ROWS]
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
    b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(DOT)
    b_dv += tl.dot(b_pt.to(DOT), b_do, input_precision=PREC)
    b_dk1 += tl.dot(b_dst, b_q1, input_precision=PREC)
    if HAS_D2:
        b_dk2 += tl.dot(b_dst, b_q2, input_precision=PREC)
    if DQ_ATOMIC:
        # [ROWS, BLOCK_D1]; a token that picked the block twice has two entries: both rows add (docs/nsa.md)
        b_ds = tl.trans(b_dst)
        b_dq1 = tl.dot(b_ds, b_k1, input_precision=PREC) * scale
        tl.atomic_add(dq + o_h[:, None] * Dqk + o_d1[None, :], b_dq1, mask=m_x[:, None] & m_d1[None, :], sem="relaxed")
        if HAS_D2:
            # [ROWS, BLOCK_D2]
            b_dq2 = tl.dot(b_ds, b_k2, input_precision=PREC) * scale
            tl.atomic_add(dq + o_h[:, None] * Dqk + o_d2[None, :], b_dq2, mask=m_x[:, None] & m_d2[None, :],
                          sem="relaxed")
    return b_dk1, b_dk2, b_dv


@triton.jit
def nsa_bwd_dkv_kernel(
    q, k, v, do, m_in, l_in, delta,
    ent_tok, ch_blk, ch_e0, ch_e1, blk_row0, blk_p0, blk_n,
    tok_pos,
    dk, dv, ws_k, ws_v, dq,
    scale,
    N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, BLOCK_BS: tl.constexpr,
    BLOCK_KR: tl.constexpr, Dqk: tl.constexpr, Dv: tl.constexpr,
    BLOCK_G: tl.constexpr, HG: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, HAS_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    DETERMINISTIC: tl.constexpr, DQ_ATOMIC: tl.constexpr, USE_WHILE: tl.constexpr,
):
    """dK/dV, key-block-major: one program per chunk of the (sorted) list of query tokens that selected
    one key block of one KV head, and per BLOCK_KR of the block's (padded) BLOCK_BS key rows (grid axis 1;
    a wide block is split so that its K/V rows and fp32 accumulators fit). Each step gathers BLOCK_E such
    tokens x BLOCK_G heads as tile rows (or, HG > 1, one group of BLOCK_G of a token's HG * BLOCK_G heads).
    DETERMINISTIC: the chunk's fp32 partial goes to its own workspace slot (reduced in order later);
    else it is added into the fp32 dk/dv buffers with atomics. DQ_ATOMIC (never with DETERMINISTIC): dQ is
    computed here too, added per step into the fp32 ``dq`` with atomics (no query-major dQ kernel)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_b = tl.load(ch_blk + i_c).to(tl.int64)
    e0 = tl.load(ch_e0 + i_c).to(tl.int64)
    e1 = tl.load(ch_e1 + i_c).to(tl.int64)
    # [BLOCK_KR] whether the chunk is a real one (-1: the unused tail of the grid), on every key lane: a mask is a
    # block of comparisons, never a scalar condition broadcast (an int32 array to Triton 3.9's interpreter)
    m_c = tl.zeros([BLOCK_KR], dtype=tl.int64) + i_b >= 0
    i_b = tl.maximum(i_b, 0)
    # blk_row0 folds in the KV head: the flat [T2 * N2] row of the block's first key
    row0 = tl.load(blk_row0 + i_b).to(tl.int64)
    p0 = tl.load(blk_p0 + i_b).to(tl.int64)
    nb = tl.load(blk_n + i_b).to(tl.int64)
    i_n2 = row0 % N2

    ROWS: tl.constexpr = BLOCK_E * BLOCK_G
    o_x = tl.arange(0, ROWS)
    o_xe = o_x // BLOCK_G
    o_xg = o_x % BLOCK_G
    # this program's key rows of the block
    o_r = tl.program_id(1) * BLOCK_KR + tl.arange(0, BLOCK_KR)
    m_r = o_r < nb
    o_d1, m_d1, o_d2, m_d2, o_dv, m_dv = _head_dims(Dqk, Dv, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    o_krow = row0 + o_r * N2
    # [BLOCK_KR, BLOCK_D1], [BLOCK_KR, BLOCK_D2]
    b_k1, b_k2 = _load_split(k, o_krow, m_r, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)
    # [BLOCK_KR, BLOCK_DV]
    b_v = tl.load(v + o_krow[:, None] * Dv + o_dv[None, :], mask=m_r[:, None] & m_dv[None, :], other=0.0).to(DOT)

    # [BLOCK_KR, BLOCK_D1]
    b_dk1 = tl.zeros([BLOCK_KR, BLOCK_D1], dtype=tl.float32)
    # [BLOCK_KR, BLOCK_D2]
    b_dk2 = tl.zeros([BLOCK_KR, BLOCK_D2], dtype=tl.float32)
    # [BLOCK_KR, BLOCK_DV]
    b_dv = tl.zeros([BLOCK_KR, BLOCK_DV], dtype=tl.float32)

    if USE_WHILE:
        # the interpreter cannot iterate range() over loaded scalars
        i_p = e0 * HG
        while i_p < e1 * HG:
            b_dk1, b_dk2, b_dv = _dkv_step(
                i_p, e1 * HG, q, do, m_in, l_in, delta, ent_tok, tok_pos, p0, i_n2, o_r, m_r, o_xe, o_xg,
                o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, b_k1, b_k2, b_v, b_dk1, b_dk2, b_dv, dq, scale,
                N1, G, BLOCK_G, HG, Dqk, Dv, HAS_D2, CAUSAL, DOT, PREC, DQ_ATOMIC,
            )
            i_p += BLOCK_E
    else:
        for i_p in range(e0 * HG, e1 * HG, BLOCK_E):
            b_dk1, b_dk2, b_dv = _dkv_step(
                i_p, e1 * HG, q, do, m_in, l_in, delta, ent_tok, tok_pos, p0, i_n2, o_r, m_r, o_xe, o_xg,
                o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, b_k1, b_k2, b_v, b_dk1, b_dk2, b_dv, dq, scale,
                N1, G, BLOCK_G, HG, Dqk, Dv, HAS_D2, CAUSAL, DOT, PREC, DQ_ATOMIC,
            )

    b_dk1 = b_dk1 * scale
    b_dk2 = b_dk2 * scale
    if DETERMINISTIC:
        p_wk = ws_k + i_c * BLOCK_BS * Dqk + o_r[:, None] * Dqk
        p_wv = ws_v + i_c * BLOCK_BS * Dv + o_r[:, None] * Dv
        tl.store(p_wk + o_d1[None, :], b_dk1, mask=m_c[:, None] & m_d1[None, :])
        if HAS_D2:
            tl.store(p_wk + o_d2[None, :], b_dk2, mask=m_c[:, None] & m_d2[None, :])
        tl.store(p_wv + o_dv[None, :], b_dv, mask=m_c[:, None] & m_dv[None, :])
    else:
        m_st = (m_c & m_r)[:, None]
        tl.atomic_add(dk + o_krow[:, None] * Dqk + o_d1[None, :], b_dk1, mask=m_st & m_d1[None, :], sem="relaxed")
        if HAS_D2:
            tl.atomic_add(dk + o_krow[:, None] * Dqk + o_d2[None, :], b_dk2, mask=m_st & m_d2[None, :], sem="relaxed")
        tl.atomic_add(dv + o_krow[:, None] * Dv + o_dv[None, :], b_dv, mask=m_st & m_dv[None, :], sem="relaxed")


@triton.jit
def nsa_bwd_delta_kernel(o, do, delta, n_rows, Dv: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``delta = rowsum(dO * O)`` in fp32 over the flat ``[T1 * N1, Dv]`` rows (when the dQ kernel, which
    otherwise writes it, does not run)."""
    o_x = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_dv = tl.arange(0, BLOCK_DV)
    m = (o_x < n_rows)[:, None] & (o_dv < Dv)[None, :]
    # [BLOCK_R, BLOCK_DV]
    b_do = tl.load(do + o_x[:, None] * Dv + o_dv[None, :], mask=m, other=0.0).to(tl.float32)
    b_o = tl.load(o + o_x[:, None] * Dv + o_dv[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(delta + o_x, tl.sum(b_do * b_o, 1), mask=o_x < n_rows)


@triton.jit
def nsa_bwd_reduce_kernel(
    ws_k, ws_v, blk_c0, blk_c1, blk_row0, blk_n, dk, dv,
    N2: tl.constexpr, BS: tl.constexpr, BLOCK_BS: tl.constexpr, Dqk: tl.constexpr, Dv: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Deterministic path: dk/dv rows of one key block of one KV head = the sum of its chunks' partials,
    added in chunk order. Grid (blocks, column tiles of BLOCK_D over Dqk + Dv)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    c0 = tl.load(blk_c0 + i_b).to(tl.int64)
    c1 = tl.load(blk_c1 + i_b).to(tl.int64)
    row0 = tl.load(blk_row0 + i_b).to(tl.int64)
    nb = tl.load(blk_n + i_b).to(tl.int64)
    o_r = tl.arange(0, BLOCK_BS)
    m_r = o_r < nb
    o_c = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    # row0 already folds in the KV head: row0 = key_row * N2 + n2
    o_krow = row0 + o_r * N2
    if i_d * BLOCK_D < Dqk:
        m_d = o_c < Dqk
        # [BLOCK_BS, BLOCK_D]
        b_acc = tl.zeros([BLOCK_BS, BLOCK_D], dtype=tl.float32)
        i_c = c0
        while i_c < c1:
            b_acc += tl.load(ws_k + i_c * BLOCK_BS * Dqk + o_r[:, None] * Dqk + o_c[None, :], mask=m_d[None, :], other=0.0)
            i_c += 1
        tl.store(dk + o_krow[:, None] * Dqk + o_c[None, :], b_acc.to(dk.dtype.element_ty),
                 mask=m_r[:, None] & m_d[None, :])
    else:
        o_cv = o_c - tl.cdiv(Dqk, BLOCK_D) * BLOCK_D
        m_d = (o_cv >= 0) & (o_cv < Dv)
        # [BLOCK_BS, BLOCK_D]
        b_acc = tl.zeros([BLOCK_BS, BLOCK_D], dtype=tl.float32)
        i_c = c0
        while i_c < c1:
            b_acc += tl.load(ws_v + i_c * BLOCK_BS * Dv + o_r[:, None] * Dv + o_cv[None, :], mask=m_d[None, :], other=0.0)
            i_c += 1
        tl.store(dv + o_krow[:, None] * Dv + o_cv[None, :], b_acc.to(dv.dtype.element_ty),
                 mask=m_r[:, None] & m_d[None, :])
