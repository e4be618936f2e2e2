"""benchmarks/moe.py in its tiny ``--smoke`` configuration: the correctness gate, the record, the chart,
the Megatron input mapping, the goals column. No timing assertions (speed is measured, never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import moe  # noqa: E402
from tests.benchmarks.records import check_record  # noqa: E402


def test_moe_smoke(tmp_path):
    record = moe.run(smoke=True, out=tmp_path)
    check_record(record, tmp_path, "moe")
    for r in record["rows"]:
        assert r["ours_s"] > 0 and r["floor_s"] > 0 and r["ours_fwdbwd_s"] > 0
        assert r["err_ours_ptg"] <= 1e-2 and r["err_ours_probs_grad"] <= 1e-2


def test_megatron_inputs_describe_our_window():
    """Rows s..e of the expert-sorted buffer are exactly the local experts' slots, in Megatron's order."""
    case = moe.build_case({"T": 50, "K": 3, "H": 4, "E": 8, "dtype": "fp32", "window": "quarter"})
    si, order = moe.sorted_indices_of(case["indices"])
    assert torch.equal(si[order.long()].long(), torch.arange(150))
    rows = order[case["s"]:case["e"]]
    experts = case["indices"].reshape(-1)[rows]
    assert bool(((experts >= case["e0"]) & (experts < case["e1"])).all())
    assert torch.equal(case["meg_sorted_indices"], rows // 3)
    assert int(case["meg_routing_map"].sum()) == case["e"] - case["s"] == case["permuted_tokens"].shape[0]




def test_goals_say_dash_where_the_row_has_no_number(tmp_path, capsys):
    """Without the peer there is no speedup to hold to its goal: the column says —, not n/a or missed."""
    assert moe.main(["--smoke", "--out", str(tmp_path), "--no-plot"]) == 0
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("| 48 ")]
    assert rows and all(line.rstrip(" |").split("| ")[-1].startswith("—, ") for line in rows), out
    assert "n/a" not in out
    assert "correctness gate vs the float64 reference: 12/12 within tolerance" in out
    # the steps, announced from the start of the run
    assert "[moe 1/4 0:00] correctness gate" in err and "shape 2/2" in err
