"""Vectorized PyTorch NSA selected attention (spec/nsa.md §2-§4): the CPU path and the fallback everywhere.

Arguments are already validated (docs/internals.md). Tokens are processed in chunks sized by a memory budget;
inside a chunk everything is batched, with no Python loop over tokens:

1. keys and values are copied once per call into a *block buffer* ``[N2 * NB, BS, D]`` (``NB`` = the blocks of
   all sequences, each sequence's last block zero-padded), so a selected block is one contiguous row of the
   buffer and ``topk`` ids turn into buffer rows with one add;
2. per chunk, the slots that can see nothing (``-1``, or causal blocks that start after the query) are dropped;
3. a chunk whose tokens pick overlapping blocks (it computes at most :data:`UNION_WASTE` times its live keys;
   a span at most :func:`_union_limit`) runs in the *union layout*: batch = KV head, rows = G heads x the
   chunk's tokens, keys = every block some token of the chunk selected, masked per token (large matmuls, some
   wasted keys, no per-slot copies), gathered, or taken as the *span* of buffer blocks from the first
   selected to the last, a strided view (no gather; the backward adds dK and dV into the buffer in place);
   every other chunk runs in the *block-centric layout*: the chunk's live slots are sorted by (KV head, block)
   and cut into *tiles* of ``M`` slots that share one block (the last tile of a block padded with empty rows);
   a tile's rows are the G query heads of its M tokens, so every product is one batched matmul over tiles:
   ``[M*G, Dqk] x [Dqk, BS]`` for the scores, ``[M*G, BS] x [BS, Dv]`` for ``P V``; ``dV`` and ``dK`` come
   out per tile and are added blockwise into the block buffer. On the CPU, chunks whose tiles would share
   little are tiled together, over all their tokens at once (*global tiles*, :data:`GLOBAL_FWD_SHARE`), and run
   in batches of tiles;
4. the softmax is split like flash-decoding: each slot row gives its max, ``sum exp`` and unnormalised
   ``P V``; a token combines its slots by a gather over its slot rows (fixed slot order: deterministic), the
   same way ``dQ`` sums its slots. A duplicated block id is two slots, so it counts twice;
5. exponents are clamped at -80 before ``exp`` and invisible keys are multiplied by 0 afterwards: ``exp`` of
   a number below -87 (an fp32 denormal or 0) takes a slow path on x86 CPUs, up to 100x slower;
6. a row with no visible key gives ``out = 0``, ``m = 0``, ``l = 0`` (no NaN).

Math is fp32 (float64 for float64 inputs); each output is rounded once to its input's dtype.
"""

from __future__ import annotations

import bisect

import torch

#: bytes of per-chunk work tensors (tiles, scores, per-slot products). Larger chunks make larger matmuls (more
#: tokens share a block in a tile) and fewer ops: 32 MiB measured 1.1-1.3x faster than 16 MiB at T >= 512 here.
#: Each work tensor stays below glibc's largest mmap threshold (32 MiB), so chunk tensors are recycled instead of
#: page-faulted in every time.
CHUNK_BYTES = 32 * 2**20
#: budget of one chunk's gathered K/V blocks (and, backward, their gradients), which CHUNK_BYTES does not count:
#: a chunk over it is split in halves. At G = 16 tiles share blocks and a chunk gathers 14-28 MiB (T = 8K,
#: growing slowly with T), left whole; with few tokens per block (G = 1, one query per sequence: a block per
#: slot) the gathers reached 20-28x CHUNK_BYTES
GATHER_BYTES = 4 * CHUNK_BYTES
#: slots per tile; None: chosen per chunk by :func:`_tile_size`
TILE = None
#: candidate tile sizes
TILES = (1, 2, 4, 8, 16, 32, 64)
#: a chunk uses the union layout when it computes at most this many times the keys its live slots see
#: (0: never)
UNION_WASTE = 2.0


#: the union layout may also take the buffer blocks ``[first, last)`` of the chunk's selection as one strided
#: view (a *span*: no gather, dK/dV added in place) when that computes at most :func:`_union_limit` times the
#: live keys, and (if the compact union also qualifies) at most ``1 + SPAN_SLACK / (G * tokens)`` times its
#: keys: the gather a span saves costs about as much as 30 / (G * tokens) of the compute per key (False: never)
SPAN = True
SPAN_SLACK = 32.0

#: on the CPU, the chunks that take block tiles may instead be tiled *globally*: all their slots sorted by block
#: at once, so a tile gathers its block for the slots of every such chunk (not of one chunk of 16-64 tokens), and
#: the tiles are run in batches of :data:`CHUNK_BYTES`. The forward then takes two passes (the row maxima, then
#: the probabilities and ``P V``, summed into the tokens' rows: its ``Q Kᵀ`` twice); the backward adds each
#: slot's dQ into its token's row. Taken where the tile chunks share blocks little, ``G *`` (live slots per
#: distinct (chunk, block)) below this (forward / backward), and the call shares at least twice as much. Measured
#: (one thread, N1 = 64, N2 = 4, K = 16, bs = 64; ``G * share`` of the forward's / backward's chunks): uniform
#: blocks at T = 4096 (85 / 45) forward 1.2x, backward 1.6x faster; T = 8192 (54 / 32) 1.3x, 2.2x; NSA-like
#: blocks shared by 4 neighbours at T = 8192 (97 / 97) forward 0.87x, backward even. 0: never; inf: always
GLOBAL_FWD_SHARE = 64.0
GLOBAL_BWD_SHARE = 96.0

