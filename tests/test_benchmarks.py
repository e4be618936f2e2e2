"""The benchmark scripts' correctness gates and plumbing, in their tiny ``--smoke`` configuration.

No peers, no timing assertions (speed is measured in ``benchmarks/``, never asserted): this only keeps the
scripts from rotting — the gate against the reference oracle, the result file and the chart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, moe, nsa  # noqa: E402


def _check_record(record: dict, out: Path, name: str) -> None:
    assert record["mode"] == "smoke"
    assert record["rows"], "no rows measured"
    assert record["gate"] and all(c["err"] <= c["tol"] for c in record["gate"])
    saved = json.loads((out / f"{name}.json").read_text())
    assert isinstance(saved, list) and saved[-1]["rows"] == json.loads(json.dumps(record["rows"]))
    assert saved[-1]["env"]["torch"] == torch.__version__
    assert (out / f"{name}.png").stat().st_size > 0


def test_moe_smoke(tmp_path):
    record = moe.run(smoke=True, out=tmp_path)
    _check_record(record, tmp_path, "moe")
    for r in record["rows"]:
        assert r["ours_s"] > 0 and r["floor_s"] > 0 and r["ours_fwdbwd_s"] > 0
        assert r["err_ours_ptg"] <= 1e-2 and r["err_ours_probs_grad"] <= 1e-2


def test_nsa_smoke_cli(tmp_path, capsys):
    assert nsa.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "nsa.json").read_text())[-1]
    _check_record(record, tmp_path, "nsa")
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


def test_gpu_nsa_cpu_smoke(tmp_path):
    """The GPU benchmark's one-shot device run, rehearsed on the CPU under the Triton interpreter (its own
    process): correctness gate, rows with the byte model, tune variants, and the JSON written stage by stage."""
    pytest.importorskip("triton")
    import subprocess

    out = tmp_path / "gpu_nsa.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_nsa.py"), "--cpu-smoke", "--tune", "--out",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["meta"]["stage"] == "done" and d["meta"]["correct"] and d["meta"]["copy_gbps"] > 0
    assert [(x["T"], x["G"], x["selection"]) for x in d["rows"]] == [(48, 2, "uniform"), (48, 1, "uniform"),
                                                                      (48, 2, "nsa")]
    for x in d["rows"]:
        # the byte model: every visible key row gathered once per (token, KV head) in fp32
        assert x["fwd_gather_bytes"] == x["visible_pairs"] * (x["Dqk"] + x["Dv"]) * 4
        assert x["bwd_gather_bytes"] > x["fwd_gather_bytes"] > 0 and x["fwd_gather_gbps"] > 0
        # the forward's plan: every (token, KV head) in one running program; packs load shared blocks once
        assert x["fwd_token_steps"] == x["T"] * x["N2"] * x["K"] and x["fwd_wide_programs"] >= 0
        assert 0 < x["fwd_wide_steps"] + x["fwd_ordinary_steps"] <= x["fwd_token_steps"]
    assert any(v.get("DQ_ATOMIC") for v in d["tune"]) and not any("error" in v for v in d["tune"])
    assert all(v["rel_rms_vs_base"] < 1e-5 for v in d["tune"])  # fp32 under the interpreter
    packing = [{k: v[k] for k in ("selection", "WIDE_ROWS", "WIDE_SHARE", "PACK_ROWS") if k in v}
               for v in d["tune"] if "WIDE_ROWS" in v or v.get("selection") == "nsa"]
    assert packing == [{"WIDE_ROWS": 0}, {"selection": "nsa"}, {"selection": "nsa", "WIDE_ROWS": 0},
                       {"selection": "nsa", "WIDE_SHARE": 1e9}, {"selection": "nsa", "WIDE_SHARE": 0.25},
                       {"selection": "nsa", "WIDE_ROWS": 0, "PACK_ROWS": 32}]


def test_gpu_nsa_compile_check_reports_every_variant():
    """``gpu_nsa.py --compile-check`` (no GPU): each variant's launches with shared memory, registers and spills;
    a variant that does not fit the target GPU is reported, not raised."""
    pytest.importorskip("triton")
    from sparseops import _checks

    if _checks.triton_interpret():
        pytest.skip("needs compiled Triton")
    from benchmarks import gpu_nsa

    rows = gpu_nsa.compile_check(Gs=(2,), cfg=dict(N2=1, Dqk=32, Dv=16, bs=16, K=2), arch=90)
    kernels = {(r["variant"], r["kernel"]) for r in rows}
    assert kernels == {("forward", "nsa_fwd_kernel"), ("backward", "nsa_bwd_dq_kernel"),
                       ("backward", "nsa_bwd_dkv_kernel"), ("deterministic", "nsa_bwd_dq_kernel"),
                       ("deterministic", "nsa_bwd_dkv_kernel"), ("deterministic", "nsa_bwd_reduce_kernel"),
                       ("DQ_ATOMIC", "nsa_bwd_delta_kernel"), ("DQ_ATOMIC", "nsa_bwd_dkv_kernel")}
    assert all(0 < r["registers"] <= 255 and r["shared"] <= 232448 for r in rows)
    rows = gpu_nsa.compile_check(Gs=(32,), cfg=dict(N2=1, Dqk=256, Dv=256, bs=128, K=2), arch=86)
    assert not any("error" in r for r in rows)
    assert {r["keys"] for r in rows if r["kernel"] == "nsa_bwd_dq_kernel"} == {64}  # 128-key blocks in 2 steps
    from sparseops import _triton

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_triton.SHARED_LIMIT, 86, 1024)  # a GPU with (much) less: every variant reported, none raised
        rows = gpu_nsa.compile_check(Gs=(2,), cfg=dict(N2=1, Dqk=32, Dv=16, bs=16, K=2), arch=86)
    assert [r["variant"] for r in rows if "error" in r] == ["forward", "backward", "deterministic", "DQ_ATOMIC"]
