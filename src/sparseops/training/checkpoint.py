"""DCP checkpoints of a ``sparseops train`` run: ``DIR/step_<s>`` holds the model, the optimizer, the scheduler,
the step, every rank's RNG state and the data position (docs/training.md, "Checkpoints and resume").

The model and optimizer go through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict``), which writes every parameter under its one-process name and global shape, so a
checkpoint loads at any layout. The rest is one :class:`TrainState` (a DCP ``Stateful``). A checkpoint is
complete when DCP's ``.metadata`` file exists: the coordinator writes it last, after every rank's data.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .._checks import fmt_exc

#: ``DIR/step_<s>``: the checkpoint after ``s`` steps
_NAME = re.compile(r"step_(\d+)")
METADATA = ".metadata"


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``DIR/step_<step>``."""
    return Path(directory) / f"step_{step}"


def scan(directory: str | os.PathLike) -> tuple[list[tuple[int, Path]], list[Path]]:
    """``(complete, incomplete)`` checkpoints of ``directory``: complete ones as ``(step, path)`` by step."""
    complete, incomplete = [], []
    root = Path(directory)
    if root.is_dir():
        for child in root.iterdir():
            m = _NAME.fullmatch(child.name)
            if m and child.is_dir():
                if (child / METADATA).is_file():
                    complete.append((int(m.group(1)), child))
                else:
                    incomplete.append(child)
    return sorted(complete), sorted(incomplete)


def in_the_way(directory: str | os.PathLike) -> list[Path]:
    """The entries of ``directory`` named ``step_<s>`` that are not directories: a save to that step would fail."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.fullmatch(p.name) and not p.is_dir())


def newest_complete(directory: str | os.PathLike, flag: str = "--resume") -> tuple[int, Path]:
    """The newest complete checkpoint of ``directory`` as ``(step, path)``, or ``directory`` itself when it is a
    complete checkpoint ``step_<s>`` (to resume from an earlier one than the newest).

    Incomplete ones newer than it (a run stopped while saving) are skipped with a warning.

    Raises:
        ValueError: ``directory`` holds no complete checkpoint (named with ``flag``).
    """
    root = Path(directory)
    named = _NAME.fullmatch(root.name)
    if named and (root / METADATA).is_file():
        return int(named.group(1)), root
    complete, incomplete = scan(directory)
    if not complete:
        what = "does not exist" if not root.exists() else "is not a directory" if not root.is_dir() else (
            f"holds no complete checkpoint (step_<s> with {METADATA})"
            + (f"; incomplete: {', '.join(p.name for p in incomplete)}" if incomplete else ""))
        raise ValueError(f"{flag}: expected a directory with a complete checkpoint, or a complete checkpoint "
                         f"DIR/step_<s>, got "
                         f"{os.fspath(directory)!r}, which {what}")
    step, path = complete[-1]
    for p in incomplete:
        if int(_NAME.fullmatch(p.name).group(1)) > step:
            warnings.warn(f"{p} is incomplete (no {METADATA}: the run stopped while saving it); resuming from "
                          f"{path.name}", stacklevel=2)
    return step, path


def read_values(path: str | os.PathLike, keys) -> dict:
    """``{key: value}`` of the checkpoint's non-tensor entries ``keys`` (DCP's flat names, such as
    ``"optim.param_groups.0.initial_lr"``); keys the checkpoint lacks are left out. Reads in this process alone
    (``no_dist``: no collective), so ``sparseops train`` checks a resume before its process group exists."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    saved = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    keys = [k for k in keys if isinstance(saved.get(k), BytesStorageMetadata)]
    nested: dict = {}
    for k in keys:  # DCP names a nested dict's entries by their dotted path
        *parents, leaf = k.split(".")
        d = nested
        for part in parents:
            d = d.setdefault(part, {})
        d[leaf] = None
    if keys:
        with _one_process_quiet():
            dcp.load(nested, checkpoint_id=os.fspath(path), no_dist=True)
    out = {}
    for k in keys:
        d = nested
        for part in k.split("."):
            d = d[part]
        out[k] = d
    return out


def _rng_key(rank: int) -> str:
    return f"rank_{rank}"


