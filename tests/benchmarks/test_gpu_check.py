"""benchmarks/gpu_check.py without a GPU: its ``--cpu`` rehearsal (every row at tiny sizes, gloo for NCCL) and
the pieces that decide a row's result."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.distributed
def test_gpu_check_cpu_rehearsal(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {x["name"]: x for x in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert list(rows) == [name for name, _ in gpu_check.CHECKS]
    for name in ("MoELayer fp32", "MoELayer bf16", "MoELayer fp32 under bf16 autocast", "MoELayer EP world size 1",
                 "MoELayer EP world size 2", "NativeSparseAttention fp32", "NativeSparseAttention bf16",
                 "NativeSparseAttention fp32 under bf16 autocast", "NativeSparseAttention fp32 under torch.compile"):
        row = next(v for k, v in rows.items() if k.startswith(name))
        assert row["status"] == "ok" and 0 <= row["ratio"] <= 1, row
    assert "gloo" in rows["MoELayer EP world size 2"]["detail"]
    hf = rows["transformers experts 'sparseops' bf16"]
    if importlib.util.find_spec("sparseops.integrations") is None:
        assert hf["status"] == "skip" and "not importable" in hf["detail"]
    else:
        assert hf["status"] == "ok" and "grouped_mm" in hf["detail"], hf
    for name in ("NSA Triton benchmark (gpu_nsa.py --quick)", "Triton kernel tests, compiled"):
        assert rows[name]["status"] == "skip" and "needs CUDA" in rows[name]["detail"]
    assert rows["sparseops train (a few steps)"]["status"] in ("ok", "skip")
    assert rows["sparseops train --autocast bfloat16"]["status"] in ("ok", "skip")
    assert rows["NativeSparseAttention fp32 under bf16 autocast"]["detail"].endswith("bf16 copy's: True")
    # the table's lines (gloo before torch 2.11 also prints each group's connections on stdout, "[Gloo] Rank 0 is
    # connected to 1 peer ranks. ...", two ranks' lines interleaved)
    table = [x for x in r.stdout.strip().splitlines() if x.startswith("|")]
    assert table[0].startswith("| check | result |") and len(table) == 2 + len(rows)  # one table, a row each


def test_worst_gates_on_the_tolerance_table():
    x = torch.randn(50, dtype=torch.float64)
    ok, _ = gpu_check.worst([("a", x.float(), x)], torch.float32)
    bad, what = gpu_check.worst([("a", x.float(), x), ("b", x + 0.01, x)], torch.float32)
    assert ok <= 1 < bad and "worst b" in what
    r, what = gpu_check.worst([("a", x.float(), x)], torch.float32, reported=[("p", x + 1, x)])
    assert r == ok and "reported only, worst p" in what  # reported, not gated


def test_command_rows_fail_on_a_status_or_a_timeout(tmp_path):
    with pytest.raises(RuntimeError, match="exit status 3"):
        gpu_check._command_row([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30, tmp_path / "a.log")
    with pytest.raises(RuntimeError, match="still running after"):
        gpu_check._command_row([sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path / "b.log")
    assert gpu_check._command_row([sys.executable, "-c", "print('fine')"], 30, tmp_path / "c.log")[1].endswith("fine")
    import time

    with pytest.raises(gpu_check.Skip, match="budget is spent"):
        gpu_check._command_row([sys.executable, "-c", "print('late')"], 30, tmp_path / "d.log", time.monotonic() + 5)


def test_gpu_check_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert gpu_check.main(["--out", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_check_sh_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], timeout=30).returncode == 0


def test_default_out_is_ignored_by_git():
    """`python benchmarks/gpu_check.py --cpu` from the checkout leaves `git status` clean (it wrote ./gpu_check_out)."""
    try:
        r = subprocess.run(["git", "check-ignore", "-q", str(gpu_check.DEFAULT_OUT / "gpu_check.json")], cwd=ROOT,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no git")
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{gpu_check.DEFAULT_OUT} is not ignored by git"