_NEG_INF = float("-inf")
_TILES = "tiles"  # :meth:`_Plan.chunk`'s answer for a chunk that takes block tiles when asked not to build them


def _union_limit(G: int) -> float:
    """The waste a span union may have: :data:`UNION_WASTE`, raised for small G, whose tiles (few rows per
    block) are bound by the gather of a block per few rows, not by the matmul: measured on 2 cores at
    T = 4096-8192, K = 16, G = 1 ran 2.8-3.6x faster at 8 than at 2, G = 4 up to 1.15x at 4, G = 16 best at 2-3.
    The score tensors grow with it, but G = 1's peak memory still fell (480 -> 366 MiB at T = 4096)."""
    return max(UNION_WASTE, min(8.0, 16.0 / G))


# The score-matrix elementwise chains, in place. Shapes: ``x [A, G, R, KB]`` scores, ``w [A, 1, R, KB]`` key
# weight (0 invisible, else the multiplicity), ``m [A, G, R, 1]`` row max. The backward needs no -inf mask:
# its weight zeroes the invisible keys. (torch.compile of these chains was measured slower on this CPU: in
# place, inductor stores the probabilities twice and sums them in a second loop; into a fresh tensor, the
# fwd+bwd at T = 512 took 60 ms against 53 ms eager on 2 threads.)


def _mask_(x, w):
    """``x`` <- -inf where ``w == 0`` (the mask is built at ``w``'s size, 1/G of ``x``, and added: a
    ``masked_fill_`` with a mask broadcast over G measured 3-8x slower). Scores are first clamped to the
    largest finite value, so a finite key whose score overflowed to +inf gives -inf where it is masked, not
    NaN (NaN stays NaN)."""
    return x.clamp_(max=torch.finfo(x.dtype).max).add_(torch.where(w == 0, _NEG_INF, 0.0))


def _softmax_fwd(x, w, acc):
    """``(mx, sm)`` ``[A, G, R, 1]``: the max over visible keys (0 when none) and the row sum of ``x``, which
    becomes ``exp(clamp(x - mx)) * w``."""
    mx = torch.amax(_mask_(x, w), dim=-1, keepdim=True)
    mx.masked_fill_(mx == _NEG_INF, 0.0)
    x.sub_(mx).clamp_(_exp_floor(acc), 80.0).exp_().mul_(w)
    return mx, x.sum(dim=-1, keepdim=True)


def _probs(x, w, m, inv, acc, sum_out=None):
    """``x`` <- ``exp(clamp(x - m)) * w * inv`` (``w``, ``inv`` may be None: 1); its row sum into ``sum_out``."""
    x.sub_(m).clamp_(_exp_floor(acc), 80.0).exp_()
    if w is not None:
        x.mul_(w)
    if inv is not None:
        x.mul_(inv)
    if sum_out is not None:
        torch.sum(x, dim=-1, keepdim=True, out=sum_out)


def _masked_max(x, w, out):
    """``out`` = max over keys with ``w > 0`` (``-inf`` when none; ``w`` None: all keys); ``x`` keeps -inf on
    the others."""
    torch.amax(x if w is None else _mask_(x, w), dim=-1, keepdim=True, out=out)


def _dsoftmax(ds, d, p):
    """``ds`` <- ``(ds - d) * p``."""
    return ds.sub_(d).mul_(p)


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _exp_floor(acc: torch.dtype) -> float:
    # exp() of anything below ~-87.3 is a denormal or 0 in fp32 (slow); e^-80 is negligible next to the max term
    return -80.0 if acc == torch.float32 else -700.0