def rng_state(device: torch.device) -> torch.Tensor:
    """This process's torch RNG state (CPU, then the CUDA device's when on CUDA) as one uint8 tensor."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    n = torch.get_rng_state().numel()
    torch.set_rng_state(state[:n].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[n:].clone(), device)


class TrainState(Stateful):
    """The step, the scheduler, the data position and every rank's RNG state, as one DCP ``Stateful``.

    Each rank saves its own RNG state under ``rng.rank_<r>`` (written once: no other rank has the key). On a
    load at another world size a rank without a saved state keeps the one it has (seeded by the run); the
    training itself draws no random numbers outside the data stream, which is saved whole.
    """

    def __init__(self, scheduler, data, rank: int, device: torch.device, settings: dict | None = None):
        self.step, self.scheduler, self.data, self.rank, self.device = 0, scheduler, data, rank, device
        self.settings = dict(settings or {})  # the run's flags (saved; a load leaves them to the CLI's checks)
        self.saved_ranks: set[int] | None = None  # set before a load: the ranks whose RNG the checkpoint holds

    def state_dict(self) -> dict:
        rng = {}
        if self.saved_ranks is None or self.rank in self.saved_ranks:
            rng[_rng_key(self.rank)] = rng_state(self.device)
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "data": self.data.state_dict(),
                 "rng": rng}
        if self.saved_ranks is None and self.settings:  # saving: a load asks for none (older checkpoints lack them)
            state["settings"] = dict(self.settings)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        mine = state["rng"].get(_rng_key(self.rank))
        if mine is not None:
            set_rng_state(mine, self.device)


@contextlib.contextmanager
def _one_process_quiet():
    """Without a process group DCP warns that it saves / loads in one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class LoadFailed(RuntimeError):
    """A checkpoint could not be read (a damaged file that the launch checks could not see)."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (on any rank: DCP gathers every rank's write result)."""


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: TrainState) -> None:
    """Write the checkpoint ``path`` (every rank calls it; DCP writes ``.metadata`` last).

    Raises:
        SaveFailed: a rank could not write its part (a full disk, a file in the way): raised on every rank, the
            incomplete ``path`` removed by rank 0 (best effort; a later ``--resume`` skips it anyway).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    train_state.saved_ranks = None
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    try:
        with _one_process_quiet():
            dcp.save(state, checkpoint_id=path)
    except (CheckpointException, OSError) as exc:  # CheckpointException is a BaseException
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise SaveFailed(f"the checkpoint {os.fspath(path)} could not be written: {_first_cause(exc)}") from None


def _first_cause(exc: BaseException) -> str:
    """The first rank's error inside DCP's ``CheckpointException`` (or ``exc`` itself), on one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, err = min(failures.items(), key=lambda kv: kv[0])
        inner = err[0] if isinstance(err, tuple) else err  # DCP pairs each rank's error with its traceback
        return f"rank {rank}: {fmt_exc(inner)}"
    return fmt_exc(exc)


def _saved_rng_ranks(path: Path) -> set[int]:
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = "train.rng.rank_"
    return {int(k[len(prefix):]) for k in keys if k.startswith(prefix)}


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: TrainState,
         flag: str = "--resume") -> int:
    """Restore everything from the checkpoint ``path`` at the current layout; returns the step it holds.

    Raises:
        LoadFailed: a file of ``path`` that does not read, named with ``flag`` (the one that resumes from it).
    """
    from ..distributed.checkpoint import check_compatible

    train_state.saved_ranks = _saved_rng_ranks(path)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    check_compatible({"model": state["model"]}, path)  # another model: a ValueError naming the key, shapes
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_quiet():
            dcp.load(state, checkpoint_id=path)
    except (CheckpointException, OSError, EOFError) as exc:  # on every rank (DCP gathers the read results)
        raise LoadFailed(f"{flag}: the checkpoint {os.fspath(path)} could not be read: {_first_cause(exc)}; a "
                         "damaged checkpoint (resume from an earlier one: --resume DIR/step_<s>)") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    if dist.is_initialized():
        dist.barrier()
    return train_state.step
