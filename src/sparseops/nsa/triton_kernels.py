"""Triton kernels for NSA selected attention (forward, dQ, dK/dV, deterministic reduction).

Launchers, index building and the design notes live in ``triton_impl.py`` and ``docs/nsa.md (GPU section)``.
Head dims are split into two power-of-two chunks, ``D1 = BLOCK_D1`` columns and the rest padded to
``BLOCK_D2`` (192 = 128 + 64 without padding); ``HAS_D2`` is False when one chunk covers ``Dqk``.
``DOT`` is the dtype fed to ``tl.dot`` (the input dtype on GPU, fp32 under the interpreter);
accumulation is always fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _qk(b_a1, b_b1, b_a2, b_b2, HAS_D2: tl.constexpr, PREC: tl.constexpr):
    # [rows_a, rows_b] = a @ b^T over both head-dim chunks
    b_s = tl.dot(b_a1, tl.trans(b_b1), input_precision=PREC)
    if HAS_D2:
        b_s += tl.dot(b_a2, tl.trans(b_b2), input_precision=PREC)
    return b_s


@triton.jit
def _load_split(p, o_row, m_row, o_d1, m_d1, o_d2, m_d2, D: tl.constexpr, HAS_D2: tl.constexpr, DOT: tl.constexpr):
    """Rows ``o_row`` of a ``[*, D]`` tensor as its two head-dim chunks (the second is the first when HAS_D2
    is False), masked rows read as 0, converted to the dot dtype."""
    # [rows, BLOCK_D1]
    b_1 = tl.load(p + o_row[:, None] * D + o_d1[None, :], mask=m_row[:, None] & m_d1[None, :], other=0.0).to(DOT)
    b_2 = b_1
    if HAS_D2:
        # [rows, BLOCK_D2]
        b_2 = tl.load(p + o_row[:, None] * D + o_d2[None, :], mask=m_row[:, None] & m_d2[None, :], other=0.0).to(DOT)
    return b_1, b_2


@triton.jit
def _block_keys(idx, o_r, s1, kv0, S2, i_n2, N2: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr):
    """Block ``idx`` of one sequence: the in-sequence positions and flat key rows of its keys, and which of
    them a query at position ``s1`` sees (spec §2)."""
    o_p = idx * BS + o_r
    # the id on every key lane: a mask is a block of comparisons, never a scalar condition broadcast (an int32
    # array to Triton 3.9's interpreter, whose loads reject it)
    o_idx = tl.zeros_like(o_r).to(tl.int64) + idx
    # the id is range-checked before its keys: (validate=False) idx * BS of an int64 id past 2**63 / BS wraps
    m_k = (o_idx >= 0) & (o_idx < (S2 + BS - 1) // BS) & (o_r < BS) & (o_p < S2)
    if CAUSAL:
        m_k = m_k & (o_p <= s1)
    return o_p, (kv0 + o_p) * N2 + i_n2, m_k


@triton.jit
def _pack_setup(
    topk, pk_ids, pk_nu, t0, i_p, o_xj, m_x, s1, n_tok, i_n2,
    N2: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr,
):
    """What a packed program needs about its pack: each row's token selection ``b_tk [ROWS, BLOCK_K]`` (-2
    matches no block), each row's token position ``o_xs1 [ROWS]``, the last token's position, the pointer to
    the pack's distinct block ids and their count."""
    o_kk = tl.arange(0, BLOCK_K)
    b_tk = tl.load(topk + ((t0 + o_xj) * N2 + i_n2)[:, None] * K + o_kk[None, :],
                   mask=m_x[:, None] & (o_kk < K)[None, :], other=-2)
    # (validate=False) int64 ids outside int32 would wrap into real blocks: below -2 is -2, above the int32 max
    # (never a pack's id, ``build_pack_table``) the max
    b_tk = tl.minimum(tl.maximum(b_tk.to(tl.int64), -2), 2147483647).to(tl.int32)
    o_xs1 = s1 + o_xj
    s1_last = s1 + n_tok - 1
    p_ids = pk_ids + (i_p * N2 + i_n2) * (PACK * K)
    n_u = tl.load(pk_nu + i_p * N2 + i_n2)
    return b_tk, o_xs1, s1_last, p_ids, n_u


