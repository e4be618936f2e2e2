"""Every step of ``make run``, run as the Makefile runs it (the ``sparseops`` console script, in another working
directory) at a small size sharing the step's code path; the recipe is read from the Makefile, so a step added
there without a small form here fails. None of them may change ``git status`` of the checkout."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: each step of the ``run`` recipe -> the arguments of its small form
SMALL = {
    "sparseops info": ["info"],
    "sparseops check": ["check", "--tiny", "--dtype", "fp32"],
    "sparseops demo --quick": ["demo", "--quick", "--steps", "3"],
    # every subject, the moe_layer EP = 2 run among them (its worker re-imported in spawned processes)
    "sparseops bench --quick": ["bench", "--smoke"],
}


def run_recipe() -> list[str]:
    """The commands of the Makefile's ``run`` target, ``$(BIN)/`` dropped."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(r"^run\s*:", ln))
    steps = []
    for ln in lines[start + 1:]:
        if not ln.startswith("\t"):
            break
        steps.append(ln.strip().replace("$(BIN)/", ""))
    return steps


def _command() -> list[str]:
    script = Path(sys.executable).parent / "sparseops"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sparseops"]


def _git_status() -> str | None:
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def test_every_step_of_make_run_has_a_small_form():
    assert run_recipe() == list(SMALL)


@pytest.mark.parametrize("step", [pytest.param(s, marks=pytest.mark.distributed) if "bench" in s else s for s in SMALL])
def test_make_run_step(step, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("SPARSEOPS_BENCHMARKS", None)
    before = _git_status()
    r = subprocess.run(_command() + SMALL[step], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert "FAILED" not in r.stdout, text[-4000:]
    if step.startswith("sparseops bench"):
        for name in ("moe", "nsa", "moe_layer", "nsa_module", "dsa"):
            assert f"== benchmarks/{name}.py --smoke" in r.stdout and f"({name} took" in r.stdout, text[-4000:]
        assert "EP = 2 (gloo" in r.stdout  # the moe_layer EP section ran in spawned processes
        assert "[moe" in r.stderr and "correctness gate" in r.stderr  # each stage named as it starts
        if importlib.util.find_spec("transformers") is not None:  # the peer of moe_layer's smoke run
            assert "peer grouped_mm" in r.stderr and "peer eager" in r.stderr, r.stderr[-4000:]
    if step.startswith("sparseops demo"):
        assert "nsa" in r.stdout and "window_only" in r.stdout and (tmp_path / "sparseops-results" / "demo").is_dir()
    if before is not None:
        assert _git_status() == before, f"`{step}` changed git status of the checkout"
