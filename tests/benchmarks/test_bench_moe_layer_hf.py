"""benchmarks/moe_layer.py's transformers block rows (experts_implementation sparseops / grouped_mm / eager; fp32,
bf16 and fp32 under bf16 autocast) in the ``--smoke`` configuration: sparseops' output is checked against
grouped_mm's before anything is timed. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _hf_block, moe_layer  # noqa: E402


def test_transformers_block_smoke(tmp_path, capsys):
    assert moe_layer.main(["--smoke", "--only-transformers-block", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "moe_layer.json").read_text())[-1]
    rows = record["transformers_block"]
    assert [r["dtype"] for r in rows] == list(moe_layer.RUNS)  # fp32, bf16, fp32 under bf16 autocast
    for r in rows:
        assert r["check"]["ok"], r["check"]
        assert set(r["impl"]) == set(_hf_block.IMPLS) and all(v["time_s"] > 0 for v in r["impl"].values())
    assert "transformers Qwen3-MoE block" in capsys.readouterr().out
