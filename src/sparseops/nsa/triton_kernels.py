"""Triton kernels for NSA selected attention: the forward, and the helpers the backward kernels share with it.

The backward kernels (dQ, dK/dV, D, deterministic reduction) are in ``triton_kernels_bwd.py``; the launchers in
``triton_impl.py``, the launch plans in ``triton_plan.py``, the design in docs/nsa.md (GPU section).
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
def _head_dims(Dqk: tl.constexpr, Dv: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
               BLOCK_DV: tl.constexpr):
    """The head-dim offsets and masks of a program: the two QK chunks ``o_d1``, ``o_d2`` (the second starts at
    ``BLOCK_D1``) and the V dims ``o_dv``."""
    o_d1 = tl.arange(0, BLOCK_D1)
    o_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    o_dv = tl.arange(0, BLOCK_DV)
    return o_d1, o_d1 < Dqk, o_d2, o_d2 < Dqk, o_dv, o_dv < Dv


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
    them a query at position ``s1`` sees (docs/nsa.md)."""
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
    tokens between two launches, ``triton_plan._q_plan``). A step takes ``BLOCK_KC`` keys of a block (the whole
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
    o_d1, m_d1, o_d2, m_d2, o_dv, m_dv = _head_dims(Dqk, Dv, BLOCK_D1, BLOCK_D2, BLOCK_DV)
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
