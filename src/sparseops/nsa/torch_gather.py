"""The NSA torch path at token granularity (``selected_block_size`` 1, 2, 4 or 8): a per-query gather (docs/nsa.md).

Arguments arrive validated (docs/internals.md). Blocks this small make the block tiles of :mod:`.torch_plan` all
padding, so each query token instead gathers its own ``K * bs`` keys and values (one row per KV head) and every
product is one batched matmul over the chunk's (token, KV head) rows: ``[G, Dqk] x [Dqk, K*bs]`` for the scores,
``[G, K*bs] x [K*bs, Dv]`` for ``P V``. Memory is ``O(chunk * K * bs)`` above the inputs, never ``O(T^2)``.

Two levels of chunks (docs/perf.md, "DSA on the CPU"): a *group* of tokens gets its gather rows and visibility
in one go (:data:`INDEX_BYTES` of int64 rows), and its tokens then run in *chunks* whose gathered keys, values
and scores take :data:`CHUNK_BYTES`, small enough to stay in the CPU's cache. Every per-chunk tensor lives in
buffers allocated once per call and written with ``out=``: a fresh tensor per chunk faults its pages in again,
which costs more than the chunk's matmuls.

The backward adds the gathered rows' dK / dV into the key rows with ``index_add_`` in chunk order (the CPU adds
in index order: bitwise repeatable); on CUDA the deterministic path uses ``index_put_(accumulate=True)``, which
sorts the destinations and adds each one's contributions in a fixed order. An invisible gathered key points at
row 0 with weight 0, so it adds an exact 0 there.
"""

from __future__ import annotations

import torch

from .._numerics import acc_dtype, exp_floor, row_dot
from .._varlen import token_key_rows

#: bytes of one chunk's work tensors (gathered keys and values, scores and their gradients) on the CPU
CHUNK_BYTES = 8 * 2**20
#: the same on other devices, where a chunk's launches cost more than its cache misses
DEVICE_CHUNK_BYTES = 64 * 2**20
#: bytes of one group's gather rows (int64) and visibility
INDEX_BYTES = 4 * 2**20

_NEG_INF = float("-inf")


