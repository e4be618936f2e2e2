"""The NSA torch path at token granularity (``selected_block_size`` 1, 2, 4 or 8): a per-query gather (docs/nsa.md).

Arguments arrive validated (docs/internals.md). Blocks this small make the block tiles of :mod:`.torch_plan` all
padding, so each query token instead gathers its own ``K * bs`` keys and values (one row per KV head) and every
product is one batched matmul over the chunk's (token, KV head) rows: ``[G, Dqk] x [Dqk, K*bs]`` for the scores,
``[G, K*bs] x [K*bs, Dv]`` for ``P V``. Tokens run in chunks sized by :data:`CHUNK_BYTES`, so memory is
``O(chunk * K * bs)`` above the inputs, never ``O(T^2)``.

The backward adds the gathered rows' dK / dV into the key rows with ``index_add_`` in chunk order (the CPU adds
in index order: bitwise repeatable); on CUDA the deterministic path uses ``index_put_(accumulate=True)``, which
sorts the destinations and adds each one's contributions in a fixed order. An invisible gathered key points at
row 0 with weight 0, so it adds an exact 0 there.
"""

from __future__ import annotations

import torch

from .._varlen import token_seq_positions

#: bytes of one chunk's work tensors (gathered keys and values, scores and their gradients)
CHUNK_BYTES = 64 * 2**20

_NEG_INF = float("-inf")


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _exp_floor(acc: torch.dtype) -> float:
    # exp() below ~-87.3 is an fp32 denormal or 0 (a slow path on x86); e^-80 is negligible next to the max term
    return -80.0 if acc == torch.float32 else -700.0


