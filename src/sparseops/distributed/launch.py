"""Run a function on ``world_size`` spawned processes that form a ``torch.distributed`` group.

Used by the distributed tests and the demo; reusable by anyone who wants a multi-process run on one
machine without ``torchrun``. See docs/moe-layer.md ("Testing and launching").
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("gloo", "nccl")


class SpawnError(RuntimeError):
    """A rank of a :func:`spawn` run raised, died or ran past the timeout; the message holds its traceback."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float, threads: int | None,
            fn: Callable, args: tuple, results) -> None:
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        out = fn(rank, world_size, *args)
        # plain pickle: torch's queue reductions share tensors through the child, which exits now
        msg = (rank, True, pickle.dumps(out))
    except BaseException:  # reported before the group goes down, so the root cause arrives first
        msg = (rank, False, traceback.format_exc())
        results.put(msg)
        msg = None
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone; the result or error is what matters
            pass
    if msg is not None:
        results.put(msg)


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout: float = 60.0,
          threads: int | None = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes and return their results.

    Each process is started with the ``spawn`` method (not fork), joins a process group on a free
    127.0.0.1 port with ``init_process_group(backend, timeout=timeout)`` (so a collective that waits for a
    dead or diverged peer fails instead of hanging) and runs with ``torch.set_num_threads(threads)``.
    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); so must the results.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` inside each process, with the default group set up.
        world_size: number of processes, ``>= 1``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per rank, ``rank % device_count``).
        timeout: seconds for the whole run and for each collective.
        threads: ``torch.set_num_threads`` in each worker (``None`` keeps torch's default).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        SpawnError: a rank raised (the message has the first failing rank's traceback), a process died
            without a result, or the run took longer than ``timeout`` (every process is then terminated).
        ValueError: a bad ``world_size``, ``backend``, ``timeout`` or ``threads``. TypeError: ``fn`` not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable (a module-level function), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected None or an int >= 1, got {threads!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:  # the children read it at start-up, before torch.set_num_threads runs
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, args=(rank, world_size, port, backend, float(timeout), threads, fn,
                                                  args, results), daemon=True)
            p.start()
            procs.append(p)
    finally:
        if threads is not None:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise SpawnError(f"spawn: rank(s) {missing} of {world_size} did not finish within timeout={timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise SpawnError(f"spawn: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                     "before returning a result") from None
                continue
            if not ok:
                errors = [f"spawn: rank {rank} of {world_size} raised:\n{value}"]
                # the peers of a failed rank fail in their next collective: list them after the first error
                grace = time.monotonic() + 1.0
                while time.monotonic() < grace:
                    try:
                        r2, ok2, v2 = results.get(timeout=max(0.01, grace - time.monotonic()))
                    except _queue.Empty:
                        break
                    if not ok2:
                        errors.append(f"then rank {r2} raised:\n{v2}")
                raise SpawnError("\n".join(errors))
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
