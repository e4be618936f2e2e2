"""Data × expert parallelism on torch's own parts: ``ParallelDims`` (the mesh axes) and ``parallelize``.

The layout, the gradient semantics and what a checkpoint holds are in docs/training.md. In short: the world of
``W = dp_replicate * dp_shard`` ranks trains one model on the global batch; the routed experts of every
:class:`sparseops.nn.MoELayer` become DTensors of the global shape ``[E, ...]`` sharded over ``ep`` (FSDP2 over
the ``efsdp = dp_shard / ep`` ranks that share an expert shard, HSDP with ``dp_replicate``); every other
parameter is FSDP2-sharded (HSDP with ``dp_replicate > 1``) or replicated by DDP over the whole world.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .expert_parallel import ExpertParallelModule

DATA_PARALLEL = ("fsdp", "ddp")
#: the DistributedDataParallel options ``parallelize(..., ddp_options=...)`` passes through (value types)
DDP_OPTIONS = {"find_unused_parameters": bool, "gradient_as_bucket_view": bool, "static_graph": bool,
               "bucket_cap_mb": (int, float)}

#: the attribute ``parallelize`` leaves on the model (checked to refuse a second call)
_MARK = "_sparseops_parallel"


def _check_size(name: str, value, *, allow_rest: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not (value >= 1 or (allow_rest and value == -1)):
        raise ValueError(f"{name}: expected an int >= 1{' or -1 (the rest of the world)' if allow_rest else ''}, "
                         f"got {value}")
    return value


@dataclass
class ParallelDims:
    """The parallel layout of a run, with torchtitan's axis names (docs/training.md, "Mesh axes").

    ``W = dp_replicate * dp_shard`` ranks (``dp_shard=-1``: the rest of the world). The dense parameters are
    sharded over ``dp_shard`` and replicated over ``dp_replicate``; the routed experts are split over ``ep``
    ranks borrowed from ``dp_shard`` (``ep`` must divide ``dp_shard`` and every MoE layer's E), and each expert
    shard is FSDP-sharded further over ``efsdp = dp_shard / ep`` ranks.

    Rank ``r`` sits at ``(dp_replicate, dp_shard) = divmod(r, dp_shard)`` on the dense mesh and at
    ``(dp_replicate, efsdp, ep)`` with ``dp_shard = efsdp * ep + ep_index`` on the expert mesh: the ``ep``
    ranks of one expert group are consecutive.

    The meshes are built with ``init_device_mesh`` the first time :meth:`build` (or :func:`parallelize`) needs
    them; :meth:`resolve` checks a layout against a world size without any collective.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    _meshes: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_size("dp_replicate", self.dp_replicate)
        _check_size("dp_shard", self.dp_shard, allow_rest=True)
        _check_size("ep", self.ep)
        if self.dp_shard != -1 and self.dp_shard % self.ep:
            raise ValueError(f"ep: expected a divisor of dp_shard = {self.dp_shard}, got {self.ep}")

    def resolve(self, world_size: int) -> ParallelDims:
        """The layout with ``dp_shard`` filled in for ``world_size`` ranks; ValueError if it does not fit."""
        W = _check_size("world_size", world_size)
        if self.dp_shard == -1:
            if W % self.dp_replicate:
                raise ValueError(f"dp_replicate: expected a divisor of the world size {W}, got {self.dp_replicate}")
            shard = W // self.dp_replicate
            if shard % self.ep:
                raise ValueError(f"ep: expected a divisor of dp_shard = {shard} (world size {W} / dp_replicate "
                                 f"{self.dp_replicate}), got {self.ep}")
        else:
            shard = self.dp_shard
            if self.dp_replicate * shard != W:
                raise ValueError(f"dp_replicate * dp_shard: expected the world size {W}, got "
                                 f"{self.dp_replicate} * {shard} = {self.dp_replicate * shard}")
        if shard == self.dp_shard:
            return self
        return ParallelDims(self.dp_replicate, shard, self.ep)

    @property
    def world_size(self) -> int:
        self._need_resolved()
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """The ranks that share one expert shard (``dp_shard / ep``)."""
        self._need_resolved()
        return self.dp_shard // self.ep

    def _need_resolved(self) -> None:
        if self.dp_shard == -1:
            raise ValueError("dp_shard: expected a resolved layout (call resolve(world_size)), got -1")

    def build(self, device_type: str, timeout: datetime.timedelta | float | None = None) -> ParallelDims:
        """The resolved layout with its meshes: ``dense`` ``(dp_replicate, dp_shard)``, ``expert``
        ``(dp_replicate, efsdp, ep)`` and ``dp`` ``(W,)``, each from ``init_device_mesh`` on ``device_type``.

        Needs the process group (torchrun's environment); the layout is checked against its world size first,
        so a bad one raises ``ValueError`` before any collective. ``timeout`` (a timedelta or seconds): of every
        collective on the meshes' groups, so a rank that stops responding ends the others' wait with an error
        (None: torch's default for new groups, 30 minutes; the world group keeps its own)."""
        check_torch("ParallelDims.build")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ParallelDims.build: expected an initialized torch.distributed process group "
                               "(run under torchrun, or call init_process_group first)")
        dims = self.resolve(dist.get_world_size())
        timeout = _timedelta(timeout)
        key = (device_type, timeout)
        if key not in dims._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            def mesh(shape, names):
                return init_device_mesh(device_type, shape, mesh_dim_names=names,
                                        backend_override=_overrides(device_type, timeout, len(shape)))

            dims._meshes[key] = {
                "dense": mesh((dims.dp_replicate, dims.dp_shard), ("dp_replicate", "dp_shard")),
                "expert": mesh((dims.dp_replicate, dims.efsdp, dims.ep), ("dp_replicate", "efsdp", "ep")),
                "dp": mesh((dims.world_size,), ("dp",)),
            }
            dims._meshes[device_type] = dims._meshes[key]  # the meshes parallelize uses
        return dims

    def mesh(self, name: str, device_type: str):
        """One of the meshes of :meth:`build` (``"dense"``, ``"expert"`` or ``"dp"``; built if needed)."""
        dims = self if device_type in self._meshes else self.build(device_type)
        if name not in ("dense", "expert", "dp"):
            raise ValueError(f"name: expected 'dense', 'expert' or 'dp', got {name!r}")
        return dims._meshes[device_type][name]


