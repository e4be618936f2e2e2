"""Faults of a ``sparseops train`` run: the error that ends it naming the step (or the recall evaluation at the
end), and the test-only injection (docs/training.md, "Faults").

``SPARSEOPS_TRAIN_FAULT=<kind>:rank=<r>:step=<s>`` (tests only) makes rank ``r`` misbehave at step ``s``
(``s`` counts from 0, before the step's first collective); ``:restart=<n>`` added, only in torchrun's attempt ``n``
(``TORCHELASTIC_RESTART_COUNT``, 0 in the first launch; 0 without torchrun), so that a job under
``torchrun --max-restarts`` fails once and its restart runs clean:

- ``hang``: sleeps forever (a rank that stops responding: the others' collectives time out after
  ``--comm-timeout``);
- ``kill``: kills itself with SIGKILL (a rank that dies: torchrun ends the job);
- ``nan``: its loss becomes NaN (every rank stops before the optimizer step).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from .._checks import first_line

FAULT_ENV = "SPARSEOPS_TRAIN_FAULT"
FAULT_KINDS = ("hang", "kill", "nan")
#: torchrun's count of the worker group's restarts, in each worker's environment
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


class TrainingStopped(RuntimeError):
    """The run stopped at ``step``: a non-finite loss or gradient, or a collective that failed or timed out.
    ``where``: the part of the run that stopped, when not the step itself (:func:`evaluation_where`)."""

    def __init__(self, step: int, message: str, where: str | None = None):
        super().__init__(f"{where or f'step {step}'}: {message}")
        self.step = step


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    #: the torchrun attempt it happens in (None: every attempt)
    restart: int | None = None

    def at(self, step: int, rank: int, restart: int = 0) -> bool:
        return self.step == step and self.rank == rank and self.restart in (None, restart)


def parse_fault(text: str | None) -> Fault | None:
    """``"hang:rank=1:step=3"`` -> ``Fault("hang", 1, 3)``, ``"kill:rank=1:step=3:restart=0"`` ->
    ``Fault("kill", 1, 3, 0)``; None or ``""`` -> None.

    Raises:
        ValueError: naming :data:`FAULT_ENV`, the expected form and the value.
    """
    if not text:
        return None
    parts = text.split(":")
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    ok = (len(parts) == len(fields) + 1 and parts[0] in FAULT_KINDS
          and set(fields) in ({"rank", "step"}, {"rank", "step", "restart"}) and all(v.isdigit() for v in fields.values()))
    if not ok:
        raise ValueError(f"{FAULT_ENV}: expected '<kind>:rank=<r>:step=<s>' (and optionally ':restart=<n>') with kind "
                         f"in {FAULT_KINDS}, got {text!r}")
    restart = fields.get("restart")
    return Fault(parts[0], int(fields["rank"]), int(fields["step"]), None if restart is None else int(restart))


def restart_count() -> int:
    """torchrun's attempt of this worker (``TORCHELASTIC_RESTART_COUNT``; 0 without torchrun)."""
    return int(os.environ.get(RESTART_ENV, "0"))


def fault_from_env() -> Fault | None:
    return parse_fault(os.environ.get(FAULT_ENV))


def inject(fault: Fault | None, step: int, rank: int) -> bool:
    """Act out ``fault`` when it is due at ``(step, rank)``: hang or die here; True for ``nan`` (the caller
    poisons its loss)."""
    if fault is None or not fault.at(step, rank, restart_count()):
        return False
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def nonfinite_ranks(flags: torch.Tensor) -> list[int]:
    """The ranks whose entry of the all-reduced ``[W]`` flag vector is set."""
    return [int(r) for r in torch.nonzero(flags).reshape(-1).tolist()]


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: CUDA's ``OutOfMemoryError``, or the CPU allocator's
    ``RuntimeError`` (a request beyond what the kernel grants; one the kernel grants and then cannot back ends the
    process instead, without a message)."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def memory_failure(step: int, rank: int, exc: BaseException) -> TrainingStopped:
    """The error of an allocation that failed on this rank in a step (the batch's activations, mostly)."""
    return TrainingStopped(step, f"{type(exc).__name__} on rank {rank}: {first_line(exc)} (out of memory: a smaller "
                                 "--global-batch or --seq-len, more --micro-batches or ranks, or "
                                 "--activation-checkpointing)")


def collective_failure(step: int, rank: int, timeout: float, exc: BaseException,
                       where: str | None = None) -> TrainingStopped:
    """The error of a collective that raised on this rank (a peer stopped responding or died) in ``step``, or in
    ``where`` (:class:`TrainingStopped`)."""
    return TrainingStopped(step, f"{type(exc).__name__} on rank {rank}: {first_line(exc)} (a collective that failed here: a "
                                 f"rank did not respond within --comm-timeout {timeout:g} s, or died)", where)


def evaluation_where(steps: int) -> str:
    """The end-of-run recall evaluation after ``steps`` steps, as :class:`TrainingStopped` names it."""
    return f"the recall evaluation after {steps} step{'s' * (steps != 1)}"


def evaluation_memory_failure(steps: int, rank: int, exc: BaseException, saved: str | None) -> TrainingStopped:
    """The error of an allocation that failed on this rank in the end-of-run recall evaluation (the activations of
    its ``--eval-batch`` sequences, shared by the data-parallel ranks). ``saved``: the checkpoint that holds the
    trained model, which a resume at ``--steps steps`` evaluates without training (None: none)."""
    rerun = (f"; the trained model is saved in {saved}: --resume {saved} --steps {steps} with a smaller --eval-batch "
             "evaluates it without training" if saved is not None else "")
    return TrainingStopped(steps, f"{type(exc).__name__} on rank {rank}: {first_line(exc)} (out of memory: a smaller "
                                  f"--eval-batch, or --eval-sequences 0 to skip the evaluation{rerun})",
                           evaluation_where(steps))
