"""benchmarks/gpu_nsa.py without a GPU: its CPU rehearsal under the Triton interpreter and its offline
compile check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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


def test_gpu_nsa_cpu_smoke_leaves_the_recorded_results_alone(tmp_path):
    """`python benchmarks/gpu_nsa.py --cpu-smoke` (docs/nsa.md) wrote benchmarks/results/gpu_nsa.json, the GPU runs'
    record; the rehearsal writes only where --out says, a GPU run to the default."""
    pytest.importorskip("triton")
    from benchmarks import gpu_nsa

    assert gpu_nsa.output_path(str(gpu_nsa.DEFAULT_OUT), smoke=True) is None
    assert gpu_nsa.output_path(str(gpu_nsa.DEFAULT_OUT), smoke=False) == gpu_nsa.DEFAULT_OUT
    assert gpu_nsa.output_path(str(tmp_path / "x.json"), smoke=True) == tmp_path / "x.json"
