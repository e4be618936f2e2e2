"""benchmarks/nsa.py in its tiny ``--smoke`` configuration: the gate, the record, the chart, the FLOP
model, the goals column. No timing assertions (speed is measured, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import nsa  # noqa: E402
from tests.benchmarks.records import check_record  # noqa: E402


def test_nsa_smoke_cli(tmp_path, capsys):
    assert nsa.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "nsa.json").read_text())[-1]
    check_record(record, tmp_path, "nsa")
    assert "ours fwd+bwd ms" in capsys.readouterr().out
    for r in record["rows"]:
        assert r["ours_fwdbwd_s"] > 0 and r["visible_pairs"] > 0


def test_visible_pairs_counts_the_causal_mask():
    # one sequence of 5 tokens, bs=2, blocks {0, 2, -1}: token t sees keys <= t of block 0 (keys 0, 1) and of
    # block 2 (key 4 only: the sequence ends there)
    topk = torch.tensor([[[0, 2, -1]]] * 5, dtype=torch.int32)
    want = sum(min(2, t + 1) + (1 if t >= 4 else 0) for t in range(5))
    assert nsa.visible_pairs(topk, [5], [5], bs=2, G=3, causal=True) == 3 * want
    assert nsa.visible_pairs(topk, [5], [5], bs=2, G=1, causal=False) == 5 * 3


def test_flop_count_formula():
    # per visible pair: fwd S=QK^T, O=PV; bwd S again, dV, dP, dQ, dK
    assert nsa.flops_per_pair(192, 128) == {"fwd": 640, "bwd": 1664, "fwdbwd": 2304}


