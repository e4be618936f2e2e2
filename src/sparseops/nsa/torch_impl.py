"""Vectorized PyTorch NSA selected attention (spec/nsa.md §2-§4): the CPU path and the fallback everywhere.

Arguments are already validated (docs/internals.md). Tokens are processed in chunks sized by a memory budget;
inside a chunk everything is batched, with no Python loop over tokens:

1. keys and values are copied once per call into a *block buffer* ``[N2 * NB, BS, D]`` (``NB`` = the blocks of
   all sequences, each sequence's last block zero-padded), so a selected block is one contiguous row of the
   buffer and ``topk`` ids turn into buffer rows with one add;
2. per chunk, the slots that can see nothing (``-1``, or causal blocks that start after the query) are moved
   to the end of each row and the chunk keeps only ``Kc`` = the largest count of live slots;
3. each chunk runs in a *per token* layout (batch = token x KV head, rows = its G heads, keys = its live
   blocks) or a *union* layout (batch = KV head, rows = G heads x the chunk's tokens, keys = every block the
   chunk selected, masked per token), whichever computes less (see :meth:`_Plan.chunk`); either way the
   blocks are gathered once per chunk with a row gather and the products are batched matmuls;
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
#: a chunk uses the union layout when it computes at most this many times the keys its tokens can see
UNION_WASTE = 2.0


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
        key_row = torch.tensor(blk_base, dtype=torch.int64)[kseq] * bs + kpos
        # [N2 * T2]: rows of the 2-D buffer [N2 * NB * BS, D] for k.transpose(0, 1) flattened
        self.key_row = (torch.arange(self.N2)[:, None] * (self.NB * bs) + key_row[None, :]).reshape(-1).to(dev)
        self.topk = topk.to(dev, torch.int64)

    def to_blocks(self, x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """``[T2, N2, D]`` -> block buffer ``[N2 * NB, BS, D]`` in ``acc`` (zero padding past each sequence)."""
        D = x.shape[2]
        buf = x.new_zeros((self.N2 * self.NB * self.bs, D), dtype=acc)
        buf.index_copy_(0, self.key_row, x.transpose(0, 1).reshape(-1, D).to(acc))
        return buf.view(self.N2 * self.NB, self.bs, D)

    def from_blocks(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`to_blocks`: ``[N2 * NB, BS, D]`` -> ``[T2, N2, D]`` in ``dtype``."""
        D = buf.shape[2]
        rows = torch.nn.functional.embedding(self.key_row, buf.view(-1, D))
        return rows.view(self.N2, self.T2, D).transpose(0, 1).to(dtype).contiguous()

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
        """The work of tokens ``[t0, t1)`` as a :class:`_Job`, or None when no token of them sees a key.

        Two layouts, picked by the compute they cost: *per token* (batch = token x KV head, the G heads as rows,
        that token's live blocks gathered: no wasted keys, but small matmuls and a gather per token) and *union*
        (batch = KV head, rows = G heads x the chunk's tokens, keys = every block some token of the chunk
        selected, gathered once: large matmuls, masked where a token did not pick the block). Union is used when
        it computes at most :data:`UNION_WASTE` times the live slots' keys."""
        C, N2, bs = t1 - t0, self.N2, self.bs
        blk = self.topk[t0:t1]
        live = self._live_slots(t0, t1)
        n_live = live.sum(-1)
        kc = int(n_live.max()) if C else 0
        if kc == 0:
            return None
        # union of live blocks per KV head, as indices into that head's [NB] blocks
        gblk = torch.where(live, self.base[t0:t1, None, None] + blk, 0)
        mark = torch.zeros(N2, self.NB, dtype=torch.bool, device=blk.device)
        head = torch.arange(N2, device=blk.device)[None, :, None].expand_as(gblk)
        mark[head[live], gblk[live]] = True
        U = int(mark.sum(-1).max())
        if U * C * N2 <= UNION_WASTE * int(n_live.sum()):
            return self._union_job(t0, t1, live, gblk, mark, U)
        if kc < self.K or not bool(live.all()):
            order = torch.sort(live.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :kc]
            blk = blk.gather(-1, order)
            live = live.gather(-1, order)
        # [C, N2, Kc, BS] in-sequence key positions
        p = blk[..., None] * bs + torch.arange(bs, device=blk.device)
        vis = live[..., None] & (p < self.s2[t0:t1, None, None, None])
        if self.causal:
            vis &= p <= self.s1[t0:t1, None, None, None]
        rows = torch.where(live, self.base[t0:t1, None, None] + blk, 0) + head[..., :kc] * self.NB
        return _Job(self, C, C * N2, 1, rows.reshape(-1), kc, vis.reshape(C * N2, 1, 1, kc * bs), None)

    def _union_job(self, t0, t1, live, gblk, mark, U):
        C, N2, bs = t1 - t0, self.N2, self.bs
        dev = gblk.device
        # [N2, U]: the selected blocks first, ascending (a stable sort of the marks), padded with unselected ones
        ublk = torch.sort(mark.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :U]
        where_u = torch.cumsum(mark, dim=-1) - 1
        heads = torch.arange(N2, device=dev)
        # [C, N2, U]: how many live slots of the token pick each union block (a duplicate id counts twice)
        uidx = where_u[heads[None, :, None], gblk]
        cnt = torch.zeros(C, N2, U, dtype=torch.int64, device=dev)
        cnt.scatter_add_(2, torch.where(live, uidx, 0), live.to(torch.int64))
        # [C, N2, U, BS] in-sequence position of each key for each token (meaningful where cnt > 0)
        p = (ublk[None] - self.base[t0:t1, None, None])[..., None] * bs + torch.arange(bs, device=dev)
        vis = (cnt > 0)[..., None] & (p < self.s2[t0:t1, None, None, None])
        if self.causal:
            vis &= p <= self.s1[t0:t1, None, None, None]
        mult = None
        if bool((cnt > 1).any()):
            mult = (cnt[..., None] * vis).permute(1, 0, 2, 3).reshape(N2, 1, C, U * bs)
        rows = (ublk + heads[:, None] * self.NB).reshape(-1)
        return _Job(self, C, N2, C, rows, U, vis.permute(1, 0, 2, 3).reshape(N2, 1, C, U * bs), mult)


