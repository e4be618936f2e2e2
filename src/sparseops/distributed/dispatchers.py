"""Expert-parallel token dispatch: move each token's routed copies to the ranks that own the experts and back.

Three dispatchers with one signature and the same results (docs/moe-layer.md, "Dispatchers"):

- :func:`dispatch_local`: one process holds all experts (no collective).
- :func:`dispatch_allgather`: the CANN pattern. All-gather x, indices and probs; every rank takes its
  ``range`` window of the group's expert-sorted rows (from the gathered counts), runs its experts,
  unpermutes into the group's token set in fp32 and reduce-scatters the sums back. Its backward runs
  ``moe_token_unpermute_with_ep_grad`` on the window.
- :func:`dispatch_alltoall`: permute locally over all experts, send each rank the rows of its experts with
  an uneven all-to-all, run the experts, send the rows back, unpermute with the probs on the source rank.

All sizes come from :class:`Plan`, built from the numbers gathered once per forward, so a dispatch adds no
host sync. Rank r owns the global experts ``[r*E_l, (r+1)*E_l)``; dropped slots carry the sink id E.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._numerics import acc_dtype
from ..moe.api import moe_token_permute_with_ep, moe_token_unpermute_with_ep
from .collectives import Group, all_gather, all_to_all, reduce_scatter

DISPATCHERS = ("allgather", "alltoall")

#: ``experts(rows [R, H], tokens_per_local_expert: list[int]) -> [R, H]``
Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """The host-side numbers of one dispatch, the same on every rank.

    ``tokens[q]``: rank q's token count; ``kept[q][e]``: rank q's kept slots for global expert e (after any
    capacity drop); ``rank``, ``world_size``: this rank in the EP group."""

    tokens: list[int]
    kept: list[list[int]]
    rank: int
    world_size: int

    @property
    def num_local(self) -> int:
        return len(self.kept[0]) // self.world_size

    def local_slice(self, q: int) -> slice:
        El = self.num_local
        return slice(q * El, (q + 1) * El)

    def group_counts(self) -> list[int]:
        return [sum(col) for col in zip(*self.kept)]

    def window(self) -> tuple[int, int]:
        """This rank's ``[s, e)`` in the group's expert-sorted rows (all ranks' tokens, rank-major)."""
        C = self.group_counts()
        lo = sum(C[:self.rank * self.num_local])
        return lo, lo + sum(C[self.local_slice(self.rank)])


def dispatch_local(x: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor, plan: Plan, experts: Experts,
                   group: Group = None, backend: str = "auto") -> torch.Tensor:
    """``y[t] = sum_k probs[t, k] * expert_{indices[t, k]}(x[t])`` with every expert in this process.

    Args: see :func:`dispatch_allgather`. Returns `[T, H]` in x's dtype (the k sum in fp32, rounded once).
    """
    kept = sum(plan.kept[0])
    rows, sidx, _ = moe_token_permute_with_ep(x, indices, None, [0, kept], backend=backend, validate=False)
    out = experts(rows, plan.kept[0])
    return moe_token_unpermute_with_ep(out, sidx, probs, range=[0, kept], backend=backend, validate=False)


def dispatch_allgather(x: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor, plan: Plan,
                       experts: Experts, group: Group = None, backend: str = "auto") -> torch.Tensor:
    """The CANN pattern: all-gather, this rank's ``range`` window, local experts, reduce-scatter.

    Args:
        x: `[T, H]` this rank's tokens. indices: `[T, K]` int global expert ids (E = a dropped slot).
        probs: `[T, K]` fp32 (float64) router weights. plan: the gathered sizes. experts: the local experts.
        group: the EP group. backend: passed to the MoE ops.

    Returns:
        `[T, H]` in x's dtype: the group's partial sums added in rank order in fp32, rounded once.
    """
    lo, hi = plan.window()
    x_g = all_gather(x, group, plan.tokens)
    idx_g = all_gather(indices.to(torch.int32), group, plan.tokens)
    p_g = all_gather(probs, group, plan.tokens)
    rows, sidx, _ = moe_token_permute_with_ep(x_g, idx_g, None, [lo, hi], backend=backend, validate=False)
    out = experts(rows, plan.group_counts()[plan.local_slice(plan.rank)])
    part = moe_token_unpermute_with_ep(out.to(acc_dtype(x.dtype)), sidx, p_g, range=[lo, hi], backend=backend,
                                       validate=False)
    return reduce_scatter(part, group, plan.tokens).to(x.dtype)


class _RowGather(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; the backward gathers with the inverse (one writer per row)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _source_to_expert_order(plan: Plan, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The row permutation from (source rank, local expert) blocks to (local expert, source rank) blocks."""
    sizes = torch.tensor([plan.kept[q][plan.local_slice(plan.rank)] for q in range(plan.world_size)],
                         dtype=torch.int64)  # [ws, E_l]
    src_start = (sizes.reshape(-1).cumsum(0) - sizes.reshape(-1)).reshape(sizes.shape)
    t_sizes, t_start = sizes.T.reshape(-1), src_start.T.reshape(-1)
    n = int(t_sizes.sum())
    dst_start = t_sizes.cumsum(0) - t_sizes
    index = torch.repeat_interleave(t_start - dst_start, t_sizes, output_size=n) + torch.arange(n)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(n)
    return index.to(device), inverse.to(device), sizes.sum(0).tolist()


def dispatch_alltoall(x: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor, plan: Plan,
                      experts: Experts, group: Group = None, backend: str = "auto") -> torch.Tensor:
    """Permute locally, uneven all-to-all to the experts' ranks, experts, all-to-all back, unpermute.

    Args: see :func:`dispatch_allgather`. Returns `[T, H]` in x's dtype (the k sum in fp32 on the source
    rank, rounded once: the one-process arithmetic).
    """
    ws, r = plan.world_size, plan.rank
    mine = plan.kept[r]
    kept = sum(mine)
    send = [sum(mine[plan.local_slice(q)]) for q in range(ws)]
    recv = [sum(plan.kept[q][plan.local_slice(r)]) for q in range(ws)]
    rows, sidx, _ = moe_token_permute_with_ep(x, indices, None, [0, kept], backend=backend, validate=False)
    got = all_to_all(rows, recv, send, group)
    if ws > 1 and plan.num_local > 1:
        index, inverse, local_counts = _source_to_expert_order(plan, x.device)
        out = experts(_RowGather.apply(got, index, inverse), local_counts)
        out = _RowGather.apply(out, inverse, index)
    else:
        out = experts(got, [sum(plan.kept[q][e] for q in range(ws)) for e in range(plan.local_slice(r).start,
                                                                                  plan.local_slice(r).stop)])
    back = all_to_all(out, send, recv, group)
    return moe_token_unpermute_with_ep(back, sidx, probs, range=[0, kept], backend=backend, validate=False)


DISPATCH = {"local": dispatch_local, "allgather": dispatch_allgather, "alltoall": dispatch_alltoall}
