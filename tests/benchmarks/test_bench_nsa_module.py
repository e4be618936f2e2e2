"""benchmarks/nsa_module.py in its tiny ``--smoke`` configuration: the correctness gate against the float64
references runs before anything is timed, and the run is written where ``--out`` says. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import nsa_module  # noqa: E402


def test_nsa_module_smoke(tmp_path):
    assert nsa_module.main(["--smoke", "--no-peers", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "nsa_module_smoke.json").read_text())
    assert record["smoke"] and record["checks"]
    assert [r["T"] for r in record["core"]] == [256, 512]
    assert all(r["ours_fwdbwd_s"] > 0 and r["sdpa_fwdbwd_s"] > 0 for r in record["core"])
