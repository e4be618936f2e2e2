"""Slow, obvious NSA selected attention that reads like the formulas of docs/nsa.md: the test oracle.

Arguments are already validated. ``cu_q`` / ``cu_kv`` are cumulative lengths *with* the leading 0 (Python
ints); ``causal`` is ``sparse_mode == 2``. Stats are returned as ``[T1, N1]`` (the API repeats them over
CANN's 8 lanes). Arithmetic is fp32, float64 for float64 inputs. A row with no visible key gets
``out = 0``, ``softmax_max = 0``, ``softmax_sum = 0`` and zero gradients.
"""

from __future__ import annotations

import torch

from .._numerics import acc_dtype


def gather_visible(topk_row, bs, kv_start, S2, s1, causal):
    """For one (token, KV head): the absolute key rows of the K*bs gathered keys and their visibility mask."""
    rows, vis = [], []
    for idx in topk_row.tolist():
        for r in range(bs):
            p = idx * bs + r
            ok = idx != -1 and p < S2 and (not causal or p <= s1)
            rows.append(kv_start + p if ok else kv_start)
            vis.append(ok)
    dev = topk_row.device
    return torch.tensor(rows, dtype=torch.int64, device=dev), torch.tensor(vis, dtype=torch.bool, device=dev)


def _iter_rows(q, topk, bs, cu_q, cu_kv, causal):
    """Yield (t, n2, key rows, visible mask) for every query token and KV head."""
    N2 = topk.shape[1]
    for b in range(len(cu_q) - 1):
        S2 = cu_kv[b + 1] - cu_kv[b]
        for t in range(cu_q[b], cu_q[b + 1]):
            for n2 in range(N2):
                rows, vis = gather_visible(topk[t, n2], bs, cu_kv[b], S2, t - cu_q[b], causal)
                yield t, n2, rows, vis


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    T1, N1, _ = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G = N1 // N2
    acc = acc_dtype(q)
    out = torch.zeros(T1, N1, Dv, dtype=acc, device=q.device)
    m = torch.zeros(T1, N1, dtype=acc, device=q.device)
    l = torch.zeros(T1, N1, dtype=acc, device=q.device)
    for t, n2, rows, vis in _iter_rows(q, topk, bs, cu_q, cu_kv, causal):
        if not vis.any():
            continue
        hs = slice(n2 * G, (n2 + 1) * G)
        ks, vs = k[rows[vis], n2].to(acc), v[rows[vis], n2].to(acc)  # [n, Dqk], [n, Dv]
        x = scale * (q[t, hs].to(acc) @ ks.T)  # [G, n]
        mx = x.max(dim=1).values
        e = torch.exp(x - mx[:, None])
        sm = e.sum(dim=1)
        out[t, hs] = (e / sm[:, None]) @ vs
        m[t, hs], l[t, hs] = mx, sm
    return out.to(q.dtype), m, l


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    # ``deterministic`` is accepted for the backend contract (docs/internals.md); this loop is always ordered
    T1, N1, _ = q.shape
    N2 = k.shape[1]
    G = N1 // N2
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for t, n2, rows, vis in _iter_rows(q, topk, bs, cu_q, cu_kv, causal):
        if not vis.any():
            continue
        hs = slice(n2 * G, (n2 + 1) * G)
        sel = rows[vis]
        ks, vs = k[sel, n2].to(acc), v[sel, n2].to(acc)
        qh, dy, o = q[t, hs].to(acc), dout[t, hs].to(acc), out[t, hs].to(acc)
        x = scale * (qh @ ks.T)
        p = torch.exp(x - m[t, hs].to(acc)[:, None]) / l[t, hs].to(acc)[:, None]  # [G, n]
        dp = dy @ vs.T
        d = (dy * o).sum(dim=1)
        ds = p * (dp - d[:, None])
        dq[t, hs] = scale * (ds @ ks)
        dk[:, n2].index_add_(0, sel, scale * (ds.T @ qh))
        dv[:, n2].index_add_(0, sel, p.T @ dy)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