class _Job:
    """One chunk's work: ``BB`` batches of ``G*R`` query rows against ``nblk*BS`` gathered keys.

    ``rows``: block-buffer rows to gather, ``[BB * nblk]``; ``vis``: ``[BB, 1, R, KB]`` key visibility;
    ``mult``: ``[BB, 1, R, KB]`` key multiplicity (union layout with repeated ids) or None."""

    def __init__(self, plan, C, BB, R, rows, nblk, vis, mult):
        self.plan, self.C, self.BB, self.R, self.rows, self.nblk = plan, C, BB, R, rows, nblk
        self.KB = nblk * plan.bs
        self.vis, self.mult = vis, mult

    def to_rows(self, x):
        """``[C, N1, F]`` -> ``[BB, G*R, F]``."""
        C, N2, G, F = self.C, self.plan.N2, self.plan.G, x.shape[-1]
        if self.R == 1:
            return x.reshape(self.BB, G, F)
        return x.reshape(C, N2, G, F).permute(1, 2, 0, 3).reshape(N2, G * C, F)

    def from_rows(self, y):
        """``[BB, G*R, F]`` -> ``[C, N1, F]``."""
        C, N2, G, F = self.C, self.plan.N2, self.plan.G, y.shape[-1]
        if self.R == 1:
            return y.reshape(C, N2 * G, F)
        return y.reshape(N2, G, C, F).permute(2, 0, 1, 3).reshape(C, N2 * G, F)

    def gather(self, buf):
        # a row gather on the 2-D view copies whole blocks (a 3-D index_select goes element by element on CPU)
        flat = torch.nn.functional.embedding(self.rows, buf.view(buf.shape[0], -1))
        return flat.view(self.BB, self.KB, buf.shape[-1])

    def scores(self, qs, ks):
        """``[BB, G*R, KB]``: ``qs.k`` (``qs`` = the scaled queries) with -inf on invisible keys."""
        bias = torch.zeros(self.vis.shape, dtype=qs.dtype, device=qs.device).masked_fill_(~self.vis, float("-inf"))
        if self.R == 1:
            return torch.baddbmm(bias.view(self.BB, 1, self.KB), qs, ks.transpose(1, 2))
        x = torch.bmm(qs, ks.transpose(1, 2))
        x.view(self.BB, self.plan.G, self.R, self.KB).add_(bias)
        return x

    def weigh(self, e):
        """Apply key multiplicities to ``exp`` values (in place)."""
        if self.mult is not None:
            e.view(self.BB, self.plan.G, self.R, self.KB).mul_(self.mult.to(e.dtype))
        return e


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = _Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    out = torch.zeros(T1, N1, Dv, dtype=q.dtype, device=q.device)
    m = torch.zeros(T1, N1, dtype=acc, device=q.device)
    l = torch.zeros(T1, N1, dtype=acc, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return out, m, l
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    elt = torch.finfo(acc).bits // 8
    for t0, t1 in plan.chunks((Dqk + Dv) * elt):
        job = plan.chunk(t0, t1)
        if job is None:
            continue
        ks, vs = job.gather(kb), job.gather(vb)
        # [BB, G*R, KB]
        x = job.scores(job.to_rows(q[t0:t1].to(acc) * scale), ks)
        mx = x.amax(dim=-1, keepdim=True)
        mx = torch.where(mx == float("-inf"), 0.0, mx)
        job.weigh(x.sub_(mx).exp_())
        sm = x.sum(dim=-1, keepdim=True)
        inv = torch.where(sm > 0, 1.0 / sm, 0.0)
        out[t0:t1] = job.from_rows(torch.bmm(x, vs).mul_(inv)).to(q.dtype)
        m[t0:t1] = job.from_rows(mx)[..., 0]
        l[t0:t1] = job.from_rows(sm)[..., 0]
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
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    dkb = torch.zeros_like(kb)
    dvb = torch.zeros_like(vb)
    elt = torch.finfo(acc).bits // 8
    for t0, t1 in plan.chunks((Dqk + Dv) * elt * 2):
        job = plan.chunk(t0, t1)
        if job is None:
            continue
        ks, vs = job.gather(kb), job.gather(vb)
        qs = job.to_rows(q[t0:t1].to(acc) * scale)
        dy = job.to_rows(dout[t0:t1].to(acc))
        o = job.to_rows(out[t0:t1].to(acc))
        mc = job.to_rows(m[t0:t1, :, None].to(acc))
        lc = job.to_rows(l[t0:t1, :, None].to(acc))
        inv = torch.where(lc > 0, 1.0 / lc, 0.0)
        # [BB, G*R, KB]: P recomputed from the given stats, 0 on invisible keys
        p = job.weigh(job.scores(qs, ks).sub_(mc).exp_()).mul_(inv)
        # [BB, KB, Dv]
        dvs = torch.bmm(p.transpose(1, 2), dy)
        # [BB, G*R, KB]: dS = P * (dP - rowsum(dY * O))
        ds = torch.bmm(dy, vs.transpose(1, 2))
        ds.sub_((dy * o).sum(dim=-1, keepdim=True)).mul_(p)
        dq[t0:t1] = job.from_rows(torch.bmm(ds, ks).mul_(scale)).to(q.dtype)
        # [BB, KB, Dqk]
        dks = torch.bmm(ds.transpose(1, 2), qs)
        _accumulate(dkb, job.rows, dks.view(-1, bs, Dqk), deterministic)
        _accumulate(dvb, job.rows, dvs.view(-1, bs, Dv), deterministic)
    return dq, plan.from_blocks(dkb, k.dtype), plan.from_blocks(dvb, v.dtype)