class _Rows:
    """Per call: each token's key start, sequence length and in-sequence position, and the chunk sizes."""

    def __init__(self, q, k, topk, bs, cu_q, cu_kv, per_key_bytes):
        T1 = q.shape[0]
        dev = q.device
        self.kv_start, self.S2, self.pos = token_key_rows(cu_q, cu_kv, device=dev)
        self.N2, self.bs, self.K = k.shape[1], bs, topk.shape[2]
        self.KB = self.K * bs
        self.r = torch.arange(bs, dtype=torch.int64, device=dev)
        self.n2 = torch.arange(self.N2, dtype=torch.int64, device=dev)
        budget = CHUNK_BYTES if dev.type == "cpu" else DEVICE_CHUNK_BYTES
        self.C = max(1, min(T1, budget // max(1, self.N2 * self.KB * per_key_bytes)))
        per_group = max(self.C, INDEX_BYTES // max(1, self.N2 * self.KB * 9) // self.C * self.C)
        self.group = min(T1, per_group)

    def groups(self, T1):
        return ((g0, min(T1, g0 + self.group)) for g0 in range(0, T1, self.group))

    def gather_index(self, topk, t0, t1, causal):
        """``(rows [C, N2, KB]`` int64 rows of the flattened ``[T2 * N2, D]`` keys (0 where invisible),
        ``vis [C, N2, KB]`` bool, ``last [C]`` a list: one past each token's last key some KV head sees)."""
        C = t1 - t0
        idx = topk[t0:t1].to(torch.int64)
        p = (idx[..., None] * self.bs + self.r).view(C, self.N2, self.KB)
        vis = (idx != -1).repeat_interleave(self.bs, dim=-1) & (p < self.S2[t0:t1, None, None])
        if causal:
            vis &= p <= self.pos[t0:t1, None, None]
        rows = (self.kv_start[t0:t1, None, None] + p) * self.N2 + self.n2[:, None]
        seen = vis.any(dim=1)  # [C, KB]
        ar = torch.arange(1, self.KB + 1, device=seen.device)
        last = torch.where(seen, ar, 0).amax(dim=1).tolist()
        return torch.where(vis, rows, 0), vis, last

    def work(self, topk, T1, causal):
        """Every chunk ``(t0, t1, rows [B, n], vis [B, 1, n])``, ``B = (t1 - t0) * N2``, keeping the gathered keys
        ``n`` some row of the chunk sees: trailing keys no row sees (an indexer's -1 tail, causal rows shorter than
        K) add only exact zeros."""
        for g0, g1 in self.groups(T1):
            rows_g, vis_g, last = self.gather_index(topk, g0, g1, causal)
            for c0 in range(0, g1 - g0, self.C):
                c1 = min(g1 - g0, c0 + self.C)
                n, B = max(1, max(last[c0:c1])), (c1 - c0) * self.N2
                yield g0 + c0, g0 + c1, rows_g[c0:c1, :, :n].reshape(B, n), vis_g[c0:c1, :, :n].reshape(B, 1, n)


class _Buffers:
    """Flat work buffers of one call, each viewed per chunk as ``take(name, *shape)``."""

    def __init__(self, dev, acc, **numel):
        self._b = {name: torch.empty(n, dtype=acc, device=dev) for name, n in numel.items()}

    def take(self, name, *shape):
        n = 1
        for s in shape:
            n *= s
        return self._b[name][:n].view(*shape)


def _gather(flat, rows, buf):
    """``flat[rows]`` into ``buf`` ``[B, n, D]`` (``rows [B, n]``)."""
    B, n = rows.shape
    return torch.index_select(flat, 0, rows.reshape(-1), out=buf.view(B * n, -1)).view(B, n, -1)


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    """``(out [T1, N1, Dv]`` in q's dtype, ``m [T1, N1]``, ``l [T1, N1])`` (fp32, float64 for float64)."""
    acc = acc_dtype(q)
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G = N1 // N2
    dev = q.device
    out = torch.zeros(T1, N1, Dv, dtype=q.dtype, device=dev)
    m = torch.zeros(T1, N1, dtype=acc, device=dev)
    l = torch.zeros(T1, N1, dtype=acc, device=dev)
    if T1 == 0 or k.shape[0] == 0:
        return out, m, l
    elt = torch.finfo(acc).bits // 8
    plan = _Rows(q, k, topk, bs, cu_q, cu_kv, (Dqk + Dv + 2 * G + 2) * elt)
    kf, vf = k.reshape(-1, Dqk).to(acc), v.reshape(-1, Dv).to(acc)
    qa = torch.mul(q.to(acc), scale).contiguous()
    BK = plan.C * N2 * plan.KB
    buf = _Buffers(dev, acc, k=BK * Dqk, v=BK * Dv, x=BK * G, o=plan.C * N1 * Dv)
    big = torch.finfo(acc).max
    for t0, t1, rows, vis in plan.work(topk, T1, causal):
        C, (B, n) = t1 - t0, rows.shape
        qs = qa[t0:t1].view(B, G, Dqk)
        ks = _gather(kf, rows, buf.take("k", B, n, Dqk))
        x = torch.bmm(qs, ks.transpose(1, 2), out=buf.take("x", B, G, n))
        x.clamp_(max=big).masked_fill_(~vis, _NEG_INF)
        mx = torch.amax(x, dim=-1, keepdim=True)
        mx.masked_fill_(mx == _NEG_INF, 0.0)
        x.sub_(mx).clamp_(exp_floor(acc), 80.0).exp_().mul_(vis)
        sm = x.sum(dim=-1, keepdim=True)
        o = torch.bmm(x, _gather(vf, rows, buf.take("v", B, n, Dv)), out=buf.take("o", B, G, Dv))
        o.mul_(torch.where(sm > 0, 1.0 / sm, 0.0))
        out[t0:t1] = o.view(C, N1, Dv)
        m[t0:t1], l[t0:t1] = mx.view(C, N1), sm.view(C, N1)
    return out, m, l


def _accumulate(flat, rows, src, deterministic):
    """``flat[rows[i]] += src[i]``: ``index_add_`` (in index order on the CPU), ``index_put_(accumulate=True)``
    for a deterministic CUDA call."""
    if deterministic and flat.device.type != "cpu":
        flat.index_put_((rows,), src, accumulate=True)
    else:
        flat.index_add_(0, rows, src)


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    """``(dq, dk, dv)`` in the dtypes of q, k, v, from the forward's ``out`` and stats ``m``, ``l`` ``[T1, N1]``."""
    acc = acc_dtype(q)
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G = N1 // N2
    dev = q.device
    dq = torch.zeros(q.shape, dtype=q.dtype, device=dev)
    if T1 == 0 or k.shape[0] == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    elt = torch.finfo(acc).bits // 8
    plan = _Rows(q, k, topk, bs, cu_q, cu_kv, (2 * (Dqk + Dv) + 3 * G + 2) * elt)
    kf, vf = k.reshape(-1, Dqk).to(acc), v.reshape(-1, Dv).to(acc)
    qa = torch.mul(q.to(acc), scale).contiguous()
    dkf = torch.zeros(kf.shape, dtype=acc, device=dev)
    dvf = torch.zeros(vf.shape, dtype=acc, device=dev)
    dyf = dout.to(acc)
    # D = rowsum(dO * O) [T1, N1], the softmax backward's correction, for every row at once
    delta = row_dot(dout, out, acc)
    # P = exp(S - m) / l = exp(S - (m + log l)): one pass fewer per chunk (a row with l = 0 sees no key: vis = 0)
    lse = torch.where(l > 0, m.to(acc) + torch.log(l.to(acc)), 0.0)
    BK = plan.C * N2 * plan.KB
    buf = _Buffers(dev, acc, k=BK * Dqk, v=BK * Dv, p=BK * G, ds=BK * G,
                   dq=plan.C * N1 * Dqk, dk=BK * Dqk, dv=BK * Dv)
    for t0, t1, rows, vis in plan.work(topk, T1, causal):
        C, (B, n) = t1 - t0, rows.shape
        ks, vs = _gather(kf, rows, buf.take("k", B, n, Dqk)), _gather(vf, rows, buf.take("v", B, n, Dv))
        qs = qa[t0:t1].view(B, G, Dqk)
        p = torch.bmm(qs, ks.transpose(1, 2), out=buf.take("p", B, G, n))
        p.sub_(lse[t0:t1].reshape(B, G, 1)).clamp_(exp_floor(acc), 80.0).exp_().mul_(vis)
        dy = dyf[t0:t1].reshape(B, G, Dv)
        ds = torch.bmm(dy, vs.transpose(1, 2), out=buf.take("ds", B, G, n))
        ds.sub_(delta[t0:t1].reshape(B, G, 1)).mul_(p)
        dqc = torch.bmm(ds, ks, out=buf.take("dq", B, G, Dqk)).mul_(scale)
        dq[t0:t1] = dqc.view(C, N1, Dqk)
        flat_rows = rows.reshape(-1)
        # dK = scale * dS^T Q; qs holds scale * Q already
        dkc = torch.bmm(ds.transpose(1, 2), qs, out=buf.take("dk", B, n, Dqk))
        _accumulate(dkf, flat_rows, dkc.view(-1, Dqk), deterministic)
        dvc = torch.bmm(p.transpose(1, 2), dy, out=buf.take("dv", B, n, Dv))
        _accumulate(dvf, flat_rows, dvc.view(-1, Dv), deterministic)
    return dq, dkf.view(k.shape).to(k.dtype), dvf.view(v.shape).to(v.dtype)
