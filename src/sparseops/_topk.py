"""Each row's ``k`` largest entries in the order of a stable descending sort, without sorting the row.

``stable_topk(x, k)`` equals ``torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]`` bitwise:
descending value, ties to the lower column, NaN above everything (all NaNs equal), ``-0.0 == 0.0``. It costs
two ``topk`` over the row and a few elementwise passes, against a full sort; it never synchronises with the
host (no data-dependent shapes or branches), so it runs as one graph under ``torch.compile``.

The ``k``-th largest value ``v`` of a row splits it: the entries above ``v`` are all among ``topk``'s ``k``
(``a < k`` of them), and the rest of the answer is the ``k - a`` lowest columns holding ``v``, which a second
``topk`` finds on an integer key that is distinct per tied column (``E - column``) and 0 elsewhere. The ``a``
entries above ``v`` are put in stable order by sorting their ``k`` columns ascending, then their values
descending with a stable sort (``k`` is small).

``stable_topk(x, k, sync=True)`` gives the same columns in eager code that may wait for the host (the DSA
indexer's chunks): one unsorted ``topk`` finds ``v``; where every row holds exactly ``k`` entries at or above
it (no ties at ``v``, no NaN among the ``k``), those are the answer, else the entries above ``v`` and the first
``k - a`` tied ones by a cumulative count; ``nonzero`` lists the taken columns in ascending order, and a stable
sort of their values puts them in order. It skips the second ``topk`` over the row.
"""

from __future__ import annotations

import torch


# NaN is the largest value for sort and topk, but compares false: a row whose k-th value is NaN ties its NaNs
def _above(x: torch.Tensor, vk: torch.Tensor) -> torch.Tensor:
    """The entries of ``x`` that the sort puts before each row's ``vk [T, 1]``."""
    return (x > vk) | (x.isnan() & ~vk.isnan())


def _tied(x: torch.Tensor, vk: torch.Tensor) -> torch.Tensor:
    """The entries of ``x`` that the sort counts equal to each row's ``vk [T, 1]``."""
    return torch.where(vk.isnan(), x != x, x == vk)


def _stable_topk_sync(x: torch.Tensor, k: int) -> torch.Tensor:
    T, _ = x.shape
    val = x.topk(k, dim=-1, sorted=False).values
    take = x >= val.amin(dim=-1, keepdim=True)  # amin is NaN where a NaN is among the k: no entry is taken
    if not bool((take.sum(dim=-1) == k).all()):
        vk = val.topk(1, dim=-1, largest=False).values  # the k-th largest, NaN counted largest as topk does
        above, tie = _above(x, vk), _tied(x, vk)
        take = above | (tie & (tie.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
    col = take.nonzero()[:, 1].view(T, k)  # row-major: each row's columns ascending
    return col.gather(1, x.gather(1, col).sort(dim=-1, descending=True, stable=True).indices)


def stable_topk(x: torch.Tensor, k: int, *, sync: bool = False) -> torch.Tensor:
    """int64 `[T, k]` columns of the ``k`` largest entries of each row of the float `[T, E]` ``x``, ``1 <= k <= E``,
    in the order of ``torch.sort(x, -1, descending=True, stable=True)``.

    ``sync=True``: the same columns by a host-synchronising path (a data-dependent branch and ``nonzero``) that
    skips a second ``topk`` over the rows; for eager code only, it breaks a ``torch.compile`` graph."""
    if sync:
        return _stable_topk_sync(x, k)
    T, E = x.shape
    val, col = x.topk(k, dim=-1)  # its order among equal values is unspecified: only the set is used
    vk = val[:, -1:]
    above = _above(val, vk)
    tie = _tied(x, vk)
    # the tied columns, lowest first; int16 (for E < 2**15) keeps the [T, E] key narrow, and a product is a
    # cheaper pass than torch.where on the CPU
    w = torch.arange(E, 0, -1, device=x.device, dtype=torch.int16 if E < 2**15 else torch.int32)
    tied = (tie * w).topk(k, dim=-1).indices
    col = col.sort(dim=-1).values
    col = col.gather(1, x.gather(1, col).sort(dim=-1, descending=True, stable=True).indices)
    # the a entries above v lead col (their values are larger than v); the k - a lowest tied columns follow
    a = above.sum(-1, keepdim=True)
    j = torch.arange(k, device=x.device)
    return torch.where(j < a, col, tied.gather(1, (j - a).clamp(min=0)))
