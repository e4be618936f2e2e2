"""Vectorized PyTorch NSA selected attention (spec/nsa.md §2-§4): the CPU path and the fallback everywhere.

Arguments are already validated (docs/internals.md). Tokens are processed in chunks sized by a memory budget;
inside a chunk everything is batched, with no Python loop over tokens:

1. keys and values are copied once per call into a *block buffer* ``[N2 * NB, BS, D]`` (``NB`` = the blocks of
   all sequences, each sequence's last block zero-padded), so a selected block is one contiguous row of the
   buffer and ``topk`` ids turn into buffer rows with one add;
2. per chunk, the slots that can see nothing (``-1``, or causal blocks that start after the query) are moved
   to the end of each row and the chunk keeps only ``Kc`` = the largest count of live slots;
3. the live blocks are gathered with one ``index_select`` each for K and V into ``[C*N2, Kc*BS, D]`` and the
   ``G`` query heads of a KV head become the rows of batched matmuls over ``C*N2``;
4. the masked softmax fills invisible keys with ``-inf``, a row with no visible key gives ``out = 0``,
   ``m = 0``, ``l = 0`` (no NaN);
5. the backward adds ``dK_sel`` / ``dV_sel`` blockwise into ``dk`` / ``dv`` in the block buffer layout
   (``index_add_`` over whole blocks; chunks in order), then scatters the buffer back to ``[T2, N2, D]``.

Math is fp32 (float64 for float64 inputs); each output is rounded once to its input's dtype.
"""

from __future__ import annotations

import torch

#: bytes of gathered K and V per chunk (the backward holds about twice that again for dK_sel, dV_sel)
CHUNK_BYTES = 32 * 2**20


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


