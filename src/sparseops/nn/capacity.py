"""Expert capacity: which routed slots each expert keeps from one rank's tokens (docs/moe-layer.md, "Capacity").

``cap = ceil(capacity_factor * T * K / E)`` slots per expert from this rank's T tokens. ``"probs"`` keeps the
slots with the largest probs (ties: the lower token index), ``"position"`` the first ``cap`` slots in
(token, k) order. A dropped slot is routed to the sink id ``E``: it sorts after every real expert, so it
lies outside every rank's ``range`` window and the MoE ops neither compute nor weight it.
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def capacity(capacity_factor: float, T: int, K: int, E: int) -> int:
    """Slots each expert keeps from ``T`` tokens: ``ceil(capacity_factor * T * K / E)``."""
    return math.ceil(capacity_factor * T * K / E)


def drop_to_sink(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, cap: int,
                 policy: str) -> torch.Tensor:
    """``indices`` with the slots over capacity replaced by the sink id ``E = num_experts``.

    Args:
        indices: `[T, K]` int64 expert ids in ``[0, E)``, distinct within a row.
        probs: `[T, K]` float, the router's weights (read for ``policy="probs"`` only).
        num_experts: E. cap: slots kept per expert. policy: ``"probs"`` or ``"position"``.

    Returns:
        `[T, K]` int64: ``indices`` where kept, ``E`` where dropped.

    Example: indices ``[[0, 1], [0, 2], [0, 1]]``, probs ``[[.6, .4], [.7, .3], [.5, .5]]``, E = 3, cap = 2:
    ``"position"`` drops slot (2, 0) (expert 0's third slot) -> ``[[0, 1], [0, 2], [3, 1]]``; ``"probs"``
    keeps expert 0's slots with probs .7 and .6 -> the same result here.
    """
    flat = indices.reshape(-1)
    N = flat.numel()
    if N == 0 or cap >= indices.shape[0]:  # an expert gets at most one slot per token
        return indices
    if policy == "position":
        order = torch.argsort(flat, stable=True)
    else:
        by_prob = torch.argsort(probs.detach().reshape(-1), descending=True, stable=True)
        order = by_prob[torch.argsort(flat[by_prob], stable=True)]
    counts = torch.bincount(flat, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(N, device=flat.device) - starts[flat[order]]
    dropped = order[rank_in_expert >= cap]
    return flat.index_fill(0, dropped, num_experts).view_as(indices)
