"""The three layouts of a chunk's work in the NSA torch path: index maps, layout changes and block gathers.

:class:`~sparseops.nsa.torch_plan.Plan` builds them; :mod:`sparseops.nsa.torch_impl` runs them. Every job
has ``layout`` (``"union"``, ``"tiles"`` or ``"global"``, which names the executor's function for it) and
``gather(buf)``, the keys (or values) it reads from the block buffer ``[N2 * NB, BS, D]``; a
:class:`GlobalTiles` job is run in :class:`TileBatch` es, which have ``gather(buf)`` too.
"""

from __future__ import annotations

import torch


class UnionJob:
    """The union layout of the tokens ``[t0, t0 + C)``: ``BB`` batches of ``G*R`` query rows against ``nblk*BS``
    gathered keys.

    ``rows``: block-buffer rows to gather, ``[BB * nblk]``; ``vis``: ``[BB, 1, R, KB]`` key visibility;
    ``mult``: ``[BB, 1, R, KB]`` key multiplicity (union layout with repeated ids) or None; ``span``: None, or
    ``(first, last)``: the keys are buffer blocks ``[first, last)`` of every KV head, read as a view."""

    layout = "union"

    def __init__(self, plan, t0, C, BB, R, rows, nblk, vis, mult, span=None):
        self.plan, self.t0, self.C, self.BB, self.R, self.rows, self.nblk = plan, t0, C, BB, R, rows, nblk
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
        """``[BB, KB, D]``: the chunk's keys (or values) of the block buffer ``buf``."""
        if self.span is not None:
            return self.view(buf)
        # a row gather on the 2-D view copies whole blocks (a 3-D index_select goes element by element on CPU)
        flat = torch.nn.functional.embedding(self.rows, buf.view(buf.shape[0], -1))
        return flat.view(self.BB, self.KB, buf.shape[-1])

    def weight(self, acc):
        """``[BB, 1, R, KB]`` key weight in ``acc``: the multiplicity, 0 on invisible keys."""
        return (self.vis if self.mult is None else self.mult).to(acc)


class TileJob:
    """The block tiles of the tokens ``[t0, t0 + C)``: ``NT`` tiles of ``M`` slots x G heads against one block each.

    ``slot_row [C*N2*Kc]``: each slot's tile row (dead: ``NT*M``, an extra row); ``row_tok [NT*M]``: each tile
    row's token x KV head (padding: ``C*N2``, an extra row); ``tile_blk [NT]``: block buffer row per tile;
    ``vis [NT*M, BS]``: key visibility, None when every key is visible."""

    layout = "tiles"

    def __init__(self, plan, t0, C, kc, M, NT, slot_row, row_tok, tile_blk, vis):
        self.plan, self.t0, self.C, self.kc, self.M, self.NT = plan, t0, C, kc, M, NT
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
        """``[NT, BS, D]``: each tile's block of the block buffer ``buf``."""
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


class GlobalTiles:
    """Block tiles over the live slots of the tokens ``tok`` (many chunks'), run in batches of tiles.

    ``slot_row [T1*N2*K]``, ``row_tok [NT*M]`` (token x KV head row, padding: ``T1*N2``) and ``tile_blk [NT]`` as
    in :class:`TileJob`, over the whole call; ``row_acc [NT*M]``: the row's place among the rows of ``tok`` (``i *
    N2 + h`` for ``tok[i]``; padding: ``len(tok) * N2``), where results are summed."""

    layout = "global"

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

    def batches(self, bytes_per_tile: int, budget: int):
        """:class:`TileBatch` es of consecutive tiles whose work tensors stay within ``budget`` bytes."""
        n = max(1, budget // bytes_per_tile)
        return [TileBatch(self, i0, min(self.NT, i0 + n)) for i0 in range(0, self.NT, n)]


class TileBatch:
    """Tiles ``[i0, i1)`` of a :class:`GlobalTiles`: ``R = (i1 - i0) * M`` rows, each against one block.

    ``row_acc [R]``: each row's place among the job's accumulation rows; ``tile_blk [i1 - i0]``: the block
    buffer row of each tile."""

    def __init__(self, job, i0, i1):
        self.job, self.n = job, i1 - i0
        M = job.M
        self.R = self.n * M
        self.row_tok = job.row_tok[i0 * M:i1 * M]
        self.row_acc = job.row_acc[i0 * M:i1 * M]
        self.tile_blk = job.tile_blk[i0:i1]

    def gather(self, buf):
        """``[n, BS, D]``: each tile's block of the block buffer ``buf``."""
        flat = torch.nn.functional.embedding(self.tile_blk, buf.view(buf.shape[0], -1))
        return flat.view(self.n, self.job.plan.bs, buf.shape[-1])

    def rows(self, x, acc):
        """``x [T1*N2, G*F]`` -> ``[n, M*G, F]`` in ``acc``, the rows of the batch's tiles (padding rows 0)."""
        p = self.job.plan
        rt = self.row_tok
        pad = (rt == p.T1 * p.N2).nonzero()[:, 0]
        y = torch.nn.functional.embedding(rt.clamp(max=p.T1 * p.N2 - 1), x).to(acc)
        y.index_fill_(0, pad, 0.0)
        return y.view(self.n, self.job.M * p.G, -1)

    def partial_rows(self, acc):
        """``(rows [P], weight [P, 1, 1, BS])``: the batch's rows that do not see every key of their block (the
        block holding the token's own position, or past its sequence's end) and their key visibility in ``acc``;
        None when every row sees all. Few rows are partial (one slot per token, the local block), so the masks
        are applied to these rows only, not in passes over the whole batch. A padding row sees what the last
        token does: its queries and dY are 0, its results land in the extra row."""
        p, M, bs = self.job.plan, self.job.M, self.job.plan.bs
        tok = self.row_tok.clamp(max=p.T1 * p.N2 - 1) // p.N2
        kpos = (self.tile_blk.repeat_interleave(M) % p.NB)[:, None] * bs + torch.arange(bs, device=tok.device)
        vis = p.visible(kpos, tok)
        rows = (~vis.all(-1)).nonzero()[:, 0]
        if rows.numel() == 0:
            return None
        return rows, vis[rows].to(acc).view(-1, 1, 1, bs)
