"""``DistributedConfig(ep_implementation="sparseops")``: sparseops' expert-parallel dispatchers in transformers.

An :class:`SparseopsEP` is built per experts module by transformers' ``ep_dispatch_experts`` style (one per
layer); transformers shards the expert weights (``grouped_gemm``: whole experts per EP rank, FSDP over the
ranks that hold the same experts) and runs the call with the local parameters. Per forward:

1. when the EP group's ranks share one batch (TP), each keeps its slice of the rows (``split_rows``);
2. one all-gather of every rank's token count and slots per global expert builds the dispatch
   :class:`~sparseops.distributed.dispatchers.Plan` (the one host sync of the layer);
3. the dispatcher moves the rows: ``"alltoall"`` (``"sparseops"``, ``"sparseops_alltoall"``) or the CANN
   range window ``"allgather"`` (``"sparseops_allgather"``); both differentiable, k-sums in fp32;
4. the local experts run on expert-sorted rows: the sparseops grouped GEMMs when the module's
   ``experts_implementation`` is ``"sparseops"`` and its class runs the decorated forward, else the module's
   own experts forward (top-1, unit weights; a subclass's forward such as ErgoExperts' per-expert norm);
5. with a shared batch, the slices are gathered back (``gather_rows``).

docs/transformers.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import EPImplementation

from ..distributed.collectives import gather_rows, split_rows
from ..distributed.dispatchers import DISPATCH, Plan
from .transformers_experts import NAME, experts_rows, unsupported_reason


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def gather_plan(top_k_index: torch.Tensor, num_experts: int, group) -> Plan:
    """Every rank's token count and slots per global expert (one all-gather of `[E + 1]` ints per rank)."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.zeros(num_experts + 1, dtype=torch.int64, device=top_k_index.device)
    mine[0] = top_k_index.shape[0]
    mine[1:] = torch.bincount(top_k_index.reshape(-1).to(torch.int64), minlength=num_experts)[:num_experts]
    out = mine.new_empty(ws, num_experts + 1)
    dist.all_gather(list(out.unbind(0)), mine, group=group)
    rows = out.tolist()
    return Plan(tokens=[r[0] for r in rows], kept=[r[1:] for r in rows], rank=rank, world_size=ws)


class SparseopsEP(EPImplementation):
    """Expert parallelism through sparseops' dispatchers (``dispatcher``: ``"alltoall"`` or ``"allgather"``).

    Called with this rank's ``(hidden_states [T, H], top_k_index [T, K] global expert ids, top_k_weights [T, K])``,
    returns `[T, H]`: ``sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])``, whichever
    rank holds the expert. Gradients reach every input (routing weights included) and the local experts.
    """

    dispatcher = "alltoall"

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.experts = experts

    def _run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        module = self.experts
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        # a subclass that overrides the decorated forward (ErgoExperts: a per-expert norm of each route) runs
        # its own forward below, which reaches the sparseops experts through its call of the decorated one
        decorated = hasattr(type(module).forward, "__wrapped__")
        if impl == NAME and decorated and unsupported_reason(
                module, rows, rows.new_zeros(rows.shape[0], 1, dtype=torch.int64), rows.new_ones(rows.shape[0], 1),
                {}) is None:
            return experts_rows(module, rows, counts)
        if rows.shape[0] == 0:
            # an eager forward returns fresh zeros for no rows: one stand-in row keeps the weights and the
            # reverse exchange in the backward graph, so every rank joins the same collectives
            ids = torch.zeros(1, 1, dtype=torch.int64, device=rows.device)
            return self.experts_forward(rows.sum(0, keepdim=True), ids, rows.new_zeros(1, 1))[:0]
        ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                      torch.tensor(counts, device=rows.device), output_size=rows.shape[0])
        return self.experts_forward(rows, ids.unsqueeze(1), rows.new_ones(rows.shape[0], 1))

    # an eager island inside torch.compile (one graph break per layer, as MoELayer's): the plan reads the token
    # counts on the host, so dynamo would break the graph there anyway, and the exchange's autograd.Functions run
    # as tested (docs/transformers.md, "torch.compile")
    @torch._disable_dynamo
    def __call__(self, hidden_states, top_k_index, top_k_weights):
        hidden_states, top_k_index, top_k_weights = (_local(t) for t in (hidden_states, top_k_index, top_k_weights))
        shared = self.tp_mesh.size() > 1
        if shared:  # each rank of a TP group keeps its slice, so no token is computed twice
            tp_group = self.tp_mesh.get_group()
            num_tokens = hidden_states.shape[0]
            hidden_states, top_k_index, top_k_weights = (split_rows(t, tp_group)
                                                         for t in (hidden_states, top_k_index, top_k_weights))
        group = self.ep_mesh.get_group()
        E = self.num_local_experts * self.ep_mesh.size()
        plan = gather_plan(top_k_index, E, group)
        weight = getattr(self.experts, "gate_up_proj" if getattr(self.experts, "has_gate", True) else "up_proj", None)
        dtype = _local(weight).dtype if isinstance(weight, torch.Tensor) else hidden_states.dtype
        out = DISPATCH[self.dispatcher](hidden_states.to(dtype), top_k_index, top_k_weights, plan, self._run_experts,
                                        group)
        out = out.to(hidden_states.dtype)
        if shared:
            out = gather_rows(out, tp_group)
            if out.shape[0] != num_tokens:  # pragma: no cover - split_rows and gather_rows use the same sizes
                raise RuntimeError(f"gathered {out.shape[0]} rows, expected {num_tokens}")
        return out


class SparseopsAllGatherEP(SparseopsEP):
    """:class:`SparseopsEP` with the CANN range-window all-gather dispatcher."""

    dispatcher = "allgather"


class SparseopsAllToAllEP(SparseopsEP):
    """:class:`SparseopsEP` with the all-to-all dispatcher (the default of ``"sparseops"``)."""

    dispatcher = "alltoall"


#: registry name -> implementation
EP_IMPLEMENTATIONS = {NAME: SparseopsEP, f"{NAME}_alltoall": SparseopsAllToAllEP,
                      f"{NAME}_allgather": SparseopsAllGatherEP}