class _Rows:
    """Per call: each token's key start, sequence length and in-sequence position, and the chunk size."""

    def __init__(self, q, k, v, topk, bs, cu_q, cu_kv, per_key_bytes):
        T1 = q.shape[0]
        dev = q.device
        seq, self.pos = token_seq_positions(cu_q, device=dev)
        starts = torch.tensor(cu_kv[:-1], dtype=torch.int64, device=dev)
        lens = torch.tensor([b - a for a, b in zip(cu_kv[:-1], cu_kv[1:])], dtype=torch.int64, device=dev)
        self.kv_start, self.S2 = starts[seq], lens[seq]
        self.N2, self.bs, self.K = k.shape[1], bs, topk.shape[2]
        self.KB = self.K * bs
        self.r = torch.arange(bs, dtype=torch.int64, device=dev)
        self.n2 = torch.arange(self.N2, dtype=torch.int64, device=dev)
        per_token = self.N2 * self.KB * per_key_bytes
        self.C = max(1, min(T1, CHUNK_BYTES // max(1, per_token)))

    def chunks(self, T1):
        return ((t0, min(T1, t0 + self.C)) for t0 in range(0, T1, self.C))

    def gather_index(self, topk, t0, t1, causal):
        """``(rows [C, N2, n]`` int64 rows of the flattened ``[T2 * N2, D]`` keys (0 where invisible),
        ``vis [C, N2, n]`` bool), ``n <= KB`` the gathered keys up to the last one some row of the chunk sees."""
        C = t1 - t0
        idx = topk[t0:t1].to(torch.int64)
        p = (idx[..., None] * self.bs + self.r).view(C, self.N2, self.KB)
        vis = (idx != -1).repeat_interleave(self.bs, dim=-1) & (p < self.S2[t0:t1, None, None])
        if causal:
            vis &= p <= self.pos[t0:t1, None, None]
        rows = (self.kv_start[t0:t1, None, None] + p) * self.N2 + self.n2[:, None]
        # trailing gathered keys that no row of the chunk sees (the -1 tail of an indexer's sorted selection,
        # causal rows shorter than K) are dropped: they would only add exact zeros
        seen = vis.reshape(-1, self.KB).any(dim=0)
        n = int(seen.nonzero().max()) + 1 if bool(seen.any()) else 1
        return torch.where(vis, rows, 0)[..., :n].contiguous(), vis[..., :n].contiguous()


def _gather(flat, rows, acc):
    """``flat[rows]`` as ``[C * N2, KB, D]`` in ``acc``."""
    C, N2, KB = rows.shape
    return flat.index_select(0, rows.view(-1)).view(C * N2, KB, -1).to(acc)


def _scores(q, ks, t0, t1, N2, scale, acc):
    """``scale * q k^T`` ``[C * N2, G, KB]`` and the chunk's scaled queries ``[C * N2, G, Dqk]``."""
    C, N1, Dqk = t1 - t0, q.shape[1], q.shape[2]
    qs = q[t0:t1].to(acc).mul(scale).reshape(C * N2, N1 // N2, Dqk)
    return torch.bmm(qs, ks.transpose(1, 2)), qs


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    """``(out [T1, N1, Dv]`` in q's dtype, ``m [T1, N1]``, ``l [T1, N1])`` (fp32, float64 for float64)."""
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    out = torch.zeros(T1, N1, Dv, dtype=q.dtype, device=q.device)
    m = torch.zeros(T1, N1, dtype=acc, device=q.device)
    l = torch.zeros(T1, N1, dtype=acc, device=q.device)
    if T1 == 0 or k.shape[0] == 0:
        return out, m, l
    elt = torch.finfo(acc).bits // 8
    plan = _Rows(q, k, v, topk, bs, cu_q, cu_kv, (Dqk + Dv + 2 * (N1 // N2) + 2) * elt)
    kf, vf = k.reshape(-1, Dqk), v.reshape(-1, Dv)
    for t0, t1 in plan.chunks(T1):
        C = t1 - t0
        rows, vis = plan.gather_index(topk, t0, t1, causal)
        x, _ = _scores(q, _gather(kf, rows, acc), t0, t1, N2, scale, acc)
        w = vis.view(C * N2, 1, vis.shape[-1]).to(acc)
        x.clamp_(max=torch.finfo(acc).max).add_(torch.where(w == 0, _NEG_INF, 0.0))
        mx = torch.amax(x, dim=-1, keepdim=True)
        mx.masked_fill_(mx == _NEG_INF, 0.0)
        x.sub_(mx).clamp_(_exp_floor(acc), 80.0).exp_().mul_(w)
        sm = x.sum(dim=-1, keepdim=True)
        o = torch.bmm(x, _gather(vf, rows, acc)).mul_(torch.where(sm > 0, 1.0 / sm, 0.0))
        out[t0:t1] = o.view(C, N1, Dv).to(q.dtype)
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
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G = N1 // N2
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if T1 == 0 or k.shape[0] == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    elt = torch.finfo(acc).bits // 8
    plan = _Rows(q, k, v, topk, bs, cu_q, cu_kv, (2 * (Dqk + Dv) + 3 * G + 2) * elt)
    kf, vf = k.reshape(-1, Dqk), v.reshape(-1, Dv)
    dkf = torch.zeros(kf.shape, dtype=acc, device=q.device)
    dvf = torch.zeros(vf.shape, dtype=acc, device=q.device)
    for t0, t1 in plan.chunks(T1):
        C = t1 - t0
        rows, vis = plan.gather_index(topk, t0, t1, causal)
        ks, vs = _gather(kf, rows, acc), _gather(vf, rows, acc)
        p, qs = _scores(q, ks, t0, t1, N2, scale, acc)
        mc = m[t0:t1].to(acc).reshape(C * N2, G, 1)
        lc = l[t0:t1].to(acc).reshape(C * N2, G, 1)
        p.sub_(mc).clamp_(_exp_floor(acc), 80.0).exp_()
        p.mul_(vis.view(C * N2, 1, vis.shape[-1]).to(acc)).mul_(torch.where(lc > 0, 1.0 / lc, 0.0))
        dy = dout[t0:t1].to(acc).reshape(C * N2, G, Dv)
        d = (dy * out[t0:t1].to(acc).reshape(C * N2, G, Dv)).sum(dim=-1, keepdim=True)
        ds = torch.bmm(dy, vs.transpose(1, 2)).sub_(d).mul_(p)
        dq[t0:t1] = torch.bmm(ds, ks).mul_(scale).view(C, N1, Dqk).to(q.dtype)
        flat_rows = rows.view(-1)
        # dK = scale * dS^T Q; qs holds scale * Q already
        _accumulate(dkf, flat_rows, torch.bmm(ds.transpose(1, 2), qs).view(-1, Dqk), deterministic)
        _accumulate(dvf, flat_rows, torch.bmm(p.transpose(1, 2), dy).view(-1, Dv), deterministic)
    return dq, dkf.view(k.shape).to(k.dtype), dvf.view(v.shape).to(v.dtype)
