"""The planner of the NSA torch path: per-call index tensors, token chunks and the layout of each chunk's work.

See docs/nsa.md for the contract; arguments arrive validated (docs/internals.md). Tokens are processed in
chunks sized by a memory budget; inside a chunk everything is batched, with no Python loop over tokens:

1. keys and values are copied once per call into a *block buffer* ``[N2 * NB, BS, D]`` (``NB`` block rows: a
   sequence of several blocks starts a row, one that fits in what is left of the current row is packed after
   the sequences before it, :func:`buffer_starts`; at most twice the keys however short the sequences), so a
   selected block is one contiguous row of the buffer and ``topk`` ids turn into buffer rows with one add; the
   visibility masks hide the other sequences' keys of a packed row;
2. per chunk, the slots that can see nothing (``-1``, or causal blocks that start after the query) are dropped;
3. a chunk whose tokens pick overlapping blocks (it computes at most ``union_waste`` times its live keys;
   a span at most :func:`union_limit`) runs in the *union layout* (:class:`~.torch_jobs.UnionJob`): batch = KV
   head, rows = G heads x the chunk's tokens, keys = every block some token of the chunk selected, masked per
   token (large matmuls, some wasted keys, no per-slot copies), gathered, or taken as the *span* of buffer
   blocks from the first selected to the last, a strided view (no gather; the backward adds dK and dV into the
   buffer in place); every other chunk runs in the *block-centric layout* (:class:`~.torch_jobs.TileJob`): the
   chunk's live slots are sorted by (KV head, block) and cut into *tiles* of ``M`` slots that share one block
   (the last tile of a block padded with empty rows); a tile's rows are the G query heads of its M tokens, so
   every product is one batched matmul over tiles: ``[M*G, Dqk] x [Dqk, BS]`` for the scores, ``[M*G, BS] x
   [BS, Dv]`` for ``P V``; ``dV`` and ``dK`` come out per tile and are added blockwise into the block buffer.
   On the CPU, chunks whose tiles would share little are tiled together, over all their tokens at once
   (*global tiles*, :class:`~.torch_jobs.GlobalTiles`, ``global_fwd_share``), and run in batches of tiles.

:mod:`sparseops.nsa.torch_impl` runs the jobs (the softmax split, the stats, the gradients).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from .._settings import Settings
from .torch_jobs import GlobalTiles, TileJob, UnionJob


@dataclasses.dataclass(frozen=True)
class NsaTorchSettings:
    """Tuning knobs of the NSA torch backend (read per call through :data:`SETTINGS`)."""

    #: bytes of per-chunk work tensors (tiles, scores, per-slot products). Larger chunks make larger matmuls
    #: (more tokens share a block in a tile) and fewer ops; each work tensor stays below glibc's largest mmap
    #: threshold (32 MiB), so chunk tensors are recycled instead of page-faulted in every time
    chunk_bytes: int = 32 * 2**20
    #: budget of one chunk's gathered K/V blocks (and, backward, their gradients), which ``chunk_bytes`` does not
    #: count: a chunk over it is split in halves. Few tokens per block (G = 1, one query per sequence: a block
    #: per slot) gather many times ``chunk_bytes`` without it
    gather_bytes: int = 4 * 32 * 2**20
    #: slots per tile; None: chosen per chunk by :func:`tile_size`
    tile: int | None = None
    #: candidate tile sizes
    tiles: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    #: a chunk uses the union layout when it computes at most this many times the keys its live slots see
    #: (0: never)
    union_waste: float = 2.0
    #: the union layout may also take the buffer blocks ``[first, last)`` of the chunk's selection as one strided
    #: view (a *span*: no gather, dK/dV added in place) when that computes at most :func:`union_limit` times the
    #: live keys, and (if the compact union also qualifies) at most ``1 + span_slack / (G * tokens)`` times its
    #: keys: the gather a span saves costs about as much as 30 / (G * tokens) of the compute per key (False: never)
    span: bool = True
    span_slack: float = 32.0
    #: on the CPU, the chunks that take block tiles may instead be tiled *globally*: all their slots sorted by
    #: block at once, so a tile gathers its block for the slots of every such chunk (not of one chunk of 16-64
    #: tokens), and the tiles are run in batches of ``chunk_bytes``. The forward then takes two passes (the row
    #: maxima, then the probabilities and ``P V``, summed into the tokens' rows: its ``Q Kᵀ`` twice); the
    #: backward adds each slot's dQ into its token's row. Taken where ``G *`` (live slots per distinct (chunk,
    #: block)), about the rows of a chunk's tiles, is below this (forward / backward) and the call shares at
    #: least twice as much: per-chunk tiles of fewer rows make small matmuls that run far below the matmul rate,
    #: so only chunks whose own tiles are large keep them; the forward's limit is lower, as its second pass
    #: costs a ``Q Kᵀ``. 0: never; inf: always
    global_fwd_share: float = 512.0
    global_bwd_share: float = 1024.0
    #: on the CPU, run the C++ kernels of :mod:`.cpu_gather` where they suit the call (token granularity, or at
    #: least a vector register's lanes of query heads per KV head: 16 in fp32) and they build; False: torch ops
    cpu_kernels: bool = True


#: the knobs in force; tests and tuning scripts change them with ``SETTINGS.override(...)``
SETTINGS = Settings(NsaTorchSettings())

#: :meth:`Plan.chunk`'s answer for a chunk that takes block tiles when asked not to build them
_TILES = "tiles"


def union_limit(G: int, union_waste: float) -> float:
    """The waste a span union may have: ``union_waste``, raised for small G (up to 8 at G = 1), whose tiles
    (few rows per block) are bound by the gather of a block per few rows, not by the matmul. The score
    tensors grow with it, but the gathers they replace are larger still."""
    return max(union_waste, min(8.0, 16.0 / G))


def tile_size(cnt: torch.Tensor, G: int, knobs: NsaTorchSettings) -> int:
    """The tile size with the least estimated cost: padded rows, each tile also paying for a matmul call whose
    efficiency grows with its rows (about ``1 + 64 / rows``)."""
    if knobs.tile is not None:
        return knobs.tile
    best, best_m = None, 1
    for M in knobs.tiles:
        padded = int((-(-cnt // M)).sum()) * M
        cost = padded * (1.0 + 64.0 / (M * G))
        if best is None or cost < best:
            best, best_m = cost, M
    return best_m


def buffer_starts(lens_kv: list[int], bs: int) -> list[int]:
    """Each sequence's first position in the block buffer's rows ``[NB * BS]``, from its key count: in order, a
    sequence that fits in what is left of the current block row starts right after the previous one (packed),
    any other at the next block row. A sequence of several blocks therefore starts a row (its block ``j`` is
    buffer row ``start / BS + j``), and a packed one lies within one row, its block 0. Any two consecutive rows
    hold a block's worth of keys or more, so the buffer holds at most twice the keys plus one row, however many
    sequences shorter than a block there are (padding every sequence: up to ``BS`` times); one sequence fills
    it as before, padded to whole blocks. Example, ``BS = 4``, key counts ``[6, 1, 2, 3]``: starts
    ``[0, 6, 8, 12]``, rows ``[a0 a1 a2 a3] [a4 a5 b0 -] [c0 c1 - -] [d0 d1 d2 -]`` (docs/nsa.md)."""
    start, pos = [], 0
    for s in lens_kv:
        if pos % bs + s > bs:
            pos = -(-pos // bs) * bs
        start.append(pos)
        pos += s
    return start


class Plan:
    """Per-call index tensors shared by the forward and the backward."""

    def __init__(self, q, k, topk, bs, cu_q, cu_kv, causal):
        dev = q.device
        self.knobs = SETTINGS.get()
        self.T1, self.N1 = q.shape[0], q.shape[1]
        self.T2, self.N2 = k.shape[0], k.shape[1]
        self.G = self.N1 // self.N2
        self.K = topk.shape[2]
        self.bs = bs
        self.causal = causal
        B = len(cu_q) - 1
        lens_q = torch.tensor([cu_q[b + 1] - cu_q[b] for b in range(B)], dtype=torch.int64)
        lens_kv = [cu_kv[b + 1] - cu_kv[b] for b in range(B)]
        start = buffer_starts(lens_kv, bs)
        self.NB = -(-(start[-1] + lens_kv[-1]) // bs) if B else 0
        # packed: some sequence starts inside a block row, after the keys of others (their keys are invisible to it)
        self.packed = any(s % bs for s in start)
        # per query token: its sequence's key count, first buffer position and block row, its in-sequence position
        seq = torch.repeat_interleave(torch.arange(B), lens_q, output_size=self.T1)
        self.cu_q = cu_q
        pos = torch.arange(self.T1) - torch.tensor(cu_q[:-1], dtype=torch.int64)[seq]
        start_t = torch.tensor(start, dtype=torch.int64)
        self.s2 = torch.tensor(lens_kv, dtype=torch.int64)[seq].to(dev)
        self.start = start_t[seq].to(dev)
        self.base = self.start // bs
        self.s1 = pos.to(dev)
        # per key row: its row in the flattened block buffer [NB * BS]
        kv_lens = torch.tensor(lens_kv, dtype=torch.int64)
        kseq = torch.repeat_interleave(torch.arange(B), kv_lens, output_size=self.T2)
        kpos = torch.arange(self.T2) - torch.tensor(cu_kv[:-1], dtype=torch.int64)[kseq]
        key_row = start_t[kseq] + kpos
        # [N2 * T2]: rows of the 2-D buffer [N2 * NB * BS, D] for k.transpose(0, 1) flattened
        self.key_row = (torch.arange(self.N2)[:, None] * (self.NB * bs) + key_row[None, :]).reshape(-1).to(dev)
        self.topk = topk.to(dev, torch.int64)

    def to_blocks(self, x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """``[T2, N2, D]`` -> block buffer ``[N2 * NB, BS, D]`` in ``acc`` (zeros where no key is placed)."""
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
        """Token ranges whose live slots' work tensors stay within ``chunk_bytes``."""
        live = self._live_slots(0, self.T1)
        kmax = int(live.sum(-1).max()) if self.T1 else 0
        per_token = max(1, self.N2 * max(kmax, 1) * bytes_per_slot)
        C = max(1, self.knobs.chunk_bytes // per_token)
        return [(t0, min(self.T1, t0 + C)) for t0 in range(0, self.T1, C)]

    def jobs(self, bytes_per_slot: int, bytes_per_block: int, share: float = 0.0):
        """``(t0, t1, job)`` over :meth:`chunks`; a chunk whose gathered blocks (``bytes_per_block`` each: the
        K/V copies, and in the backward their gradients) would pass ``gather_bytes`` is split in halves
        until they fit or it is one token (few tokens sharing few blocks, e.g. G = 1 and one query per
        sequence, gather a block per slot). ``share`` (``global_fwd_share`` / ``global_bwd_share``): the chunks
        that take tiles may come last as one :class:`~.torch_jobs.GlobalTiles` (``(0, T1, job)``)."""
        # with a share limit on the CPU, the chunks that take tiles are set aside, then tiled globally (one
        # :class:`GlobalTiles`) or, where that does not pay, one by one like the others
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
            if t1 - t0 > 1 and job.gathered * bytes_per_block > self.knobs.gather_bytes:
                mid = (t0 + t1) // 2
                todo += [(mid, t1, deferring), (t0, mid, deferring)]
                continue
            yield t0, t1, job

    def visible(self, kpos, tok, shape=(-1, 1)):
        """Whether the key at buffer position ``kpos`` (``blk * BS + j``) is visible to query token ``tok`` (its
        bounds viewed as ``shape`` to broadcast against ``kpos``): at or past its sequence's first buffer position
        (the keys before it in a packed block row are other sequences'), and below that position plus its key
        count (and, causal, plus its own position + 1, whichever is smaller)."""
        lo = self.start[tok]
        hi = self.s2[tok]
        if self.causal:
            hi = torch.minimum(hi, self.s1[tok] + 1)
        vis = kpos < (hi + lo).view(shape)
        if self.packed:
            vis &= kpos >= lo.view(shape)
        return vis

    def _live_slots(self, t0, t1):
        """``[C, N2, K]``: the slot's block can hold a visible key (the per-key mask refines this)."""
        blk = self.topk[t0:t1]
        # blk < ceil(S2 / bs), not blk * bs < S2: (validate=False) an int64 id past 2**63 / bs would wrap negative
        live = (blk >= 0) & (blk < (self.s2[t0:t1, None, None] + self.bs - 1) // self.bs)
        if self.causal:
            live &= blk * self.bs <= self.s1[t0:t1, None, None]
        return live

    def chunk(self, t0, t1, tiles=True):
        """The work of tokens ``[t0, t1)``: a :class:`~.torch_jobs.UnionJob` when the union of their blocks costs
        at most ``union_waste`` times their live keys (a span of the buffer, ``span``: :func:`union_limit`
        times), else their tiles as a :class:`~.torch_jobs.TileJob`; None when no token of them sees a key."""
        C, N2, bs, dev, knobs = t1 - t0, self.N2, self.bs, self.topk.device, self.knobs
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
        if knobs.union_waste > 0:
            mark = torch.zeros(ngrp + 1, dtype=torch.bool, device=dev)
            mark[key] = True
            mark = mark[:-1].view(N2, self.NB)
            U = int(mark.sum(-1).max())  # the compact union's blocks per KV head
            sel = mark.any(0).nonzero()
            first, last = int(sel[0]), int(sel[-1]) + 1  # the span's
            compact = U * C * N2 <= knobs.union_waste * n
            # a span also covers blocks that no token of the chunk selected: only within one sequence, never
            # the (0-weighted) blocks of sequences packed between the chunk's
            one_seq = bisect.bisect_right(self.cu_q, t0) == bisect.bisect_right(self.cu_q, t1 - 1)
            span = knobs.span and one_seq and (last - first) * C * N2 <= union_limit(self.G, knobs.union_waste) * n and (
                not compact or last - first <= U * (1.0 + knobs.span_slack / (self.G * C)))
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
        vis = self.visible(kpos, tok)
        vis |= (row_tok == C * N2)[:, None]
        return TileJob(self, t0, C, kc, M, NT, slot_row, row_tok, tile_blk, None if bool(vis.all()) else vis)

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
        M = tile_size(cnt, self.G, self.knobs)
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
        """A :class:`~.torch_jobs.GlobalTiles` over the tokens of ``tile_chunks`` (``[(t0, t1)]``) where it pays: ``G *``
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
        return GlobalTiles(self, tok, M, NT, slot_row, row_tok, tile_blk)

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
        # [N2, C, U, BS]: [N2, U, BS] buffer positions against the bounds of each token (:meth:`visible`), for
        # the blocks the token selected
        cnt = cnt.transpose(0, 1).contiguous()
        kpos = ublk[..., None] * bs + torch.arange(bs, device=dev)
        vis = (cnt > 0)[..., None] & self.visible(kpos[:, None], torch.arange(t0, t1, device=dev), (1, C, 1, 1))
        mult = None
        if bool((cnt > 1).any()):
            mult = (cnt[..., None] * vis).view(N2, 1, C, U * bs)
        rows = (ublk + heads[:, None] * self.NB).reshape(-1)
        return UnionJob(self, t0, C, N2, C, rows, U, vis.view(N2, 1, C, U * bs), mult, span)
