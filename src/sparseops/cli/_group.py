"""The process group of a ``sparseops train`` launch under torchrun: which ranks print a launch check's message,
and joining the group with a failure named instead of torch's traceback (docs/training.md, "Faults")."""

from __future__ import annotations

import datetime
import os
import sys


class GroupFailed(RuntimeError):
    """``init_process_group`` failed or timed out: the message says what torch said and the likely causes."""


def report_launch_problem(problem: object, rank: int, local_rank: int) -> None:
    """Print a failed launch check (before any collective): rank 0's message, and each other node's first rank's
    (``LOCAL_RANK`` 0), prefixed with its rank. A node may see other files or flags than rank 0's (``--save``,
    ``--resume``, a token file), and a rank that exits here never joins the group, so its message is the only word
    of why the others time out at the rendezvous; ranks on one node see the same, and print nothing more."""
    if rank == 0 or local_rank == 0:
        print(f"sparseops train: {f'rank {rank}: ' if rank else ''}{problem}", file=sys.stderr, flush=True)


def join(device, timeout: float, world: int) -> None:
    """``init_process_group`` over torchrun's environment: on a CUDA ``device`` (made the current one) NCCL for
    CUDA tensors and gloo for CPU ones, gloo alone on the CPU; every collective's timeout (and the rendezvous's)
    ``timeout`` seconds.

    Raises:
        GroupFailed: the group did not form (a rank that failed its launch checks exits 2 without joining, a rank
            that never started, an unreachable ``MASTER_ADDR:MASTER_PORT``): naming ``--comm-timeout``, the
            address and torch's own first line.
    """
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's DistStoreError, DistNetworkError and backend errors are RuntimeErrors
        said = (str(exc).strip().splitlines() or [""])[0]
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise GroupFailed(
            f"the process group of {world} ranks did not form at {where} within --comm-timeout {timeout:g} s "
            f"({type(exc).__name__}: {said}): a rank that failed its launch checks exits 2 without joining (its "
            "message is in its node's output), or a rank did not start") from None