@triton.jit
def _pack_block(
    p_ids, i_u, b_tk, o_xs1, s1_last, o_r, kv0, S2, i_n2,
    N2: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Distinct block ``i_u`` of a token pack. The key mask ``m_k`` is the union over the pack (the last token
    sees most under causal masking); per tile row, ``m_s`` is what that row sees (its token selected the
    block, its own causal bound) and ``b_w`` how often its token selected the block (duplicates count)."""
    idx = tl.load(p_ids + i_u).to(tl.int64)
    o_p, o_row, m_k = _block_keys(idx, o_r, s1_last, kv0, S2, i_n2, N2, BS, CAUSAL)
    # [ROWS]
    b_w = tl.sum((b_tk == idx.to(tl.int32)).to(tl.float32), 1)
    # [ROWS, BLOCK_BS]
    m_s = m_k[None, :] & (b_w > 0)[:, None]
    if CAUSAL:
        m_s = m_s & (o_p[None, :] <= o_xs1[:, None])
    return o_row, m_k, m_s, b_w


@triton.jit
def _fwd_step(
    k, v, o_row, m_k, m_s, b_w, b_q1, b_q2, b_m, b_l, b_acc, o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale,
    Dqk: tl.constexpr, Dv: tl.constexpr, HAS_D2: tl.constexpr, HAS_W: tl.constexpr, DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """One key block of the online softmax. Keys ``m_k`` are loaded; row x sees key r where ``m_s[x, r]``;
    with HAS_W each row's terms count ``b_w[x]`` times."""
    # [BLOCK_BS, BLOCK_D1], [BLOCK_BS, BLOCK_D2]
    b_k1, b_k2 = _load_split(k, o_row, m_k, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)
    # [BLOCK_BS, BLOCK_DV]
    b_v = tl.load(v + o_row[:, None] * Dv + o_dv[None, :], mask=m_k[:, None] & m_dv[None, :], other=0.0).to(DOT)
    # [ROWS, BLOCK_BS]
    b_s = _qk(b_q1, b_k1, b_q2, b_k2, HAS_D2, PREC) * scale
    b_s = tl.where(m_s, b_s, float("-inf"))
    b_mnew = tl.maximum(b_m, tl.max(b_s, 1))
    # rows that have seen nothing yet keep -inf; subtract 0 there so exp gives 0, not NaN
    b_mref = tl.where(b_mnew == float("-inf"), 0.0, b_mnew)
    b_p = tl.exp(b_s - b_mref[:, None])
    if HAS_W:
        b_p = b_p * b_w[:, None]
    b_alpha = tl.exp(b_m - b_mref)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(DOT), b_v, input_precision=PREC)
    return b_mnew, b_l, b_acc


@triton.jit
def _pack_rows(i_p, i_n2, pk_t0, pk_n, tok_pos, tok_kv0, tok_s2, N1: tl.constexpr, G: tl.constexpr,
               BLOCK_G: tl.constexpr, PACK: tl.constexpr):
    """The tile rows of a forward / dQ program: row x = (token j = x // BLOCK_G of the pack, head g = x % BLOCK_G).
    PACK == 1: the pack is token ``i_p``. Returns the pack's first token, its token count, the position of its
    first token, its sequence's first key row and S2, the rows' flat (token, head) ids, their mask and token j."""
    if PACK == 1:
        t0 = i_p
        n_tok = 1
    else:
        t0 = tl.load(pk_t0 + i_p).to(tl.int64)
        n_tok = tl.load(pk_n + i_p).to(tl.int64)
    s1 = tl.load(tok_pos + t0).to(tl.int64)
    kv0 = tl.load(tok_kv0 + t0).to(tl.int64)
    S2 = tl.load(tok_s2 + t0).to(tl.int64)
    o_x = tl.arange(0, PACK * BLOCK_G)
    o_xj = o_x // BLOCK_G
    o_xg = o_x % BLOCK_G
    m_x = (o_xg < G) & (o_xj < n_tok)
    o_h = (t0 + o_xj) * N1 + i_n2 * G + o_xg
    return t0, n_tok, s1, kv0, S2, o_h, m_x, o_xj