def _timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """A layout's ``timeout`` (a timedelta or seconds) as a timedelta; None stays None."""
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: expected None, a timedelta or a number of seconds > 0, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _overrides(device_type: str, timeout: datetime.timedelta | None, ndim: int) -> dict | None:
    """``init_device_mesh``'s ``backend_override`` giving every dimension's group ``timeout``."""
    if timeout is None:
        return None
    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        from torch._C._distributed_c10d import Backend as _C10dBackend

        backend, options = "gloo", _C10dBackend.Options("gloo", timeout)
    return {i: (backend, options) for i in range(ndim)}


def _device_type(model: nn.Module) -> str:
    """``cuda`` under NCCL, else ``cpu`` (meta parameters take the backend's device)."""
    backend = str(dist.get_backend()).lower()
    return "cuda" if "nccl" in backend else "cpu"


def _moe_layers(model: nn.Module) -> list[ExpertParallelModule]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelModule)]


def _check_ddp_options(options, data_parallel: str) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"ddp_options: expected None or a dict, got {type(options).__name__}")
    if options and data_parallel != "ddp":
        raise ValueError(f"ddp_options: expected none with data_parallel={data_parallel!r}, got {sorted(options)}")
    for key, value in options.items():
        if key not in DDP_OPTIONS:
            raise ValueError(f"ddp_options: expected keys among {sorted(DDP_OPTIONS)}, got {key!r}")
        kind = DDP_OPTIONS[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise TypeError(f"ddp_options[{key!r}]: expected {'a bool' if kind is bool else 'a number'}, got "
                            f"{type(value).__name__}")
        if key == "bucket_cap_mb" and not value > 0:
            raise ValueError(f"ddp_options['bucket_cap_mb']: expected a number > 0, got {value!r}")
    return dict(options)


def _check(model: nn.Module, dims: ParallelDims, data_parallel: str) -> tuple[ParallelDims, list[ExpertParallelModule]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims: expected a sparseops.distributed.ParallelDims, got {type(dims).__name__}")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel: expected one of {DATA_PARALLEL}, got {data_parallel!r}")
    if data_parallel == "ddp" and any(p.is_meta for p in model.parameters()):
        raise ValueError("model: expected parameters with storage for data_parallel='ddp' (DDP broadcasts rank "
                         "0's values at construction), got meta parameters: build the model on the device, or "
                         "use data_parallel='fsdp' and materialize")
    if getattr(model, _MARK, None) is not None:
        raise ValueError("model: expected a model not parallelized yet, got one parallelize already ran on "
                         f"({getattr(model, _MARK)})")
    wrapped = _wrapped_by(model)
    if wrapped is not None:
        raise ValueError(f"model: expected the plain model (parallelize applies FSDP2 / DDP itself), got one {wrapped}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("parallelize: expected an initialized torch.distributed process group "
                           "(run under torchrun, or call init_process_group first)")
    dims = dims.resolve(dist.get_world_size())
    layers = _moe_layers(model)
    for layer in layers:
        if layer.ep_group is not None:
            raise ValueError("model: expected MoELayers built without ep_group (parallelize splits the experts "
                             f"over the ep mesh), got one with an ep_group of {layer.ep_size} ranks")
        if layer.replicated_tokens:
            raise ValueError("model: expected MoELayers with replicated_tokens=False (parallelize gives every "
                             "rank its own share of the batch), got replicated_tokens=True")
        if layer.num_experts % dims.ep:
            raise ValueError(f"ep: expected a divisor of every MoE layer's num_experts, got ep = {dims.ep} and "
                             f"num_experts = {layer.num_experts}")
        for name, p in layer.experts.named_parameters(recurse=False):
            if p.dim() == 0 or p.shape[0] != layer.num_experts:
                raise ValueError(f"model: expected every experts parameter of shape [E={layer.num_experts}, ...] "
                                 f"(dim 0 the expert), got {name} of shape {list(p.shape)}")
    return dims, layers


def _wrapped_by(model: nn.Module) -> str | None:
    """What already wraps or shards ``model`` (DDP, FSDP2's ``fully_shard``, DTensor parameters), or None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from .expert_parallel import is_dtensor

    for name, m in model.named_modules():
        where = f" at {name!r}" if name else ""
        if isinstance(m, DistributedDataParallel):
            return f"wrapped in DistributedDataParallel{where}"
        if isinstance(m, FSDPModule):  # fully_shard swaps the module's class for one deriving from it
            return f"already sharded by fully_shard{where}"
    for name, p in model.named_parameters():
        if is_dtensor(p):
            return f"with DTensor parameters ({name!r})"
    return None


def _shard_experts(layer: ExpertParallelModule, dims: ParallelDims, device_type: str) -> None:
    """Replace the layer's full experts by this rank's block as DTensors of the global shape, Shard(0) on ep."""
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = dims.mesh("expert", device_type)["ep"]
    j, El = ep_mesh.get_local_rank(), layer.num_experts // dims.ep
    experts = layer.experts
    for name, p in list(experts.named_parameters(recurse=False)):
        local = p.detach()[j * El:(j + 1) * El].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        experts.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
    if hasattr(experts, "num_experts"):
        experts.num_experts = El  # the counts its forward takes are the local experts'
    group = ep_mesh.get_group()
    rows = dist.get_process_group_ranks(group) if dims.ep > 1 else [dist.get_rank()]
    layer.join_expert_group(group, dims.ep, j, dist.group.WORLD, rows, dims.world_size)


def _divide_grads(layer: ExpertParallelModule) -> None:
    """A hook ``g / W`` on each expert parameter no FSDP unit reduces (``W = ep``), unless it has one.

    :func:`materialize` re-attaches it after ``to_empty``."""
    W = getattr(layer, "_grad_divide", 1.0)
    if W == 1.0:
        return
    for p in layer.experts.parameters():
        hooks = p._backward_hooks or {}
        if not any(getattr(h, "_sparseops_divide", False) for h in hooks.values()):
            def divide(g, W=W):
                return g / W

            divide._sparseops_divide = True
            p.register_hook(divide)


def _owned(module: nn.Module, params: list) -> set | None:
    """The ones of ``params`` that ``module`` holds (None: none), compared by identity."""
    ids = {id(p) for p in params}
    return {q for q in module.parameters() if id(q) in ids} or None


def check_torch(who: str = "parallelize") -> None:
    """Raise ``RuntimeError`` naming the torch version when it lacks what :func:`parallelize` calls: FSDP2's
    ``fully_shard(ignored_params=...)`` (torch 2.7), ``set_gradient_divide_factor`` and
    ``set_force_sum_reduction_for_comms`` (2.8), and meshes whose groups take the layout's timeout:
    ``init_device_mesh(backend_override=...)`` came in 2.9, but its groups keep torch's default timeout before
    2.10 (a rank that stops responding would hold its peers for 30 minutes, not ``timeout``)."""
    import inspect

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    missing = [name for name, found in (
        ("FSDP2's fully_shard(ignored_params=...)", "ignored_params" in inspect.signature(fully_shard).parameters),
        ("FSDP2's FSDPModule.set_gradient_divide_factor", hasattr(FSDPModule, "set_gradient_divide_factor")),
        ("FSDP2's FSDPModule.set_force_sum_reduction_for_comms",
         hasattr(FSDPModule, "set_force_sum_reduction_for_comms")),
        ("init_device_mesh(backend_override=...)",
         "backend_override" in inspect.signature(init_device_mesh).parameters),
        ("mesh groups that take their options' timeout", torch.__version__ >= (2, 10)),
    ) if not found]
    if missing:
        raise RuntimeError(f"{who}: needs torch >= 2.10 ({', '.join(missing)}), got torch {torch.__version__}")


def _fsdp_options(module, device_type: str, divide: float | None = None) -> None:
    if divide is not None:
        module.set_gradient_divide_factor(divide)
    if device_type != "cuda":
        # gloo has neither PREMUL_SUM nor a trustworthy AVG: sum, then divide once
        module.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, dims: ParallelDims, *, data_parallel: str = "fsdp",
                timeout: datetime.timedelta | float | None = None, ddp_options: dict | None = None) -> nn.Module:
    """Spread ``model`` over the world as ``dims`` lays it out, in place; returns ``model``.

    Every rank passes the same full model (same seed), or one built on the ``meta`` device and given its
    values by :func:`materialize` afterwards (``"fsdp"`` only). Each :class:`~sparseops.nn.MoELayer` keeps on rank
    ``(..., efsdp_i, ep_j)`` the experts ``[j*E/ep, (j+1)*E/ep)`` as DTensors of the global shape ``[E, ...]``
    (``Shard(0)`` over ``ep``; FSDP2 along dim 1 over ``efsdp``, HSDP with ``dp_replicate``, or over
    ``dp_replicate`` alone when ``efsdp = 1``); its
    aux loss and counts then cover the global batch. The other parameters are FSDP2-sharded over
    ``(dp_replicate, dp_shard)`` (``"fsdp"``, HSDP when ``dp_replicate > 1``; every ``nn.ModuleList`` entry and
    every MoE layer its own unit) or replicated with DDP's gradient all-reduce over the world (``"ddp"``,
    buffers not broadcast).

    Then each rank's loss is the mean over its equal share of the global batch, and after ``backward`` every
    parameter's gradient (its ``full_tensor()``) is the one-process gradient of the global mean loss
    (docs/training.md, "Gradients"). ``model.state_dict()`` keys are the one-process keys.

    ``timeout``: of every collective on the layout's groups (see :meth:`ParallelDims.build`).
    ``ddp_options`` (``"ddp"`` only): passed to DDP, among ``find_unused_parameters`` (a model whose forward
    leaves some dense parameters out), ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``.

    Raises:
        ValueError: a layout that does not match the world, ``ddp_options`` not listed above (or with fsdp), an ``ep`` that does not divide ``dp_shard`` or a
            layer's E, MoE layers built with ``ep_group`` or ``replicated_tokens``, a second call; all before
            any collective. TypeError: a model or dims of the wrong type. RuntimeError: a torch older than 2.10.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    check_torch()
    options = _check_ddp_options(ddp_options, data_parallel)
    dims, layers = _check(model, dims, data_parallel)
    device_type = _device_type(model)
    dims = dims.build(device_type, timeout)
    expert_mesh = dims.mesh("expert", device_type)
    # the experts' FSDP mesh: HSDP over (dp_replicate, efsdp) when both are > 1, else the one that is > 1
    # (never a dimension of one rank: its reduction divides twice by a custom factor, docs/training.md "Traps")
    axes = tuple(a for a in ("dp_replicate", "efsdp") if getattr(dims, a) > 1)
    expert_dp = expert_mesh[axes] if len(axes) == 2 else expert_mesh[axes[0]] if axes else None
    W = float(dims.world_size)
    loose = []  # experts no FSDP unit manages: the dense units must leave them alone
    for layer in layers:
        _shard_experts(layer, dims, device_type)
        if expert_dp is not None:
            fully_shard(layer.experts, mesh=expert_dp, shard_placement_fn=lambda p: Shard(1))
            # an expert's gradient arrives summed over its ep group's losses: summed over the data-parallel
            # replicas of its shard it is the sum over all W ranks' losses, of which the global loss is the mean
            _fsdp_options(layer.experts, device_type, divide=W)
        else:
            # no data-parallel replica (W = ep): only the division by W is left. Not an FSDP unit of one rank,
            # whose reduction divides twice by a custom divide factor (torch 2.13, docs/training.md "Traps")
            loose += list(layer.experts.parameters())
            layer._grad_divide = W
            _divide_grads(layer)
    if data_parallel == "fsdp":
        dense = dims.mesh("dense", device_type)
        dense = dense if dims.dp_replicate > 1 else dense["dp_shard"]
        units = {id(m): m for m in layers}
        units.update((id(c), c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m)
        for unit in [*units.values(), model]:  # inner units first: MoE layers, the blocks holding them, the root
            fully_shard(unit, mesh=dense, ignored_params=_owned(unit, loose))
            _fsdp_options(unit, device_type)
    else:
        from torch.distributed._composable.replicate import replicate

        loose_ids = {id(p) for p in loose}
        # buffers stay per rank, as under FSDP (replicate's DDP holds only the parameters): the routers'
        # expert counts are per-rank buffers that update_expert_bias sums
        replicate(model, device_mesh=dims.mesh("dp", device_type),
                  ignored_modules=[la.experts for la in layers if any(id(p) in loose_ids for p in la.experts.parameters())],
                  **options)
        # DDP built now, not at the first forward (replicate's default): it keeps the parameters that require a
        # gradient when it is built, so one frozen before the first forward would never be all-reduced once thawed
        replicate.state(model).lazy_init()
    _flatten_expert_dims(layers, device_type, expert_mesh, timeout)
    setattr(model, _MARK, f"{dims}, data_parallel={data_parallel!r}")
    return model


def _flatten_expert_dims(layers, device_type: str, expert_mesh, timeout) -> None:
    """A flattened mesh over the dimensions the experts are sharded on (FSDP's and ``ep``), so that a reduction
    over both (the gradient norm's ``full_tensor``) is one collective, not one per dimension, which DTensor warns
    of; the flattened group gets the layout's ``timeout`` too."""
    from torch.distributed.tensor import DTensor

    w = next((p for la in layers for p in la.experts.parameters()), None)
    if not isinstance(w, DTensor):
        return
    names = tuple(w.device_mesh.mesh_dim_names[i] for i, p in enumerate(w.placements) if p.is_shard())
    if len(names) > 1:
        override = _overrides(device_type, _timedelta(timeout), 1)
        expert_mesh[names]._flatten(backend_override=override[0] if override else None)


def materialize(model: nn.Module, device: torch.device | str, state_dict: dict | None = None, *,
                from_rank0: bool = False) -> nn.Module:
    """Give a model built on the ``meta`` device and then parallelized its storage and values; returns it.

    ``model.to_empty(device=device)`` allocates this rank's shards, then every module's ``reset_buffers()``
    (``TopKRouter``, ``NativeSparseAttention``) re-initialises the non-persistent buffers no state dict holds.
    ``state_dict``: the one-process model's full ``state_dict()`` (plain tensors, one-process keys); each rank
    keeps its slice, so the parallel model starts as the seeded one-process model split. ``from_rank0=True``:
    only rank 0 passes it (the others pass None and never hold the full model); it is broadcast
    (``set_model_state_dict`` with ``broadcast_from_rank0``). Without either, load the values next, e.g.
    ``sparseops.distributed.checkpoint.load(path, model)`` (docs/training.md, "Meta-device initialisation").
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if torch.device(device).type == "meta":
        raise ValueError("device: expected a device with storage, got meta")
    if state_dict is not None and not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected None or a dict, got {type(state_dict).__name__}")
    if not isinstance(from_rank0, bool):
        raise TypeError(f"from_rank0: expected a bool, got {type(from_rank0).__name__}")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if state_dict is None and from_rank0 and rank == 0:
        raise ValueError("state_dict: expected the full state dict on rank 0 with from_rank0=True, got None")
    model.to_empty(device=device)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    for p in model.parameters():
        if p._backward_hooks:
            # to_empty swaps a DTensor parameter's tensor: the hook dict stays on the Parameter, the autograd
            # hook that runs it is gone. Setting the dict installs it again (and drops a stale one)
            p._backward_hooks = p._backward_hooks
    if state_dict is not None or from_rank0:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
        set_model_state_dict(model, state_dict if state_dict is not None else {}, options=options)
    return model
