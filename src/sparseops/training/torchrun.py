"""Run ``sparseops train`` under ``torchrun`` as a subprocess and read its result (the demo's EP rerun).

``python -m torch.distributed.run --standalone --nproc-per-node N -m sparseops train ... --json PATH``: torch's
launcher on a free local rendezvous port; rank 0's ``--json`` is the result. The ranks' ``step <s> loss <x>``
lines feed a progress callback as they come.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

_STEP = re.compile(r"^step (\d+) loss (\S+)$")


class TorchrunError(RuntimeError):
    """The torchrun job exited non-zero or ran past its timeout; the message holds the end of its output."""


def run_torchrun(nproc: int, train_argv: list[str], *, threads: int = 1, timeout: float = 1800.0,
                 on_step: Callable[[int, float, float], None] | None = None) -> dict:
    """``sparseops train *train_argv`` on ``nproc`` local ranks; returns rank 0's ``--json`` result.

    Args:
        nproc: ranks (``--nproc-per-node``).
        train_argv: the flags of ``sparseops train`` (without ``--json``, ``--threads``, ``--log-every``).
        threads: torch threads (and ``OMP_NUM_THREADS``) of every rank.
        timeout: seconds for the whole job; past it the job is killed.
        on_step: called as ``on_step(step, loss, seconds since the launch)`` for each step rank 0 logs.

    Raises:
        TorchrunError: the job failed or timed out.
    """
    import sparseops

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("SPARSEOPS_TRAIN_FAULT", None)
    # the ranks import the sparseops this process runs (a checkout on PYTHONPATH or the installed one)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(sparseops.__file__).parents[1]),
                                                    env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="sparseops-torchrun-") as tmp:
        path = Path(tmp) / "train.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "sparseops", "train", *train_argv, "--threads", str(threads), "--log-every", "1",
               "--json", str(path)]
        tail: collections.deque[str] = collections.deque(maxlen=40)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        start = time.perf_counter()
        try:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                m = _STEP.match(tail[-1])
                if m and on_step is not None:
                    on_step(int(m.group(1)), float(m.group(2)), time.perf_counter() - start)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc != 0 or not path.is_file():
            why = f"ran past its {timeout:g} s timeout" if rc == -9 else f"exited with status {rc}"
            raise TorchrunError(f"torchrun ({' '.join(cmd[3:])}) {why}:\n" + "\n".join(tail))
        return json.loads(path.read_text())