@triton.jit
def nsa_fwd_kernel(
    q, k, v, topk, o, m_out, l_out,
    tok_pos, tok_kv0, tok_s2, pk_t0, pk_n, pk_ids, pk_nu, run,
    scale,
    N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BS: tl.constexpr, BLOCK_BS: tl.constexpr,
    Dqk: tl.constexpr, Dv: tl.constexpr,
    BLOCK_G: tl.constexpr, PACK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, HAS_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, USE_WHILE: tl.constexpr,
    GATE: tl.constexpr, BLOCK_KC: tl.constexpr,
):
    """One program per (pack of PACK consecutive query tokens of one sequence, KV head); the tile rows are the
    pack's (token, head) pairs. PACK == 1 (G >= 9): the token's K slots in order. PACK > 1: the pack's distinct
    selected blocks (``pk_ids``, ``pk_nu`` of them), each loaded and multiplied once for all rows.
    GATE: the program runs only where ``run[pack, n2]`` is set (wide packs and ordinary programs split the
    tokens between two launches, ``triton_impl._q_plan``). A step takes ``BLOCK_KC`` keys of a block (the whole
    padded block, or a part of it where that does not fit the device's shared memory: the online softmax takes
    any run of keys as a step)."""
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
    o_d1 = tl.arange(0, BLOCK_D1)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d1 = o_d1 < Dqk
    m_dv = o_dv < Dv

    o_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    m_d2 = o_d2 < Dqk
    # [ROWS, BLOCK_D1], [ROWS, BLOCK_D2]
    b_q1, b_q2 = _load_split(q, o_h, m_x, o_d1, m_d1, o_d2, m_d2, Dqk, HAS_D2, DOT)

    # [ROWS]
    b_m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([ROWS], dtype=tl.float32)
    # [ROWS, BLOCK_DV]
    b_acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)

    if PACK == 1:
        p_topk = topk + (t0 * N2 + i_n2) * K
        for i_s in range(K * NKC):
            idx = tl.load(p_topk + i_s // NKC).to(tl.int64)
            o_p, o_row, m_k = _block_keys(idx, (i_s % NKC) * BLOCK_KC + o_r, s1, kv0, S2, i_n2, N2, BS, CAUSAL)
            # every row sees what the token sees; no multiplicities (b_l stands in for the unused weights)
            b_m, b_l, b_acc = _fwd_step(k, v, o_row, m_k, m_k[None, :], b_l, b_q1, b_q2, b_m, b_l, b_acc,
                                        o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, False, DOT, PREC)
    else:
        b_tk, o_xs1, s1_last, p_ids, n_u = _pack_setup(topk, pk_ids, pk_nu, t0, i_p, o_xj, m_x, s1, n_tok, i_n2,
                                                       N2, K, BLOCK_K, PACK)
        if USE_WHILE:
            # the interpreter cannot iterate range() over loaded scalars
            i_s = 0
            while i_s < n_u * NKC:
                o_row, m_k, m_s, b_w = _pack_block(p_ids, i_s // NKC, b_tk, o_xs1, s1_last,
                                                   (i_s % NKC) * BLOCK_KC + o_r, kv0, S2, i_n2, N2, BS, CAUSAL)
                b_m, b_l, b_acc = _fwd_step(k, v, o_row, m_k, m_s, b_w, b_q1, b_q2, b_m, b_l, b_acc,
                                            o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, True, DOT, PREC)
                i_s += 1
        else:
            for i_s in range(0, n_u * NKC):
                o_row, m_k, m_s, b_w = _pack_block(p_ids, i_s // NKC, b_tk, o_xs1, s1_last,
                                                   (i_s % NKC) * BLOCK_KC + o_r, kv0, S2, i_n2, N2, BS, CAUSAL)
                b_m, b_l, b_acc = _fwd_step(k, v, o_row, m_k, m_s, b_w, b_q1, b_q2, b_m, b_l, b_acc,
                                            o_d1, m_d1, o_d2, m_d2, o_dv, m_dv, scale, Dqk, Dv, HAS_D2, True, DOT, PREC)

    m_any = b_l > 0
    b_out = b_acc / tl.where(m_any, b_l, 1.0)[:, None]
    tl.store(o + o_h[:, None] * Dv + o_dv[None, :], b_out.to(o.dtype.element_ty), mask=m_x[:, None] & m_dv[None, :])
    tl.store(m_out + o_h, tl.where(m_any, b_m, 0.0), mask=m_x)
    tl.store(l_out + o_h, b_l, mask=m_x)


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
    o_d1 = tl.arange(0, BLOCK_D1)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d1 = o_d1 < Dqk
    m_dv = o_dv < Dv

    o_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    m_d2 = o_d2 < Dqk
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
        # [ROWS, BLOCK_D1]; a token that picked the block twice has two entries: both rows add (spec §2)
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
    o_d1 = tl.arange(0, BLOCK_D1)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d1 = o_d1 < Dqk
    m_dv = o_dv < Dv
    o_krow = row0 + o_r * N2

    o_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    m_d2 = o_d2 < Dqk
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
