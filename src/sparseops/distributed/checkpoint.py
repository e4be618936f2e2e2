"""Checkpoints of parallelized (or one-process) models with ``torch.distributed.checkpoint`` (docs/training.md).

DCP does the work: ``get_model_state_dict`` / ``get_optimizer_state_dict`` give every parameter and optimizer
moment under its one-process key at its global shape (the experts as DTensors ``[E, ...]``), ``dcp.save``
writes each shard once, ``dcp.load`` reshards into whatever layout the loading model has. The helpers here
write the optimizer moments of MoE layers built with a raw ``ep_group`` at their global shape too (their
model entries already are, by the layer's state-dict hook), and add the checks DCP leaves to its planner's error
(a ``CheckpointException`` wrapping the first mismatch) or to a failed read: a ``.metadata`` that reads and
files that hold the bytes it records, every key of the loading state present in the checkpoint at the same
shape, and no model entry in the checkpoint that the loading model lacks, each as one ``ValueError`` naming the
file or key (and both shapes), raised before any tensor is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from .expert_parallel import ExpertParallelModule, ep_mesh, is_dtensor


def _flatten(state, prefix: str = "") -> dict:
    """``{"model": {"a.b": t}}`` -> ``{"model.a.b": t}`` (lists by index), as DCP names the saved entries."""
    out = {}
    items = state.items() if isinstance(state, Mapping) else enumerate(state) if isinstance(state, list) else None
    if items is None:
        return {prefix: state}
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (Mapping, list)):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _shape(value) -> torch.Size | None:
    return value.shape if isinstance(value, torch.Tensor) else None


def read_metadata(checkpoint_id: str | os.PathLike):
    """The checkpoint's DCP ``Metadata``, after checking that it reads and that every file it names holds the
    bytes it records (a deleted or truncated shard: a damaged or partial copy), as a ``ValueError`` naming the
    file; reads no tensor data."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.fspath(checkpoint_id)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"checkpoint_id: expected a complete DCP checkpoint (a .metadata file) at {path!r}, "
                         "got none")
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as exc:  # an empty or overwritten .metadata: EOFError, UnpicklingError, ...
        raise ValueError(f"checkpoint_id: expected a readable .metadata in {path!r}, got one that does not read "
                         f"({type(exc).__name__}: {exc}): a damaged checkpoint") from None
    need: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            got = "no such file" if size is None else f"{size} bytes"
            raise ValueError(f"checkpoint_id: expected {file!r} of at least {end} bytes (as the checkpoint's "
                             f".metadata records), got {got}: a damaged or partial checkpoint")
    return meta


