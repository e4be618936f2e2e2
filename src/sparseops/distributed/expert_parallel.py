"""The expert-parallel side of a layer: :class:`ExpertParallelModule`, the contract that ``parallelize`` and the
checkpoint helpers work with, and the guards against DistributedDataParallel around such a layer.

A layer whose ``experts`` submodule holds its ``num_experts`` experts split over a process group (every
``experts`` parameter ``[E_l, ...]``, dim 0 the expert; rank r of the group holds the global ids
``[r * E_l, (r + 1) * E_l)``) derives from :class:`ExpertParallelModule`; :class:`sparseops.nn.MoELayer` is one.
The class keeps the group's fields, writes the local experts into ``state_dict()`` as DTensors of the global
shape and reads any layout's experts back (docs/training.md, "The raw ep_group API"), and refuses DDP around a
layer spread over ranks. It imports no layer, so this package stands below ``sparseops.nn``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from .collectives import check_group


class ExpertParallelModule(nn.Module):
    """A module whose ``experts`` hold ``num_experts`` experts split over ``ep_group`` (docs/training.md).

    Fields: ``num_experts`` (E, global), ``experts`` (the submodule of this rank's ``E_l = E / ep_size``
    experts), ``ep_group`` / ``ep_size`` / ``ep_rank``, ``replicated_tokens`` (every rank passes the same
    tokens), ``batch_group`` (the group over whose batch the losses count: None for ``ep_group``, the world
    once ``parallelize`` ran), ``grad_scale`` (what this rank's loss part is multiplied by in the gradient).
    A subclass calls :meth:`_init_expert_parallel` in its ``__init__`` and checks its group at the first
    forward while ``_group_checked`` is false.
    """

    def _init_expert_parallel(self, num_experts: int, ep_group: dist.ProcessGroup | None) -> None:
        """Set the group's fields from ``ep_group`` (None: one process holds every expert) and register the
        state-dict hooks; ``ValueError`` when the group's size does not divide ``num_experts``."""
        check_group("ep_group", ep_group)
        ep, rank = (1, 0) if ep_group is None else (dist.get_world_size(ep_group), dist.get_rank(ep_group))
        if num_experts % ep:
            raise ValueError(f"ep_group: expected a group size that divides num_experts = {num_experts}, got {ep} "
                             "ranks")
        self.num_experts = num_experts
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep, rank
        self._group_checked = ep == 1
        # the group over whose batch the losses count (None: ep_group), the positions of the EP group's ranks
        # in it, and the gradient scale of this rank's loss part: set by parallelize (join_expert_group)
        self.batch_group, self._batch_rows, self.grad_scale = None, None, 1.0
        if ep > 1:
            refuse_ddp_around_ep()
        self.register_state_dict_post_hook(_experts_to_global)
        self.register_load_state_dict_pre_hook(_experts_from_global)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        El = self.num_experts // self.ep_size
        return range(self.ep_rank * El, (self.ep_rank + 1) * El)

    def join_expert_group(self, group: dist.ProcessGroup, size: int, rank: int, batch_group: dist.ProcessGroup,
                          batch_rows: list[int], grad_scale: float) -> None:
        """Take ``group`` as the expert-parallel group (its experts already split) and count the losses over
        ``batch_group``'s batch, where the group's ranks stand at ``batch_rows``: what ``parallelize`` does."""
        self.ep_group, self.ep_size, self.ep_rank = group, size, rank
        refuse_ddp_around_ep()
        self._group_checked = size == 1
        self.batch_group, self._batch_rows, self.grad_scale = batch_group, batch_rows, float(grad_scale)


def ep_mesh(layer: ExpertParallelModule, device_type: str):
    """A one-dimensional DeviceMesh over the layer's raw ``ep_group`` (built once)."""
    mesh = getattr(layer, "_raw_ep_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(layer.ep_group, device_type)
        layer._raw_ep_mesh = mesh
    return mesh


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _expert_keys(layer: ExpertParallelModule, prefix: str):
    return [(f"{prefix}experts.{n}", n) for n, _ in layer.experts.named_parameters(recurse=False)]


def _experts_to_global(layer: ExpertParallelModule, state: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a layer built with a raw ``ep_group``: the local experts as DTensors of the global
    shape ``[E, ...]`` (``Shard(0)`` over the group), so ``torch.distributed.checkpoint`` writes all E experts
    once under their one-process keys instead of one rank's copy (docs/training.md, "Checkpoints")."""
    if layer.ep_size == 1:
        return
    from torch.distributed.tensor import DTensor, Shard

    for key, _ in _expert_keys(layer, prefix):
        value = state.get(key)
        if value is None or isinstance(value, DTensor):
            continue
        shape = (layer.num_experts, *value.shape[1:])
        state[key] = DTensor.from_local(value, ep_mesh(layer, value.device.type), [Shard(0)], run_check=False,
                                        shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def _experts_from_global(layer: ExpertParallelModule, state: dict, prefix: str, local_metadata, strict, missing_keys,
                         unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` of a layer built with a raw ``ep_group``: a DTensor or a one-process ``[E, ...]``
    tensor of the experts becomes this rank's ``[E_l, ...]`` block; a local block loads as it is."""
    if layer.ep_size == 1 or any(is_dtensor(p) for p in layer.experts.parameters()):
        return
    r = layer.local_experts
    for key, _ in _expert_keys(layer, prefix):
        value = state.get(key)
        if value is None:
            continue
        if is_dtensor(value):
            value = value.full_tensor()
        if value.dim() >= 1 and value.shape[0] == layer.num_experts:
            state[key] = value[r.start:r.stop]


def _ddp_class():
    """``DistributedDataParallel`` where its module is imported, else None (a model without it holds none)."""
    return getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None)


def inside_ddp() -> bool:
    """Whether a DistributedDataParallel forward is running (DDP records its active module for this)."""
    active = getattr(_ddp_class(), "_get_active_ddp_module", None)
    return active is not None and active() is not None


_DDP_HOOK = None


def refuse_ddp_around_ep() -> None:
    """Register, once, the global module-registration hook :func:`_check_ddp_child` (torch's public
    ``register_module_module_registration_hook``): DDP's constructor registers the model it wraps as its
    submodule before it broadcasts rank 0's parameters, so the hook runs first."""
    global _DDP_HOOK
    if _DDP_HOOK is None:
        _DDP_HOOK = nn.modules.module.register_module_module_registration_hook(_check_ddp_child)


def _check_ddp_child(parent: nn.Module, name: str, child) -> None:
    """Raise ``ValueError`` naming ``parallelize`` when a DistributedDataParallel takes a model holding an
    expert-parallel layer (built with ``ep_group``, or parallelized): its broadcast would overwrite other
    ranks' experts with rank 0's, its all-reduce average different experts' gradients."""
    ddp = _ddp_class()
    if ddp is None or not isinstance(parent, ddp) or not isinstance(child, nn.Module):
        return None
    for m in child.modules():
        if isinstance(m, ExpertParallelModule) and m.batch_group is not None:
            raise ValueError(
                "module: expected no MoELayer that sparseops.distributed.parallelize already spread over the "
                "ranks inside torch.nn.parallel.DistributedDataParallel, got one: parallelize(..., "
                "data_parallel='ddp') already gives the model DDP's gradient all-reduce")
        if isinstance(m, ExpertParallelModule) and m.ep_size > 1:
            raise ValueError(
                "module: expected no MoELayer built with ep_group inside torch.nn.parallel."
                "DistributedDataParallel, got one: DDP would broadcast rank 0's experts over the other ranks' "
                "and average the gradients of different experts. Build the model without ep_group and call "
                "sparseops.distributed.parallelize(model, ParallelDims(ep=...), data_parallel='ddp') instead")
    return None
