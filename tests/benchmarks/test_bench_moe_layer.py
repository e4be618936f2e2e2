"""benchmarks/moe_layer.py in its tiny ``--smoke`` configuration: the float64 gate runs before anything is
timed, and the run is written where ``--out`` says. No timing assertions (speed is measured, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import moe_layer  # noqa: E402


def test_moe_layer_smoke(tmp_path, capsys):
    assert moe_layer.main(["--smoke", "--no-ep", "--no-peers", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "moe_layer.json").read_text())[-1]
    assert record["mode"] == "smoke"
    assert record["gate"] and all(g["err"] <= g["tol"] for g in record["gate"])
    assert {r["dtype"] for r in record["rows"]} == {"fp32", "bf16", "fp32 autocast bf16"}
    assert all(r["ours_s"] > 0 and r["floor_s"] > 0 for r in record["rows"])
    assert "| fp32 |" in capsys.readouterr().out
