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
"""

from __future__ import annotations

import torch


def stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """int64 `[T, k]` columns of the ``k`` largest entries of each row of the float `[T, E]` ``x``, ``1 <= k <= E``,
    in the order of ``torch.sort(x, -1, descending=True, stable=True)``."""
    T, E = x.shape
    val, col = x.topk(k, dim=-1)  # its order among equal values is unspecified: only the set is used
    vk = val[:, -1:]
    vk_nan = vk.isnan()
    # NaN is the largest value for sort and topk, but compares false: a row whose k-th value is NaN ties its NaNs
    above = (val > vk) | (val.isnan() & ~vk_nan)
    tie = torch.where(vk_nan, x != x, x == vk)
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
