"""Inputs, the dense float64 check and the byte counts of the GPU NSA benchmark (benchmarks/gpu_nsa.py)."""

from __future__ import annotations

import torch

from sparseops import testing
from sparseops._varlen import seq_lengths, token_seq_positions


def make_inputs(seqlens, *, N2, G, Dqk, Dv, bs, K, dtype, device, causal=True, seed=0, pattern="uniform"):
    """Random q/k/v made on the device; block ids from ``testing.make_topk_indices`` on the device (distinct,
    causal-allowed, -1 if none; ``pattern="nsa"``: first, own and previous block forced, the rest shared by
    each 64-token window, as NSA's selection tends to be)."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(seqlens)
    q = torch.randn(T, N2 * G, Dqk, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(T, N2, Dqk, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(T, N2, Dv, generator=g, device=device, dtype=torch.float32).to(dtype)
    topk = testing.make_topk_indices(
        seqlens, seqlens, N2, K, bs, causal=causal, seed=seed + 1, device=device, chunk=8192, pattern=pattern
    )
    cu = [0]
    for S in seqlens:
        cu.append(cu[-1] + S)
    return q, k, v, topk, cu


def visible_pairs(topk, bs, cu_q, cu_kv, causal):
    """Number of visible (query token, KV head, key) triples, counting duplicates (spec §2)."""
    dev = topk.device
    seq_id, pos = token_seq_positions(cu_q, device=dev)
    s2 = torch.tensor(seq_lengths(cu_kv), dtype=torch.int64, device=dev)[seq_id]
    lim = torch.minimum(s2, pos + 1) if causal else s2
    start = topk.to(torch.int64) * bs
    n = torch.clamp(lim[:, None, None] - start, min=0, max=bs)
    return int(torch.where(topk >= 0, n, torch.zeros_like(n)).sum())


def dense_gather(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    """Vectorized fp32 NSA forward by gathering the K*bs keys of every (token, KV head); autograd gives grads."""
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G, K = N1 // N2, topk.shape[2]
    dev = q.device
    seq_id, pos = token_seq_positions(cu_q, device=dev)
    kv0 = torch.tensor(cu_kv[:-1], dtype=torch.int64, device=dev)[seq_id]
    s2 = torch.tensor(seq_lengths(cu_kv), dtype=torch.int64, device=dev)[seq_id]
    idx = topk.to(torch.int64)
    p = (idx[..., None] * bs + torch.arange(bs, device=dev)).reshape(T1, N2, K * bs)  # [T1, N2, K*bs]
    vis = (idx[..., None] >= 0).expand(T1, N2, K, bs).reshape(T1, N2, K * bs) & (p < s2[:, None, None])
    if causal:
        vis = vis & (p <= pos[:, None, None])
    rows = torch.where(vis, kv0[:, None, None] + p, torch.zeros_like(p))
    heads = torch.arange(N2, device=dev)[None, :, None]
    kg = k.float()[rows, heads]  # [T1, N2, K*bs, Dqk]
    vg = v.float()[rows, heads]
    s = torch.einsum("tngd,tnkd->tngk", q.float().view(T1, N2, G, Dqk), kg) * scale
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    w = e / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("tngk,tnkd->tngd", w, vg).reshape(T1, N1, Dv)


def traffic(q, topk, vis, bs, Dv, cu):
    """Bytes the kernels must move (docs/nsa.md, GPU section, "What bounds the kernels").

    ``*_gather_bytes``: the selected K/V rows the query-major kernels (forward, dQ) load, one
    ``(Dqk + Dv)``-wide row per visible (token, KV head, key): the traffic that sets their speed, served
    from L2 where programs running at the same time share blocks, else from HBM. ``*_io_bytes``: every
    tensor read or written once (the floor no design avoids)."""
    T1, N1, Dqk = q.shape
    N2 = topk.shape[1]
    G = N1 // N2
    b = q.element_size()
    T2 = cu[-1]
    entries = int((topk >= 0).sum())  # (token, KV head, slot) with a block
    kv = T2 * N2 * (Dqk + Dv) * b
    rows = T1 * N1
    gather = vis * (Dqk + Dv) * b
    return {
        "fwd_gather_bytes": gather,
        "fwd_io_bytes": rows * (Dqk + Dv) * b + kv + rows * 8,
        # dQ pass: the same gather; dK/dV pass: q and dO rows of every entry's G heads, and K/V once per block
        "bwd_gather_bytes": gather + entries * G * (Dqk + Dv) * b + kv,
        "bwd_io_bytes": rows * (2 * Dqk + 2 * Dv) * b + 2 * kv + rows * 8,
    }
