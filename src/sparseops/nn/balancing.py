"""Aux-loss-free load balancing: the expert-bias update (docs/moe-layer.md, "Balancing")."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_float
from ..distributed.collectives import check_group
from .router import TopKRouter


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float = 1e-3, group: dist.ProcessGroup | None = None) -> int:
    """Nudge every router's ``expert_bias`` towards balanced load; call once per optimizer step.

    For every :class:`TopKRouter` in ``model`` built with ``expert_bias=True``: ``c`` = the routed slots per
    expert counted by its training-mode forwards since the last call, summed over ``group`` (one all-reduce
    for all routers); ``b_e += rate * sign(mean(c) - c_e)``; then ``b -= mean(b)``; the counts restart at 0.
    Overloaded experts become less likely to be chosen; the bias never weights an expert's output.

    Args:
        model: any module; its ``TopKRouter`` submodules with an ``expert_bias`` buffer are updated.
        rate: the step size (``>= 0``).
        group: the ranks whose counts are summed; None: the default group when ``torch.distributed`` is
            initialized (every replica of a router then applies the same update), else this process alone.

    Returns:
        The number of routers updated.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_group("group", group)
    rate = check_float("rate", rate)
    if not rate >= 0:
        raise ValueError(f"rate: expected a number >= 0, got {rate!r}")
    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return 0
    counts = torch.cat([m.local_tokens_per_expert for m in routers])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    off = 0
    for m in routers:
        c = counts[off:off + m.num_experts].to(torch.float64)
        off += m.num_experts
        b = m.expert_bias
        b += (rate * torch.sign(c.mean() - c)).to(b.dtype)
        b -= b.mean()
        m.local_tokens_per_expert.zero_()
    return len(routers)