def _tile_size(cnt: torch.Tensor, G: int) -> int:
    """The tile size with the least estimated cost: padded rows, each tile also paying for a matmul call whose
    efficiency grows with its rows (about ``1 + 64 / rows``)."""
    if TILE is not None:
        return TILE
    best, best_m = None, 1
    for M in TILES:
        padded = int((-(-cnt // M)).sum()) * M
        cost = padded * (1.0 + 64.0 / (M * G))
        if best is None or cost < best:
            best, best_m = cost, M
    return best_m


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
        self.cu_q = cu_q
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

    def chunks(self, bytes_per_slot: int):
        """Token ranges whose live slots' work tensors stay within :data:`CHUNK_BYTES`."""
        live = self._live_slots(0, self.T1)
        kmax = int(live.sum(-1).max()) if self.T1 else 0
        per_token = max(1, self.N2 * max(kmax, 1) * bytes_per_slot)
        C = max(1, CHUNK_BYTES // per_token)
        return [(t0, min(self.T1, t0 + C)) for t0 in range(0, self.T1, C)]

    def jobs(self, bytes_per_slot: int, bytes_per_block: int, share: float = 0.0):
        """``(t0, t1, job)`` over :meth:`chunks`; a chunk whose gathered blocks (``bytes_per_block`` each: the
        K/V copies, and in the backward their gradients) would pass :data:`GATHER_BYTES` is split in halves
        until they fit or it is one token (few tokens sharing few blocks, e.g. G = 1 and one query per
        sequence, gather a block per slot). ``share`` (:data:`GLOBAL_FWD_SHARE` / :data:`GLOBAL_BWD_SHARE`):
        the chunks that take tiles may come last as one :class:`_GlobalTiles` (``(0, T1, job)``)."""
        # with a share limit on the CPU, the chunks that take tiles are set aside, then tiled globally (one
        # :class:`_GlobalTiles`) or, where that does not pay, one by one like the others
        defer = share > 0 and self.topk.device.type == "cpu"
        todo = [(t0, t1, defer) for t0, t1 in self.chunks(bytes_per_slot)[::-1]]
        tile_chunks = []
        while todo or tile_chunks:
            if not todo:
                job = self._global_tiles(tile_chunks, share)
                if job is not None:
                    yield 0, self.T1, job
                else:
                    todo = [(t0, t1, False) for t0, t1 in tile_chunks[::-1]]
                tile_chunks = []
                continue
            t0, t1, deferring = todo.pop()
            job = self.chunk(t0, t1, tiles=not deferring)
            if job is None:
                continue
            if job is _TILES:
                tile_chunks.append((t0, t1))
                continue
            if t1 - t0 > 1 and job.gathered * bytes_per_block > GATHER_BYTES:
                mid = (t0 + t1) // 2
                todo += [(mid, t1, deferring), (t0, mid, deferring)]
                continue
            yield t0, t1, job

    def _key_bound(self, tok):
        """Per query token: the key of buffer position ``blk * BS + j`` (in the token's sequence) is visible
        to it iff that position is below this bound, its sequence's first buffer key plus its key count (and,
        causal, plus its own position + 1, whichever is smaller)."""
        bound = self.s2[tok]
        if self.causal:
            bound = torch.minimum(bound, self.s1[tok] + 1)
        return bound + self.base[tok] * self.bs

    def _live_slots(self, t0, t1):
        """``[C, N2, K]``: the slot's block can hold a visible key (the per-key mask refines this)."""
        blk = self.topk[t0:t1]
        # blk < ceil(S2 / bs), not blk * bs < S2: (validate=False) an int64 id past 2**63 / bs would wrap negative
        live = (blk >= 0) & (blk < (self.s2[t0:t1, None, None] + self.bs - 1) // self.bs)
        if self.causal:
            live &= blk * self.bs <= self.s1[t0:t1, None, None]
        return live

    def chunk(self, t0, t1, tiles=True):
        """The work of tokens ``[t0, t1)``: a :class:`_UnionJob` when the union of their blocks costs at most
        :data:`UNION_WASTE` times their live keys (a span of the buffer, :data:`SPAN`: :func:`_union_limit`
        times), else their tiles as a :class:`_Job`; None when no token of them sees a key."""
        C, N2, bs, dev = t1 - t0, self.N2, self.bs, self.topk.device
        blk = self.topk[t0:t1]
        live = self._live_slots(t0, t1)
        kc = int(live.sum(-1).max()) if C else 0
        if kc == 0:
            return None
        if kc < self.K or not bool(live.all()):
            order = torch.sort(live.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :kc]
            blk = blk.gather(-1, order)
            live = live.gather(-1, order)
        # [C * N2 * Kc]: each slot's group (KV head x buffer block); dead slots sort last
        heads = torch.arange(N2, device=dev)[None, :, None]
        ngrp = N2 * self.NB
        key = torch.where(live, heads * self.NB + self.base[t0:t1, None, None] + blk, ngrp).reshape(-1)
        n = int(live.sum())  # live slots
        if UNION_WASTE > 0:
            mark = torch.zeros(ngrp + 1, dtype=torch.bool, device=dev)
            mark[key] = True
            mark = mark[:-1].view(N2, self.NB)
            U = int(mark.sum(-1).max())  # the compact union's blocks per KV head
            sel = mark.any(0).nonzero()
            first, last = int(sel[0]), int(sel[-1]) + 1  # the span's
            compact = U * C * N2 <= UNION_WASTE * n
            # a span also covers blocks that no token of the chunk selected: only within one sequence, never
            # the (0-weighted) blocks of sequences packed between the chunk's
            one_seq = bisect.bisect_right(self.cu_q, t0) == bisect.bisect_right(self.cu_q, t1 - 1)
            span = SPAN and one_seq and (last - first) * C * N2 <= _union_limit(self.G) * n and (
                not compact or last - first <= U * (1.0 + SPAN_SLACK / (self.G * C)))
            if span or compact:
                gblk = torch.where(live, self.base[t0:t1, None, None] + blk, 0)
                if span:
                    return self._union_job(t0, t1, live, gblk, mark, last - first, span=(first, last))
                return self._union_job(t0, t1, live, gblk, mark, U)
        if not tiles:
            return _TILES
        M, NT, slot_row, row_tok, tile_blk = self._tiles(key, n, kc)
        # [NT * M, BS] key visibility; padding rows see everything (their queries are 0, their dY is 0)
        tok = row_tok.clamp(max=C * N2 - 1) // N2 + t0
        kpos = (tile_blk.repeat_interleave(M) % self.NB)[:, None] * bs + torch.arange(bs, device=dev)
        vis = kpos < self._key_bound(tok)[:, None]
        vis |= (row_tok == C * N2)[:, None]
        return _Job(self, C, kc, M, NT, slot_row, row_tok, tile_blk, None if bool(vis.all()) else vis)

    def _tiles(self, key, n, kc):
        """Block tiles of ``n`` live slots: ``key [R * kc]`` is each slot's group (KV head x buffer block; dead:
        ``N2 * NB``) for R token x KV head rows of ``kc`` slots. Returns the tile size ``M``, the tile count
        ``NT``, ``slot_row [R * kc]`` (each slot's tile row; dead: the extra row ``NT * M``), ``row_tok
        [NT * M]`` (each tile row's token x KV head row; padding: the extra row ``R``) and ``tile_blk [NT]``
        (the block buffer row of each tile)."""
        dev, ngrp, R = key.device, self.N2 * self.NB, key.numel() // kc
        skey, order = torch.sort(key, stable=True)
        skey, order = skey[:n], order[:n]
        cnt = torch.bincount(skey, minlength=ngrp)
        M = _tile_size(cnt, self.G)
        ntile = -(-cnt // M)
        first_slot = torch.cumsum(cnt, 0) - cnt
        first_tile = torch.cumsum(ntile, 0) - ntile
        NT = int(ntile.sum())
        rank = torch.arange(n, device=dev) - first_slot[skey]
        # tile row of each sorted slot: groups' tiles in group order, slots in token order inside a group
        trow = (first_tile[skey] + rank // M) * M + rank % M
        slot_row = torch.full((R * kc,), NT * M, dtype=torch.int64, device=dev)
        slot_row[order] = trow
        row_tok = torch.full((NT * M,), R, dtype=torch.int64, device=dev)
        row_tok[trow] = order // kc
        tile_blk = torch.repeat_interleave(torch.arange(ngrp, device=dev), ntile, output_size=NT)
        return M, NT, slot_row, row_tok, tile_blk

    def _global_tiles(self, tile_chunks, share):
        """A :class:`_GlobalTiles` over the tokens of ``tile_chunks`` (``[(t0, t1)]``) where it pays: ``G *``
        (live slots per distinct (chunk, group)) below ``share`` and at least twice as many slots per distinct
        group over all of them (``share`` inf: always); else None."""
        dev, N2, NB = self.topk.device, self.N2, self.NB
        tok = torch.cat([torch.arange(t0, t1) for t0, t1 in tile_chunks]).to(dev)
        lens = torch.tensor([t1 - t0 for t0, t1 in tile_chunks])
        n_tok = tok.numel()
        cid = torch.repeat_interleave(torch.arange(len(tile_chunks)), lens, output_size=n_tok).to(dev)
        live = torch.zeros(self.T1, N2, self.K, dtype=torch.bool, device=dev)
        live[tok] = self._live_slots(0, self.T1)[tok]
        heads = torch.arange(N2, device=dev)[None, :, None]
        key = torch.where(live, heads * NB + self.base[:, None, None] + self.topk, N2 * NB)
        n = int(live.sum())
        if share != float("inf"):
            live_t = live[tok]
            grp = key[tok][live_t]
            per_chunk = torch.unique(cid[:, None, None].expand(n_tok, N2, self.K)[live_t] * (N2 * NB) + grp)
            per_call = torch.unique(grp)
            if self.G * n >= share * per_chunk.numel() or per_chunk.numel() < 2 * per_call.numel():
                return None
        M, NT, slot_row, row_tok, tile_blk = self._tiles(key.reshape(-1), n, self.K)
        return _GlobalTiles(self, tok, M, NT, slot_row, row_tok, tile_blk)

    def _union_job(self, t0, t1, live, gblk, mark, U, span=None):
        C, N2, bs = t1 - t0, self.N2, self.bs
        dev = gblk.device
        heads = torch.arange(N2, device=dev)
        if span is None:
            # [N2, U]: the selected blocks first, ascending (a stable sort of the marks), padded with unselected
            ublk = torch.sort(mark.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :U]
            where_u = torch.cumsum(mark, dim=-1) - 1
        else:
            # [N2, U]: the buffer blocks [first, last) of every head, selected or not (no gather: a view)
            ublk = torch.arange(span[0], span[1], device=dev).expand(N2, U)
            where_u = (torch.arange(self.NB, device=dev) - span[0]).expand(N2, self.NB)
        # [C, N2, U]: how many live slots of the token pick each union block (a duplicate id counts twice)
        uidx = where_u[heads[None, :, None], gblk]
        cnt = torch.zeros(C, N2, U, dtype=torch.int64, device=dev)
        cnt.scatter_add_(2, torch.where(live, uidx, 0), live.to(torch.int64))
        # [N2, C, U, BS]: [N2, U, BS] buffer positions against one bound per token (:meth:`_key_bound`), for
        # the blocks the token selected
        cnt = cnt.transpose(0, 1).contiguous()
        kpos = ublk[..., None] * bs + torch.arange(bs, device=dev)
        vis = (cnt > 0)[..., None] & (kpos[:, None] < self._key_bound(torch.arange(t0, t1, device=dev))[
            None, :, None, None])
        mult = None
        if bool((cnt > 1).any()):
            mult = (cnt[..., None] * vis).view(N2, 1, C, U * bs)
        rows = (ublk + heads[:, None] * self.NB).reshape(-1)
        return _UnionJob(self, C, N2, C, rows, U, vis.view(N2, 1, C, U * bs), mult, span)


class _UnionJob:
    """One chunk's work: ``BB`` batches of ``G*R`` query rows against ``nblk*BS`` gathered keys.

    ``rows``: block-buffer rows to gather, ``[BB * nblk]``; ``vis``: ``[BB, 1, R, KB]`` key visibility;
    ``mult``: ``[BB, 1, R, KB]`` key multiplicity (union layout with repeated ids) or None; ``span``: None, or
    ``(first, last)``: the keys are buffer blocks ``[first, last)`` of every KV head, read as a view."""

    def __init__(self, plan, C, BB, R, rows, nblk, vis, mult, span=None):
        self.plan, self.C, self.BB, self.R, self.rows, self.nblk = plan, C, BB, R, rows, nblk
        self.KB = nblk * plan.bs
        self.vis, self.mult, self.span = vis, mult, span

    @property
    def gathered(self):
        return 0 if self.span is not None else self.rows.numel()

    def view(self, buf):
        """``[BB, KB, D]``: the blocks ``span`` of every KV head, a strided view of the block buffer."""
        lo, hi = self.span
        bs = self.plan.bs
        return buf.view(self.BB, self.plan.NB * bs, buf.shape[-1])[:, lo * bs:hi * bs]

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
        if self.span is not None:
            return self.view(buf)
        # a row gather on the 2-D view copies whole blocks (a 3-D index_select goes element by element on CPU)
        flat = torch.nn.functional.embedding(self.rows, buf.view(buf.shape[0], -1))
        return flat.view(self.BB, self.KB, buf.shape[-1])

    def weight(self, acc):
        """``[BB, 1, R, KB]`` key weight in ``acc``: the multiplicity, 0 on invisible keys."""
        return (self.vis if self.mult is None else self.mult).to(acc)


class _Job:
    """One chunk's tiles: ``NT`` tiles of ``M`` slots x G heads against one block each.

    ``slot_row [C*N2*Kc]``: each slot's tile row (dead: ``NT*M``, an extra row); ``row_tok [NT*M]``: each tile
    row's token x KV head (padding: ``C*N2``, an extra row); ``tile_blk [NT]``: block buffer row per tile;
    ``vis [NT*M, BS]``: key visibility, None when every key is visible."""

    def __init__(self, plan, C, kc, M, NT, slot_row, row_tok, tile_blk, vis):
        self.plan, self.C, self.kc, self.M, self.NT = plan, C, kc, M, NT
        self.slot_row, self.row_tok, self.tile_blk, self.vis = slot_row, row_tok, tile_blk, vis
        self.rows = tile_blk

    @property
    def gathered(self):
        return self.rows.numel()

    def to_tiles(self, x, fill=0.0):
        """``[C, N1, F]`` -> ``[NT, M*G, F]`` (padding rows = ``fill``)."""
        C, N2, G, F = self.C, self.plan.N2, self.plan.G, x.shape[-1]
        src = torch.cat([x.reshape(C * N2, G * F), x.new_full((1, G * F), fill)])
        return torch.nn.functional.embedding(self.row_tok, src).view(self.NT, self.M * G, F)

    def new_rows(self, x_like, F, fill):
        """``[NT*M + 1, G*F]`` with the extra (dead slot) row set to ``fill``."""
        buf = x_like.new_empty((self.NT * self.M + 1, self.plan.G * F))
        buf[-1] = fill
        return buf

    def per_token(self, rows, F):
        """``[NT*M + 1, G*F]`` per slot row -> ``[C*N2, Kc, G*F]`` per token (gather, slot order)."""
        G = self.plan.G
        return torch.nn.functional.embedding(self.slot_row, rows).view(self.C * self.plan.N2, self.kc, G * F)

    def gather(self, buf):
        # a row gather on the 2-D view copies whole blocks (a 3-D index_select goes element by element on CPU)
        flat = torch.nn.functional.embedding(self.tile_blk, buf.view(buf.shape[0], -1))
        return flat.view(self.NT, self.plan.bs, buf.shape[-1])

    def from_tokens(self, x):
        """``[C*N2, G*F]`` -> ``[C, N1, F]``."""
        return x.view(self.C, self.plan.N1, -1)

    def weight(self, acc):
        """``[NT*M, 1, 1, BS]`` key weight in ``acc`` (1 visible, 0 not); None when every key is visible."""
        if self.vis is None:
            return None
        return self.vis.to(acc).view(-1, 1, 1, self.plan.bs)


class _GlobalTiles:
    """Block tiles over the live slots of the tokens ``tok`` (many chunks'), run in batches of tiles.

    ``slot_row [T1*N2*K]``, ``row_tok [NT*M]`` (token x KV head row, padding: ``T1*N2``) and ``tile_blk [NT]`` as
    in :class:`_Job`, over the whole call; ``row_acc [NT*M]``: the row's place among the rows of ``tok`` (``i *
    N2 + h`` for ``tok[i]``; padding: ``len(tok) * N2``), where results are summed."""

    def __init__(self, plan, tok, M, NT, slot_row, row_tok, tile_blk):
        self.plan, self.tok, self.M, self.NT = plan, tok, M, NT
        self.slot_row, self.row_tok, self.tile_blk = slot_row, row_tok, tile_blk
        N2 = plan.N2
        place = torch.full((plan.T1 + 1,), tok.numel(), dtype=torch.int64, device=tok.device)
        place[tok] = torch.arange(tok.numel(), device=tok.device)
        self.row_acc = place[row_tok // N2] * N2 + row_tok % N2
        self.n_acc = tok.numel() * N2

    def write(self, dst, acc_rows, scale=None):
        """``dst[tok] = acc_rows`` (``[len(tok) * N2 (+ 1), G*F]``, times ``scale``), in ``dst``'s dtype."""
        x = acc_rows[:self.n_acc].view(self.tok.numel(), *dst.shape[1:])
        if scale is not None:
            x.mul_(scale)
        dst.index_copy_(0, self.tok, x.to(dst.dtype))

    def batches(self, bytes_per_tile):
        """Tile ranges whose work tensors stay within :data:`CHUNK_BYTES`."""
        n = max(1, CHUNK_BYTES // bytes_per_tile)
        return [(i0, min(self.NT, i0 + n)) for i0 in range(0, self.NT, n)]

    def gather(self, buf, i0, i1):
        flat = torch.nn.functional.embedding(self.tile_blk[i0:i1], buf.view(buf.shape[0], -1))
        return flat.view(i1 - i0, self.plan.bs, buf.shape[-1])

    def rows(self, x, i0, i1, acc):
        """``x [T1*N2, G*F]`` -> ``[i1 - i0, M*G, F]`` in ``acc``, the rows of tiles ``i0..i1`` (padding rows 0)."""
        p, M = self.plan, self.M
        rt = self.row_tok[i0 * M:i1 * M]
        pad = (rt == p.T1 * p.N2).nonzero()[:, 0]
        y = torch.nn.functional.embedding(rt.clamp(max=p.T1 * p.N2 - 1), x).to(acc)
        y.index_fill_(0, pad, 0.0)
        return y.view(i1 - i0, M * p.G, -1)

    def weight(self, i0, i1, acc):
        """``[R, 1, 1, BS]`` key visibility of tiles ``i0..i1``'s rows in ``acc`` (a padding row sees what the
        last token does: its queries and dY are 0, its results land in the extra row)."""
        p, M, bs = self.plan, self.M, self.plan.bs
        tok = self.row_tok[i0 * M:i1 * M].clamp(max=p.T1 * p.N2 - 1) // p.N2
        kpos = (self.tile_blk[i0:i1].repeat_interleave(M) % p.NB)[:, None] * bs + torch.arange(bs, device=tok.device)
        return (kpos < p._key_bound(tok)[:, None]).to(acc).view(-1, 1, 1, bs)


def _forward_global(job, q, kb, vb, scale, acc, out, m, l):
    """Writes ``out``, ``m``, ``l`` of ``job.tok`` from global tiles, in two passes over the tiles: each tile
    row's max, then (with each token's max over its slots) the probabilities, their sums and ``P V``, added into
    the token's row in tile order."""
    p, M = job.plan, job.M
    T1, N1, Dqk = q.shape
    G, N2, bs, Dv = p.G, p.N2, p.bs, vb.shape[-1]
    elt = torch.finfo(acc).bits // 8
    per_tile = (M * G * (Dqk + Dv + bs) + bs * (Dqk + Dv + M)) * elt
    qf = q.reshape(T1 * N2, G * Dqk)
    smax = torch.full((job.NT * M + 1, G), _NEG_INF, dtype=acc, device=q.device)
    for i0, i1 in job.batches(per_tile):
        R = (i1 - i0) * M
        s = torch.bmm(job.rows(qf, i0, i1, acc).mul_(scale), job.gather(kb, i0, i1).transpose(1, 2))
        _masked_max(s.view(R, G, 1, bs), job.weight(i0, i1, acc), smax[i0 * M:i1 * M].view(R, G, 1, 1))
    # [T1*N2, G]: the token's max over its slots; 0 when it has none
    mt = torch.nn.functional.embedding(job.slot_row, smax).view(T1 * N2, p.K, G).amax(dim=1)
    mt = torch.where(mt == _NEG_INF, 0.0, mt)
    # the sums, over the rows of job.tok (and one padding row)
    o = torch.zeros(job.n_acc + 1, G * Dv, dtype=acc, device=q.device)
    lt = torch.zeros(job.n_acc + 1, G, dtype=acc, device=q.device)
    for i0, i1 in job.batches(per_tile):
        R = (i1 - i0) * M
        ra = job.row_acc[i0 * M:i1 * M]
        s = torch.bmm(job.rows(qf, i0, i1, acc).mul_(scale), job.gather(kb, i0, i1).transpose(1, 2))
        ssum = s.new_empty((R, G, 1, 1))
        _probs(s.view(R, G, 1, bs), job.weight(i0, i1, acc), job.rows(mt, i0, i1, acc).view(R, G, 1, 1), None,
               acc, sum_out=ssum)
        lt.index_add_(0, ra, ssum.view(R, G))
        o.index_add_(0, ra, torch.bmm(s, job.gather(vb, i0, i1)).view(R, G * Dv))
    o[:-1].view(-1, G, Dv).mul_(torch.where(lt[:-1] > 0, 1.0 / lt[:-1], 0.0)[..., None])
    job.write(out, o)
    job.write(l, lt)
    m.index_copy_(0, job.tok, mt.view(T1, N1)[job.tok])


def _forward_union(job, qs, kb, vb, acc):
    """``(out [C, N1, Dv], m [C, N1], l [C, N1])`` of a union chunk, in ``acc``."""
    BB, G, R, KB = job.BB, job.plan.G, job.R, job.KB
    ks, vs = job.gather(kb), job.gather(vb)
    # [BB, G*R, KB]
    x = torch.bmm(job.to_rows(qs), ks.transpose(1, 2))
    mx, sm = _softmax_fwd(x.view(BB, G, R, KB), job.weight(acc), acc)
    inv = torch.where(sm > 0, 1.0 / sm, 0.0).view(BB, G * R, 1)
    o = torch.bmm(x, vs).mul_(inv)
    return job.from_rows(o), job.from_rows(mx.view(BB, G * R, 1))[..., 0], job.from_rows(sm.view(BB, G * R, 1))[..., 0]


def _forward_tiles(job, qs, kb, vb, acc):
    """``(out [C, N1, Dv], m [C, N1], l [C, N1])`` of a block-centric chunk, in ``acc``."""
    G, bs, N1, Dv = job.plan.G, job.plan.bs, job.plan.N1, vb.shape[-1]
    rows = job.NT * job.M
    ks, vs = job.gather(kb), job.gather(vb)
    # [NT, M*G, BS]
    s = torch.bmm(job.to_tiles(qs), ks.transpose(1, 2))
    s4, w = s.view(rows, G, 1, bs), job.weight(acc)
    # [NT*M + 1, G]: each slot row's max over its block (the extra row stands for dead slots)
    smax = job.new_rows(s, 1, float("-inf"))
    _masked_max(s4, w, smax[:-1].view(rows, G, 1, 1))
    # [C*N2, G]: the token's max over its slots; 0 when it has none
    mt = job.per_token(smax, 1).amax(dim=1)
    mt = torch.where(mt == float("-inf"), 0.0, mt)
    ssum = job.new_rows(s, 1, 0.0)
    _probs(s4, w, job.to_tiles(mt.view(job.C, N1, 1)).view(rows, G, 1, 1), None, acc,
           sum_out=ssum[:-1].view(rows, G, 1, 1))
    o = job.new_rows(s, Dv, 0.0)
    torch.bmm(s, vs, out=o[:-1].view(job.NT, job.M * G, Dv))
    lt = job.per_token(ssum, 1).sum(dim=1)
    ot = job.per_token(o, Dv).sum(dim=1).view(-1, G, Dv)
    inv = torch.where(lt > 0, 1.0 / lt, 0.0)
    return job.from_tokens(ot.mul_(inv[..., None])), job.from_tokens(mt)[..., 0], job.from_tokens(lt)[..., 0]


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
    for t0, t1, job in plan.jobs(plan.G * (Dqk + 2 * Dv + bs) * elt, bs * (Dqk + Dv) * elt, GLOBAL_FWD_SHARE):
        if isinstance(job, _GlobalTiles):
            _forward_global(job, q, kb, vb, scale, acc, out, m, l)
            continue
        run = _forward_union if isinstance(job, _UnionJob) else _forward_tiles
        o, m[t0:t1], l[t0:t1] = run(job, q[t0:t1].to(acc) * scale, kb, vb, acc)
        out[t0:t1] = o.to(q.dtype)
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


def _backward_union(job, qs, dy, o, mc, lc, kb, vb, acc, dkb, dvb):
    """``(dq / scale [C, N1, Dqk], dK per gathered block, dV per gathered block)`` of a union chunk; for a span,
    ``(dq / scale, None, None)``: dK and dV are added into ``dkb``, ``dvb`` here."""
    BB, G, R, KB = job.BB, job.plan.G, job.R, job.KB
    ks, vs = job.gather(kb), job.gather(vb)
    qs, dy, o, mc = job.to_rows(qs), job.to_rows(dy), job.to_rows(o), job.to_rows(mc)
    inv = job.to_rows(torch.where(lc > 0, 1.0 / lc, 0.0))
    # [BB, G*R, KB]: P recomputed from the given stats, 0 on invisible keys
    p = torch.bmm(qs, ks.transpose(1, 2))
    _probs(p.view(BB, G, R, KB), job.weight(acc), mc.view(BB, G, R, 1), inv.view(BB, G, R, 1), acc)
    bs = job.plan.bs
    # [BB, G*R, KB]: dS = P * (dP - rowsum(dY * O))
    ds = _dsoftmax(torch.bmm(dy, vs.transpose(1, 2)), (dy * o).sum(dim=-1, keepdim=True), p)
    dqs = job.from_rows(torch.bmm(ds, ks))
    if job.span is not None:
        # the keys are a view of the block buffer: dV += Pᵀ dY and dK += dSᵀ Q in place, in chunk order
        job.view(dvb).baddbmm_(p.transpose(1, 2), dy)
        job.view(dkb).baddbmm_(ds.transpose(1, 2), qs)
        return dqs, None, None
    # [BB, KB, Dv], [BB, KB, Dqk] per gathered block
    dvs = torch.bmm(p.transpose(1, 2), dy)
    dks = torch.bmm(ds.transpose(1, 2), qs)
    return dqs, dks.view(-1, bs, dks.shape[-1]), dvs.view(-1, bs, dvs.shape[-1])


def _backward_tiles(job, qs, dy, o, mc, lc, kb, vb, acc):
    """``(dq / scale [C, N1, Dqk], dK per tile, dV per tile)`` of a block-centric chunk."""
    G, bs, Dqk = job.plan.G, job.plan.bs, kb.shape[-1]
    rows = job.NT * job.M
    ks, vs = job.gather(kb), job.gather(vb)
    qt, dyt = job.to_tiles(qs), job.to_tiles(dy)
    # [NT, M*G, BS]: P recomputed from the given stats, 0 on invisible keys
    p = torch.bmm(qt, ks.transpose(1, 2))
    _probs(p.view(rows, G, 1, bs), job.weight(acc), job.to_tiles(mc).view(rows, G, 1, 1),
           job.to_tiles(torch.where(lc > 0, 1.0 / lc, 0.0)).view(rows, G, 1, 1), acc)
    # [NT, BS, Dv]
    dvt = torch.bmm(p.transpose(1, 2), dyt)
    # [NT, M*G, BS]: dS = P * (dP - rowsum(dY * O))
    ds = _dsoftmax(torch.bmm(dyt, vs.transpose(1, 2)), job.to_tiles((dy * o).sum(dim=-1, keepdim=True)), p)
    dqs = job.new_rows(ds, Dqk, 0.0)
    torch.bmm(ds, ks, out=dqs[:-1].view(job.NT, job.M * G, Dqk))
    # [NT, BS, Dqk]
    dkt = torch.bmm(ds.transpose(1, 2), qt)
    return job.from_tokens(job.per_token(dqs, Dqk).sum(dim=1)), dkt, dvt


def _backward_global(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic):
    """Writes ``dq`` of ``job.tok`` and adds dK, dV into ``dkb``, ``dvb`` from global tiles: each tile row's dQ
    is added into its token's row in tile order."""
    p, M = job.plan, job.M
    T1, N1, Dqk = q.shape
    G, N2, bs, Dv = p.G, p.N2, p.bs, vb.shape[-1]
    elt = torch.finfo(acc).bits // 8
    per_tile = (M * G * (2 * Dqk + Dv + 3 * bs) + 2 * bs * (Dqk + Dv + M)) * elt
    qf, dyf = q.reshape(T1 * N2, G * Dqk), dout.reshape(T1 * N2, G * Dv)
    # [T1*N2, G*3]: per row m, 1/l and D = rowsum(dY * O)
    stats = torch.stack([m.to(acc), torch.where(l > 0, 1.0 / l.to(acc), 0.0),
                         (dout.to(acc) * out.to(acc)).sum(dim=-1)], dim=-1).view(T1 * N2, G * 3)
    dqa = torch.zeros(job.n_acc + 1, G * Dqk, dtype=acc, device=q.device)  # over the rows of job.tok
    for i0, i1 in job.batches(per_tile):
        R = (i1 - i0) * M
        qt, dyt = job.rows(qf, i0, i1, acc).mul_(scale), job.rows(dyf, i0, i1, acc)
        st = job.rows(stats, i0, i1, acc).view(R, G, 3)
        ks, vs = job.gather(kb, i0, i1), job.gather(vb, i0, i1)
        pr = torch.bmm(qt, ks.transpose(1, 2))
        _probs(pr.view(R, G, 1, bs), job.weight(i0, i1, acc), st[..., 0, None, None], st[..., 1, None, None], acc)
        ds = _dsoftmax(torch.bmm(dyt, vs.transpose(1, 2)), st[..., 2].reshape(i1 - i0, M * G, 1), pr)
        dqa.index_add_(0, job.row_acc[i0 * M:i1 * M], torch.bmm(ds, ks).view(R, G * Dqk))
        _accumulate(dkb, job.tile_blk[i0:i1], torch.bmm(ds.transpose(1, 2), qt), deterministic)
        _accumulate(dvb, job.tile_blk[i0:i1], torch.bmm(pr.transpose(1, 2), dyt), deterministic)
    job.write(dq, dqa, scale)


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    acc = _acc(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = _Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    G = plan.G
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    dkb = torch.zeros_like(kb)
    dvb = torch.zeros_like(vb)
    elt = torch.finfo(acc).bits // 8
    for t0, t1, job in plan.jobs(G * (3 * Dqk + 2 * Dv + 3 * bs) * elt, 2 * bs * (Dqk + Dv) * elt,
                                 GLOBAL_BWD_SHARE):
        if isinstance(job, _GlobalTiles):
            _backward_global(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic)
            continue
        args = (job, q[t0:t1].to(acc) * scale, dout[t0:t1].to(acc), out[t0:t1].to(acc),
                m[t0:t1, :, None].to(acc), l[t0:t1, :, None].to(acc), kb, vb, acc)
        if isinstance(job, _UnionJob):
            dqc, dkt, dvt = _backward_union(*args, dkb, dvb)
        else:
            dqc, dkt, dvt = _backward_tiles(*args)
        dq[t0:t1] = dqc.mul_(scale).to(q.dtype)
        if dkt is not None:
            _accumulate(dkb, job.rows, dkt, deterministic)
            _accumulate(dvb, job.rows, dvt, deterministic)
    return dq, plan.from_blocks(dkb, k.dtype), plan.from_blocks(dvb, v.dtype)
