"""Triton kernels of NSA selected attention at token granularity (``selected_block_size`` 1, 2, 4, 8; docs/nsa.md).

Same internal signatures as ``reference.py`` (docs/internals.md); arguments are validated. A block of 1-8 keys
would leave the 16-row tiles of ``triton_kernels.py`` mostly empty, so these kernels gather instead:

- ``forward``: one program per (query token, KV head, block of ``BLOCK_G`` query heads), an fp32 online softmax
  over the token's ``K * bs`` gathered keys in steps of ``BLOCK_N`` (each step loads its keys' rows through the
  selected ids, masked by the rules of docs/nsa.md: -1 slots, positions past the sequence, causal);
- ``backward``: the same grid; a program recomputes ``P`` from the stats, keeps its heads' ``dQ`` in registers and
  produces each gathered key's ``dK`` / ``dV`` contribution summed over its heads. Default: added into fp32
  ``dk`` / ``dv`` with atomics. ``deterministic=True``: written per (head block, token, slot) to a workspace,
  in chunks of tokens (``WORKSPACE_BYTES``), summed over head blocks in order and added into the key rows with
  ``index_put_(accumulate=True)`` (sorted, fixed-order adds): bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks, _triton
from .triton_plan import _next_pow2, _token_meta

#: bytes of the deterministic backward's per-chunk workspace of dK / dV contributions
WORKSPACE_BYTES = 256 * 2**20

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _slots(topk, t, n2, j0, pos, kv0, s2, N2: tl.constexpr, K: tl.constexpr, BS: tl.constexpr,
           CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Gathered keys ``j0 .. j0 + BLOCK_N`` of (token ``t``, KV head ``n2``): their key rows and visibility."""
    j = j0 + tl.arange(0, BLOCK_N)
    jm = j < K * BS
    idx = tl.load(topk + (t * N2 + n2) * K + j // BS, mask=jm, other=-1)
    p = idx.to(tl.int64) * BS + j % BS
    vis = jm & (idx != -1) & (p < s2)
    if CAUSAL:
        vis = vis & (p <= pos)
    return j, jm, (kv0 + p) * N2 + n2, vis


@triton.jit
def gather_fwd_kernel(q, k, v, topk, o, m_out, l_out, tok_pos, tok_kv0, tok_s2, scale,
                      N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BS: tl.constexpr,
                      Dqk: tl.constexpr, Dv: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n2 = tl.program_id(1)
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    gm = g < G
    h = n2 * G + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    pos = tl.load(tok_pos + t)
    kv0 = tl.load(tok_kv0 + t)
    s2 = tl.load(tok_s2 + t)
    b_q = tl.load(q + (t * N1 + h)[:, None] * Dqk + d[None, :], mask=gm[:, None] & (d < Dqk)[None, :], other=0.0)
    b_q = b_q.to(tl.float32) * scale
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for j0 in range(0, K * BS, BLOCK_N):
        j, jm, row, vis = _slots(topk, t, n2, j0, pos, kv0, s2, N2, K, BS, CAUSAL, BLOCK_N)
        b_k = tl.load(k + row[:, None] * Dqk + d[None, :], mask=vis[:, None] & (d < Dqk)[None, :], other=0.0)
        b_s = tl.dot(b_q.to(DOT), tl.trans(b_k.to(DOT)), input_precision=PREC)
        b_s = tl.where(vis[None, :], b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_alpha = tl.exp(b_m - m_safe)
        b_p = tl.exp(b_s - m_safe[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(v + row[:, None] * Dv + dv[None, :], mask=vis[:, None] & (dv < Dv)[None, :], other=0.0)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(DOT), b_v.to(DOT), input_precision=PREC)
        b_m = m_new
    b_inv = tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)
    rows = t * N1 + h
    tl.store(o + rows[:, None] * Dv + dv[None, :], (b_acc * b_inv[:, None]).to(o.dtype.element_ty),
             mask=gm[:, None] & (dv < Dv)[None, :])
    tl.store(m_out + rows, tl.where(b_m == float("-inf"), 0.0, b_m), mask=gm)
    tl.store(l_out + rows, b_l, mask=gm)


@triton.jit
def gather_bwd_kernel(q, k, v, o, do, m, l, topk, dq, dk32, dv32, ws_k, ws_v, tok_pos, tok_kv0, tok_s2, scale,
                      t_base, C, N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                      BS: tl.constexpr, Dqk: tl.constexpr, Dv: tl.constexpr, CAUSAL: tl.constexpr,
                      ATOMIC: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    tc = tl.program_id(0).to(tl.int64)
    t = t_base + tc
    n2 = tl.program_id(1)
    hb = tl.program_id(2).to(tl.int64)
    g = hb * BLOCK_G + tl.arange(0, BLOCK_G)
    gm = g < G
    h = n2 * G + g
    rows = t * N1 + h
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    qm = gm[:, None] & (d < Dqk)[None, :]
    vm = gm[:, None] & (dv < Dv)[None, :]
    pos = tl.load(tok_pos + t)
    kv0 = tl.load(tok_kv0 + t)
    s2 = tl.load(tok_s2 + t)
    b_q = tl.load(q + rows[:, None] * Dqk + d[None, :], mask=qm, other=0.0).to(tl.float32) * scale
    b_do = tl.load(do + rows[:, None] * Dv + dv[None, :], mask=vm, other=0.0).to(tl.float32)
    b_o = tl.load(o + rows[:, None] * Dv + dv[None, :], mask=vm, other=0.0).to(tl.float32)
    b_dd = tl.sum(b_do * b_o, 1)
    b_mx = tl.load(m + rows, mask=gm, other=0.0)
    b_l = tl.load(l + rows, mask=gm, other=0.0)
    b_inv = tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)
    b_dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(0, K * BS, BLOCK_N):
        j, jm, row, vis = _slots(topk, t, n2, j0, pos, kv0, s2, N2, K, BS, CAUSAL, BLOCK_N)
        b_k = tl.load(k + row[:, None] * Dqk + d[None, :], mask=vis[:, None] & (d < Dqk)[None, :], other=0.0)
        b_v = tl.load(v + row[:, None] * Dv + dv[None, :], mask=vis[:, None] & (dv < Dv)[None, :], other=0.0)
        b_s = tl.dot(b_q.to(DOT), tl.trans(b_k.to(DOT)), input_precision=PREC)
        ok = gm[:, None] & vis[None, :]
        b_p = tl.where(ok, tl.exp(tl.minimum(b_s - b_mx[:, None], 80.0)) * b_inv[:, None], 0.0)
        b_dp = tl.dot(b_do.to(DOT), tl.trans(b_v.to(DOT)), input_precision=PREC)
        b_ds = b_p * (b_dp - b_dd[:, None])
        b_dq += tl.dot(b_ds.to(DOT), b_k.to(DOT), input_precision=PREC)
        # dK = scale * dS^T Q (b_q holds scale * Q), dV = P^T dY
        b_dk = tl.dot(tl.trans(b_ds).to(DOT), b_q.to(DOT), input_precision=PREC)
        b_dv = tl.dot(tl.trans(b_p).to(DOT), b_do.to(DOT), input_precision=PREC)
        if ATOMIC:
            tl.atomic_add(dk32 + row[:, None] * Dqk + d[None, :], b_dk, mask=vis[:, None] & (d < Dqk)[None, :])
            tl.atomic_add(dv32 + row[:, None] * Dv + dv[None, :], b_dv, mask=vis[:, None] & (dv < Dv)[None, :])
        else:
            slot = ((hb * C + tc) * N2 + n2) * (K * BS) + j
            tl.store(ws_k + slot[:, None] * Dqk + d[None, :], b_dk, mask=jm[:, None] & (d < Dqk)[None, :])
            tl.store(ws_v + slot[:, None] * Dv + dv[None, :], b_dv, mask=jm[:, None] & (dv < Dv)[None, :])
    tl.store(dq + rows[:, None] * Dqk + d[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=qm)


def _check_dtype(q):
    if q.dtype not in _SUPPORTED:
        raise TypeError(f"query: the triton backend supports float16, bfloat16 and float32, got "
                        f"{str(q.dtype).replace('torch.', '')} (use backend='torch' for float64)")


def _meta(q, k, v, topk, bs, causal) -> dict:
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G = N1 // N2
    BD, BDV = max(16, _next_pow2(Dqk)), max(16, _next_pow2(Dv))
    if _checks.triton_interpret() or q.dtype == torch.float32:
        dot = {"DOT": tl.float32, "PREC": "ieee"}  # fp32 dots exact (no tf32); the interpreter has no half dots
    else:
        dot = {"DOT": tl.float16 if q.dtype == torch.float16 else tl.bfloat16, "PREC": "tf32"}
    return dict(N1=N1, N2=N2, G=G, K=topk.shape[2], BS=bs, Dqk=Dqk, Dv=Dv, CAUSAL=bool(causal),
                BLOCK_G=min(max(16, _next_pow2(G)), 64), BLOCK_N=16 if max(BD, BDV) > 128 else 32, BLOCK_D=BD,
                BLOCK_DV=BDV, **dot)


def _shape(meta) -> str:
    return (f"G={meta['G']}, selected_block_count={meta['K']}, selected_block_size={meta['BS']}, "
            f"Dqk={meta['Dqk']}, Dv={meta['Dv']}")


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    _check_dtype(q)
    T1, N1, _ = q.shape
    out = torch.empty(T1, N1, v.shape[2], dtype=q.dtype, device=q.device)
    m = torch.zeros(T1, N1, dtype=torch.float32, device=q.device)
    l = torch.zeros(T1, N1, dtype=torch.float32, device=q.device)
    if T1 == 0:
        return out, m, l
    q, k, v, topk = q.contiguous(), k.contiguous(), v.contiguous(), topk.contiguous()
    _, pos, kv0, s2 = _token_meta(cu_q, cu_kv, q.device)
    meta = _meta(q, k, v, topk, bs, causal)
    grid = (T1, meta["N2"], triton.cdiv(meta["G"], meta["BLOCK_G"]))
    _triton.launch(gather_fwd_kernel, grid, q.device,
                   dict(q=q, k=k, v=v, topk=topk, o=out, m_out=m, l_out=l, tok_pos=pos, tok_kv0=kv0, tok_s2=s2,
                        scale=float(scale)), num_warps=4, shape=_shape(meta), **meta)
    return out, m, l


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    _check_dtype(q)
    T1, N1, Dqk = q.shape
    T2, N2, Dv = v.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv32 = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if T1 == 0:
        return dq.zero_(), dk32.to(k.dtype), dv32.to(v.dtype)
    q, k, v, topk = q.contiguous(), k.contiguous(), v.contiguous(), topk.contiguous()
    out, dout, m, l = out.contiguous(), dout.contiguous(), m.contiguous(), l.contiguous()
    _, pos, kv0, s2 = _token_meta(cu_q, cu_kv, q.device)
    meta = _meta(q, k, v, topk, bs, causal)
    nhb = triton.cdiv(meta["G"], meta["BLOCK_G"])
    KB = meta["K"] * bs
    args = dict(q=q, k=k, v=v, o=out, do=dout, m=m, l=l, topk=topk, dq=dq, dk32=dk32, dv32=dv32, tok_pos=pos,
                tok_kv0=kv0, tok_s2=s2, scale=float(scale))
    if not deterministic:
        dummy = dk32.new_empty(1)
        _triton.launch(gather_bwd_kernel, (T1, N2, nhb), q.device, {**args, "ws_k": dummy, "ws_v": dummy,
                       "t_base": 0, "C": T1}, num_warps=4, shape=_shape(meta), ATOMIC=True, **meta)
        return dq, dk32.to(k.dtype), dv32.to(v.dtype)
    C = max(1, min(T1, WORKSPACE_BYTES // (nhb * N2 * KB * (Dqk + Dv) * 4)))
    r = torch.arange(bs, device=q.device)
    dkf, dvf = dk32.view(-1, Dqk), dv32.view(-1, Dv)
    for t0 in range(0, T1, C):
        c = min(C, T1 - t0)
        ws_k = torch.empty(nhb, c, N2, KB, Dqk, dtype=torch.float32, device=q.device)
        ws_v = torch.empty(nhb, c, N2, KB, Dv, dtype=torch.float32, device=q.device)
        _triton.launch(gather_bwd_kernel, (c, N2, nhb), q.device, {**args, "ws_k": ws_k, "ws_v": ws_v,
                       "t_base": t0, "C": c}, num_warps=4, shape=_shape(meta), ATOMIC=False, **meta)
        idx = topk[t0:t0 + c].to(torch.int64)
        p = (idx[..., None] * bs + r).reshape(c, N2, KB)
        ok = (idx != -1).repeat_interleave(bs, dim=-1) & (p < s2[t0:t0 + c, None, None])
        if causal:
            ok &= p <= pos[t0:t0 + c, None, None]
        rows = (kv0[t0:t0 + c, None, None] + p) * N2 + torch.arange(N2, device=q.device)[:, None]
        rows = torch.where(ok, rows, 0).reshape(-1)  # an invisible key's contribution is an exact 0
        for buf, ws in ((dkf, ws_k), (dvf, ws_v)):
            src = ws.sum(dim=0).view(rows.numel(), -1)  # head blocks in order
            if buf.device.type == "cuda":
                buf.index_put_((rows,), src, accumulate=True)  # sorted, fixed-order adds
            else:
                buf.index_add_(0, rows, src)
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)
