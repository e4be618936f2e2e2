"""sparseops.distributed.spawn: a failing rank's traceback, a timeout instead of a hang."""

from __future__ import annotations

import time

import pytest

from sparseops.distributed import SpawnError, spawn

pytestmark = pytest.mark.distributed


def _ok(rank, ws):
    return rank


def _fails_on_rank_1(rank, ws):
    if rank == 1:
        raise KeyError("boom on rank one")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for a peer that is gone: the parent must not wait with it


# results in rank order and one thread per worker: tests/distributed/test_collectives.py


def _hangs(rank, ws):
    time.sleep(600)


def test_spawn_reports_the_failing_rank():
    with pytest.raises(SpawnError, match=r"(?s)rank 1 of 2 raised.*KeyError: 'boom on rank one'"):
        spawn(_fails_on_rank_1, 2, timeout=120.0)


def test_spawn_times_out_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"did not finish within timeout=2"):
        spawn(_hangs, 2, timeout=2.0)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("kw, match", [({"world_size": 0}, "world_size"), ({"backend": "mpi"}, "backend"),
                                       ({"timeout": 0}, "timeout"), ({"threads": 0}, "threads"),
                                       ({"threads": 1.5}, "threads")])
def test_spawn_bad_arguments(kw, match):
    args = {"world_size": 2, "backend": "gloo", "timeout": 10.0} | kw
    with pytest.raises(ValueError, match=match):
        spawn(_ok, args.pop("world_size"), **args)


def test_spawn_refuses_a_non_callable_before_starting_processes():
    with pytest.raises(TypeError, match="^fn: expected a callable .*got NoneType"):
        spawn(None, 2, timeout=10.0)
