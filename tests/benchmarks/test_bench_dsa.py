"""benchmarks/dsa.py in its tiny ``--smoke`` configuration: the float64 correctness gate runs before anything is
timed, and the run is written where ``--out`` says. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import dsa  # noqa: E402


def test_dsa_smoke(tmp_path):
    assert dsa.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "dsa.json").read_text())[-1]
    assert record["mode"] == "smoke" and len(record["checks"]) == 3
    assert [r["T"] for r in record["rows"]] == [128] and [r["T"] for r in record["warmup"]] == [128]
    assert all(r["ours_fwdbwd_s"] > 0 and r["dense_fwdbwd_s"] > 0 for r in record["rows"])
    assert all(r["dense_loss_s"] > 0 and r["listed_loss_s"] > 0 for r in record["warmup"])