def check_compatible(state_dict: Mapping, checkpoint_id: str | os.PathLike,
                     whole: tuple[str, ...] = ("model",)) -> None:
    """Raise ``ValueError`` unless every tensor of ``state_dict`` is in the checkpoint at the same global shape,
    and the checkpoint holds no entry under the top-level names ``whole`` that ``state_dict`` lacks.

    Reads only the checkpoint's ``.metadata``: no collective, no tensor data. A DTensor's shape is its global
    shape, so a layout of another ``ep`` or world size is compatible; another E, H or F is not, nor a model with
    fewer layers or experts than the checkpoint's (DCP would load it partially, the rest dropped). The checkpoint
    is checked by :func:`read_metadata` first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (isinstance(whole, tuple) and all(isinstance(w, str) for w in whole)):
        raise TypeError(f"whole: expected a tuple of top-level names (str), got {whole!r}")
    path = os.fspath(checkpoint_id)
    saved = read_metadata(path).state_dict_metadata
    for key, value in _flatten(state_dict).items():
        if key not in saved:
            hint = " (a checkpoint saved without an optimizer?)" if key.startswith("optim.") else ""
            raise ValueError(f"checkpoint_id: expected the key {key!r} in the checkpoint {path!r}, got no such key"
                             + hint)
        shape = _shape(value)
        meta = saved[key]
        if shape is not None and isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(shape):
            raise ValueError(f"checkpoint_id: expected {key!r} of shape {list(shape)} (the model's), got "
                             f"{list(meta.size)} in the checkpoint {path!r}")
    flat = _flatten({k: v for k, v in state_dict.items() if k in whole})
    extra = sorted(k for k in saved if k.split(".", 1)[0] in whole and k not in flat)
    if extra:
        raise ValueError(f"checkpoint_id: expected no entry the model lacks in the checkpoint {path!r}, got "
                         f"{len(extra)}: {', '.join(map(repr, extra[:3]))}{', ...' if len(extra) > 3 else ''} "
                         "(a checkpoint of a larger model)")


def _raw_expert_params(model: nn.Module) -> dict:
    """``{fqn: layer}`` of the local experts of MoE layers built with a raw ``ep_group`` (plain tensors)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelModule) and m.ep_size > 1 and m.batch_group is None:
            for pname, p in m.experts.named_parameters(recurse=False):
                if not is_dtensor(p):
                    out[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = m
    return out


def _optim_to_global(model: nn.Module, optim_state: dict) -> dict:
    """The optimizer moments of raw-``ep_group`` experts as DTensors of the global shape (sharing storage), so
    that DCP writes every rank's block once instead of one rank's under the shared key; 0-dim entries (Adam's
    ``step``, the same on every rank) stay."""
    from torch.distributed.tensor import DTensor, Shard

    raw = _raw_expert_params(model)
    for fqn, moments in optim_state.get("state", {}).items():
        layer = raw.get(fqn)
        if layer is None:
            continue
        for k, v in list(moments.items()):
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and not isinstance(v, DTensor):
                shape = torch.Size((layer.num_experts, *v.shape[1:]))
                moments[k] = DTensor.from_local(v, ep_mesh(layer, v.device.type), [Shard(0)], run_check=False,
                                                shape=shape, stride=torch.empty(shape, device="meta").stride())
    return optim_state


def _optim_to_local(model: nn.Module, optim_state: dict) -> dict:
    """The inverse of :func:`_optim_to_global` after a load: this rank's block of each moment."""
    raw = _raw_expert_params(model)
    for fqn, moments in optim_state.get("state", {}).items():
        if fqn in raw:
            for k, v in list(moments.items()):
                if hasattr(v, "to_local"):
                    moments[k] = v.to_local()
    return optim_state


def save(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         **extra) -> None:
    """``dcp.save({"model": ..., "optim": ..., **extra})`` with DCP's state-dict helpers.

    ``extra``: further entries (tensors, ints, dicts of them, or objects with ``state_dict``), saved under
    their names. Every rank calls it; each shard is written once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = _optim_to_global(model, get_optimizer_state_dict(model, optimizer))
    state.update(extra)
    dcp.save(state, checkpoint_id=os.fspath(checkpoint_id))


def load(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         **extra) -> dict:
    """Load a :func:`save` checkpoint into ``model`` (and ``optimizer``), at whatever layout ``model`` has.

    :func:`check_compatible` runs first (on the model, the optimizer's moments and ``extra``), so an incompatible
    checkpoint, or one saved without an optimizer, raises ``ValueError`` before any tensor is loaded. ``extra``: entries to load in place (their current values give the structure); returned
    as loaded. Works in one process without a process group too (DCP's no-process-group mode)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = _optim_to_global(model, get_optimizer_state_dict(model, optimizer))
    state.update(extra)
    # the optimizer's moments too (its param_groups are DCP entries of their own, not flattened as _flatten does):
    # a checkpoint without them raised DCP's CheckpointException, a BaseException, from its planner
    checked = {k: v for k, v in state.items() if k != "optim"}
    if optimizer is not None:
        checked["optim"] = {"state": state["optim"].get("state", {})}
    check_compatible(checked, checkpoint_id)
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_id))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _optim_to_local(model, state["optim"]))
    return {k: state[k] for k in extra}
