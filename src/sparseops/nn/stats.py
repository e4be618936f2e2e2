"""The per-forward statistics of an MoE layer, gathered over the EP group in one collective and one host sync.

Every rank contributes one float64 vector (its token count, per-expert counts, loss sums, ...); one
``all_gather`` of equal-sized vectors and one ``.tolist()`` give every rank the same numbers, from which it
derives the buffer sizes of the dispatch, the ``range`` windows and the group's losses without another
collective (docs/moe-layer.md, "One host sync"). Counts are exact in float64 below 2**53.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupStats:
    """The gathered pieces: ``piece(i)[r]`` is rank r's i-th piece as a list of Python floats."""

    def __init__(self, rows: list[list[float]], lengths: list[int]):
        self.rows = rows
        self.lengths = list(lengths)
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)

    def row(self, r: int) -> GroupStats:
        """Rank r's numbers alone, as if gathered over a group of one."""
        return GroupStats([self.rows[r]], self.lengths)

    def select(self, ranks: list[int]) -> GroupStats:
        """The rows of ``ranks`` (positions in the gathered group), in that order."""
        return GroupStats([self.rows[r] for r in ranks], self.lengths)

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def piece(self, i: int) -> list[list[float]]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return [row[a:b] for row in self.rows]

    def ints(self, i: int) -> list[list[int]]:
        return [[int(v) for v in p] for p in self.piece(i)]

    def total(self, i: int) -> float:
        """The sum over ranks (in rank order) of a one-number piece."""
        return sum(p[0] for p in self.piece(i))

    def sum_tensor(self, i: int, device) -> torch.Tensor:
        """The elementwise sum over ranks of a vector piece, float64 `[n]` on ``device``."""
        return torch.tensor(self.piece(i), dtype=torch.float64).sum(0).to(device)


def gather_stats(group: dist.ProcessGroup | None, *pieces) -> GroupStats:
    """All-gather the concatenated ``pieces`` (lists of numbers or tensors) as float64 over ``group``.

    ``group=None`` or a group of one rank: no collective, the same :class:`GroupStats` with one row.
    """
    parts = []
    device = None
    for p in pieces:
        if isinstance(p, torch.Tensor):
            device = p.device if device is None else device
            parts.append(p.detach().reshape(-1).to(torch.float64))
        else:
            parts.append(torch.tensor(list(p), dtype=torch.float64))
    device = device or torch.device("cpu")
    vec = torch.cat([t.to(device) for t in parts])
    lengths = [t.numel() for t in parts]
    if group is None or dist.get_world_size(group) == 1:
        return GroupStats([vec.tolist()], lengths)
    ws = dist.get_world_size(group)
    out = vec.new_empty(ws, vec.numel())
    dist.all_gather(list(out.unbind(0)), vec, group=group)
    return GroupStats(out.tolist(), lengths)
