"""The shared benchmark harness (benchmarks/_common.py, benchmarks/_measure.py): records, timing, peak
memory, the floors, where results go."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, _measure  # noqa: E402


def test_append_json_keeps_previous_runs(tmp_path):
    path = tmp_path / "x.json"
    _common.append_json(path, {"a": 1})
    _common.append_json(path, {"a": float("nan"), "d": torch.bfloat16})
    assert json.loads(path.read_text()) == [{"a": 1}, {"a": None, "d": "bfloat16"}]


def test_peak_memory_sees_temporaries():
    def f():
        a = torch.ones(1 << 20)  # 4 MiB, freed before the end
        b = a * 2  # 4 MiB, returned
        del a
        return b

    peak = _common.peak_memory(f)
    assert peak is None or peak >= 8 * 2**20


@pytest.mark.parametrize("n", [1, 4])
def test_median_time_runs_at_least_min_runs(n):
    calls = []
    t = _common.median_time(lambda: calls.append(1), warmup=1, min_runs=n, max_runs=n, budget_s=0.0)
    assert t["runs"] == n and len(calls) == n + 1 and t["median_s"] >= 0




def test_peak_memory_prints_no_profiler_lines(capfd):
    """The profiler's start/stop lines (kineto writes them to fd 2) do not reach the user."""
    _common.peak_memory(lambda: torch.ones(1 << 10) * 2)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "USDT" not in err, err


def test_quiet_stderr_drops_native_writes_only_inside():
    import os
    import subprocess

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from benchmarks import _measure\n"
            "os.write(2, b'before\\n')\n"
            "with _measure.quiet_stderr():\n    os.write(2, b'inside\\n')\n"
            "os.write(2, b'after\\n')\n")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr
    assert r.stderr.split() == ["before", "after"]


@pytest.mark.parametrize("flags, fp32, bf16, floor", [
    ({"avx2", "fma"}, 100e9, 0.2e9, False),          # the CPU: no bf16 units, emulated
    ({"avx512f", "avx512_bf16"}, 100e9, 150e9, True),
    ({"avx512f", "avx512_bf16"}, 100e9, 10e9, False),  # units named, but bf16 far below fp32: no floor
    ({"fp", "asimd", "bf16"}, 50e9, 60e9, True),      # Arm
    (None, 100e9, 120e9, True),                       # flags unknown: the rates decide
])
def test_bf16_floor_is_named_only_with_bf16_units(flags, fp32, bf16, floor):
    why = _measure.bf16_matmul_units(fp32, bf16, flags=flags)
    assert (why is None) == floor
    f = {"copy_bandwidth_Bps": 1e9, "matmul_fp32_flops": fp32, "matmul_bf16_flops": bf16,
         "matmul_bf16_units": why is None, **({"matmul_bf16_not_a_floor": why} if why else {})}
    line = _measure.floors_line(f)
    assert ("not a floor" in line) == (not floor), line


def test_out_dir_default_is_the_working_directory_and_record_is_on_purpose():
    p = _common.make_parser("x")
    assert _common.out_dir(p.parse_args([])) == Path("sparseops-results")
    assert _common.out_dir(p.parse_args(["--out", "/tmp/x"])) == Path("/tmp/x")
    assert _common.out_dir(p.parse_args(["--record"])) == _common.RESULTS_DIR
    assert _common.report_dir(p.parse_args(["--report"])) == _common.RESULTS_DIR
    with pytest.raises(SystemExit):
        p.parse_args(["--record", "--out", "/tmp/x"])


@pytest.mark.parametrize("read", [_common.last_record,
                                  lambda p: _common.spread_table(p, ("H",), ("ours_s",))])
def test_report_of_a_folder_without_results_names_the_file(tmp_path, read):
    """`python benchmarks/nsa.py --report --out DIR` with no nsa.json in DIR: a message naming it, no traceback."""
    with pytest.raises(SystemExit, match="nsa.json: no such results file"):
        read(tmp_path / "nsa.json")