class _Plan:
    """Per-call index tensors shared by the forward and the backward."""

    def __init__(self, q, k, topk, bs, cu_q, cu_kv, causal):
        dev = q.device
        self.T1, self.N1 = q.shape[0], q.shape[1]
        self.T2, self.N2 = k.shape[0], k.shape[1]
        self.G = self.N1 // self.N2
        self.K = topk.shape[2]
        self.bs = bs
        self.causal = causal
        B = len(cu_q) - 1
        lens_q = torch.tensor([cu_q[b + 1] - cu_q[b] for b in range(B)], dtype=torch.int64)
        lens_kv = [cu_kv[b + 1] - cu_kv[b] for b in range(B)]
        nblk = [-(-s // bs) for s in lens_kv]
        blk_base = [0] * B
        for b in range(1, B):
            blk_base[b] = blk_base[b - 1] + nblk[b - 1]
        self.NB = sum(nblk)
        # per query token: its sequence's key count, first block in the buffer, and its in-sequence position
        seq = torch.repeat_interleave(torch.arange(B), lens_q, output_size=self.T1)
        pos = torch.arange(self.T1) - torch.tensor(cu_q[:-1], dtype=torch.int64)[seq]
        self.s2 = torch.tensor(lens_kv, dtype=torch.int64)[seq].to(dev)
        self.base = torch.tensor(blk_base, dtype=torch.int64)[seq].to(dev)
        self.s1 = pos.to(dev)
        # per key row: its row in the flattened block buffer [NB * BS]
        kv_lens = torch.tensor(lens_kv, dtype=torch.int64)
        kseq = torch.repeat_interleave(torch.arange(B), kv_lens, output_size=self.T2)
        kpos = torch.arange(self.T2) - torch.tensor(cu_kv[:-1], dtype=torch.int64)[kseq]
        self.key_row = (torch.tensor(blk_base, dtype=torch.int64)[kseq] * bs + kpos).to(dev)
        self.topk = topk.to(dev, torch.int64)

    def to_blocks(self, x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """``[T2, N2, D]`` -> block buffer ``[N2 * NB, BS, D]`` in ``acc`` (zero padding past each sequence)."""
        D = x.shape[2]
        buf = x.new_zeros((self.N2, self.NB * self.bs, D), dtype=acc)
        buf.index_copy_(1, self.key_row, x.transpose(0, 1).to(acc))
        return buf.view(self.N2 * self.NB, self.bs, D)

    def from_blocks(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`to_blocks`: ``[N2 * NB, BS, D]`` -> ``[T2, N2, D]`` in ``dtype``."""
        D = buf.shape[2]
        rows = buf.view(self.N2, self.NB * self.bs, D).index_select(1, self.key_row)
        return rows.transpose(0, 1).to(dtype).contiguous()

    def chunks(self, bytes_per_key: int):
        """Token ranges whose gathered K/V stay within :data:`CHUNK_BYTES`, sized by the live-slot count."""
        live = self._live_slots(0, self.T1)
        kmax = int(live.sum(-1).max()) if self.T1 else 0
        per_token = max(1, self.N2 * max(kmax, 1) * self.bs * bytes_per_key)
        C = max(1, CHUNK_BYTES // per_token)
        return [(t0, min(self.T1, t0 + C)) for t0 in range(0, self.T1, C)]

    def _live_slots(self, t0, t1):
        """``[C, N2, K]``: the slot's block can hold a visible key (the per-key mask refines this)."""
        blk = self.topk[t0:t1]
        live = (blk >= 0) & (blk * self.bs < self.s2[t0:t1, None, None])
        if self.causal:
            live &= blk * self.bs <= self.s1[t0:t1, None, None]
        return live

    def chunk(self, t0, t1):
        """Buffer rows ``[C*N2*Kc]`` of the live blocks and the key mask ``[C*N2, 1, Kc*BS]``; None if none."""
        C, N2, bs = t1 - t0, self.N2, self.bs
        blk = self.topk[t0:t1]
        live = self._live_slots(t0, t1)
        kc = int(live.sum(-1).max()) if C else 0
        if kc == 0:
            return None
        if kc < self.K or not bool(live.all()):
            order = torch.sort(live.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :kc]
            blk = blk.gather(-1, order)
            live = live.gather(-1, order)
        # [C, N2, Kc, BS] in-sequence key positions
        p = blk[..., None] * bs + torch.arange(bs, device=blk.device)
        vis = live[..., None] & (p < self.s2[t0:t1, None, None, None])
        if self.causal:
            vis &= p <= self.s1[t0:t1, None, None, None]
        head = torch.arange(N2, device=blk.device)[None, :, None] * self.NB
        rows = torch.where(live, self.base[t0:t1, None, None] + blk, 0) + head
        return rows.reshape(-1), vis.reshape(C * N2, 1, kc * bs), kc


def _mask_bias(vis: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[BN, 1, KB]``: 0 on visible keys, -inf elsewhere, added by the score matmul itself."""
    return torch.zeros(vis.shape, dtype=acc, device=vis.device).masked_fill_(~vis, float("-inf"))


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = _Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    N2, G = plan.N2, plan.G
    out = torch.zeros(T1, N1, Dv, dtype=q.dtype, device=q.device)
    m = torch.zeros(T1, N1, dtype=acc, device=q.device)
    l = torch.zeros(T1, N1, dtype=acc, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return out, m, l
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    elt = torch.finfo(acc).bits // 8
    for t0, t1 in plan.chunks((Dqk + Dv) * elt):
        ch = plan.chunk(t0, t1)
        if ch is None:
            continue
        rows, vis, kc = ch
        BN = (t1 - t0) * N2
        ks = kb.index_select(0, rows).view(BN, kc * bs, Dqk)
        vs = vb.index_select(0, rows).view(BN, kc * bs, Dv)
        qc = q[t0:t1].to(acc).reshape(BN, G, Dqk)
        # [BN, G, Kc*BS]
        x = torch.baddbmm(_mask_bias(vis, acc), qc, ks.transpose(1, 2), alpha=scale)
        mx = x.amax(dim=-1, keepdim=True)
        mx = torch.where(mx == float("-inf"), 0.0, mx)
        x.sub_(mx).exp_()
        sm = x.sum(dim=-1, keepdim=True)
        inv = torch.where(sm > 0, 1.0 / sm, 0.0)
        o = torch.bmm(x, vs).mul_(inv)
        out[t0:t1] = o.view(t1 - t0, N1, Dv).to(q.dtype)
        m[t0:t1] = mx.view(t1 - t0, N1)
        l[t0:t1] = sm.view(t1 - t0, N1)
    return out, m, l


def _accumulate(buf, rows, src, deterministic):
    """``buf[rows[i]] += src[i]`` over whole blocks. CPU ``index_add_`` adds in index order (reproducible);
    on CUDA the deterministic path uses ``index_put_(accumulate=True)``, which sorts the destinations and adds
    each one's contributions in a fixed order."""
    flat = buf.view(buf.shape[0], -1)
    src = src.reshape(src.shape[0], -1)
    if deterministic and buf.device.type != "cpu":
        flat.index_put_((rows,), src, accumulate=True)
    else:
        flat.index_add_(0, rows, src)


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = _Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    N2, G = plan.N2, plan.G
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    dkb = torch.zeros_like(kb)
    dvb = torch.zeros_like(vb)
    elt = torch.finfo(acc).bits // 8
    for t0, t1 in plan.chunks((Dqk + Dv) * elt * 2):
        ch = plan.chunk(t0, t1)
        if ch is None:
            continue
        rows, vis, kc = ch
        C = t1 - t0
        BN, KB = C * N2, kc * bs
        ks = kb.index_select(0, rows).view(BN, KB, Dqk)
        vs = vb.index_select(0, rows).view(BN, KB, Dv)
        qc = q[t0:t1].to(acc).reshape(BN, G, Dqk)
        dy = dout[t0:t1].to(acc).reshape(BN, G, Dv)
        o = out[t0:t1].to(acc).reshape(BN, G, Dv)
        mc = m[t0:t1].to(acc).reshape(BN, G, 1)
        lc = l[t0:t1].to(acc).reshape(BN, G, 1)
        inv = torch.where(lc > 0, 1.0 / lc, 0.0)
        # [BN, G, KB]: P recomputed from the given stats, 0 on invisible keys
        p = torch.baddbmm(_mask_bias(vis, acc), qc, ks.transpose(1, 2), alpha=scale)
        p.sub_(mc).exp_().mul_(inv)
        # [BN, KB, Dv]
        dvs = torch.bmm(p.transpose(1, 2), dy)
        # [BN, G, KB]: dS = P * (dP - rowsum(dY * O))
        ds = torch.bmm(dy, vs.transpose(1, 2))
        ds.sub_((dy * o).sum(dim=-1, keepdim=True)).mul_(p)
        dq[t0:t1] = torch.bmm(ds, ks).mul_(scale).view(C, N1, Dqk).to(q.dtype)
        # [BN, KB, Dqk]
        dks = torch.baddbmm(qc.new_empty(()), ds.transpose(1, 2), qc, beta=0.0, alpha=scale)
        _accumulate(dkb, rows, dks.view(-1, bs, Dqk), deterministic)
        _accumulate(dvb, rows, dvs.view(-1, bs, Dv), deterministic)
    return dq, plan.from_blocks(dkb, k.dtype), plan.from_blocks(dvb, v.dtype)
