"""Fixtures shared by the test suite."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fresh_python():
    """``fresh_python(code, drop_env=(), **env)``: ``code`` run by a new interpreter in the checkout's root, with its
    src/ first on the path, the variables ``drop_env`` unset and ``env`` set; the ``CompletedProcess`` (text output
    captured, 120 s timeout). Thread-safe: a test may run several at once."""

    def run(code: str, drop_env: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
        full = {k: v for k, v in os.environ.items() if k not in drop_env}
        full["PYTHONPATH"] = str(REPO / "src") + os.pathsep + full.get("PYTHONPATH", "")
        full.update(env)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=REPO,
                              timeout=120)

    return run


@pytest.fixture
def override():
    """``override(SETTINGS, **knobs)``: change a backend's tuning knobs for the rest of the test.

    The settings object's own context manager (``SETTINGS.override``), entered now and left when the test ends,
    so that a test chooses a code path the way a tuning script does, without touching module globals.
    """
    with contextlib.ExitStack() as stack:
        yield lambda settings, **knobs: stack.enter_context(settings.override(**knobs))


def _dense(t):
    return t.to_dense() if t.layout != torch.strided else t


@pytest.fixture
def untouched():
    """``check = untouched(tensors)`` copies a mapping's tensors now; ``check()`` later asserts that none was written
    (sparse ones compared densely): a failing call must leave the caller's tensors as they were."""

    def snapshot(tensors: dict):
        before = {k: v.clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}

        def check():
            for k, v in before.items():
                assert torch.equal(_dense(tensors[k]), _dense(v)), f"caller tensor {k} was modified"

        return check

    return snapshot


@pytest.fixture(params=["cpu-kernels", "torch-ops"])
def cpu_paths(request, monkeypatch):
    """Runs a test twice: on the C++ CPU kernels (skipped where they do not build) and on the torch ops
    (``SPARSEOPS_CPU_KERNELS=0``): ``pytestmark = pytest.mark.usefixtures("cpu_paths")``."""
    if request.param == "torch-ops":
        monkeypatch.setenv("SPARSEOPS_CPU_KERNELS", "0")
        return
    from sparseops.dsa import indexer
    from sparseops.nsa import cpu_gather

    if not (cpu_gather.available(torch.zeros(1)) and indexer.EXTENSION.available(torch.zeros(1))):
        pytest.skip("the C++ CPU kernels are not built here")


@pytest.fixture
def nan_uninitialised(monkeypatch):
    """The C++ attention kernels' outputs allocated full of NaN instead of uninitialised
    (``sparseops._cpu_attention.uninitialised``): an element a kernel does not write shows up in the comparison."""
    from sparseops import _cpu_attention

    monkeypatch.setattr(_cpu_attention, "uninitialised",
                        lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype))


@pytest.fixture
def one_thread():
    """One torch thread for the test (the EP ranks' thread count: MKL rounds some small GEMMs, 5-11 rows,
    differently with two threads than with one)."""
    from sparseops.testing import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def eager_cpu_kernels():
    """The library's eager CPU kernels in this process and in every subprocess it starts (``SPARSEOPS_COMPILE=0``):
    each fresh torchrun rank would otherwise spend its first step compiling them. Oracle and parallel runs use
    the same kernels; the compiled ones under torchrun are tests/cli/test_demo.py's (the EP rerun, bitwise).
    ``pytestmark = pytest.mark.usefixtures("eager_cpu_kernels")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSEOPS_COMPILE", "0")
        yield
