"""The peers the quick benchmarks compare with (the Makefile installs them: benchmarks/peers-cpu.txt and the
``transformers`` extra) import and run through each script's own peer code, at the smoke shapes (transformers:
benchmarks/moe_layer.py's smoke run, in tests/test_make_run.py). A peer that
is not installed skips; one that is installed but does not import or run fails (a quick benchmark would
otherwise print "unavailable" and an empty side-by-side table)."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as C  # noqa: E402


def _installed(dist: str) -> None:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} not installed (make installs it: benchmarks/peers-cpu.txt)")


def _floors():
    return C.measure_floors(copy_mb=16, matmul_n=256, budget_s=0.05)


def test_megatron_core_unpermute_agrees():
    _installed("megatron-core")
    from benchmarks import moe

    unpermute, why = C.load_peer("megatron.core.transformer.moe.moe_utils", "unpermute")
    assert unpermute is not None, why
    row = moe.bench_case(moe.build_case(moe._configs(False, True)[0]), _floors(), unpermute, quick=False, smoke=True)
    assert row["megatron_agrees"], row.get("megatron_error", row)


def test_fla_naive_nsa_agrees():
    _installed("fla-core")
    from benchmarks import nsa

    naive, why = C.load_peer("fla.ops.nsa.naive", "naive_nsa_selection")
    assert naive is not None, why
    row = nsa.bench_case(nsa.build_case(nsa._configs(False, True)[0]), _floors(), naive, quick=False, smoke=True)
    assert row["fla_agrees"], {k: v for k, v in row.items() if "fla" in k}


def test_native_sparse_attention_pytorch_runs():
    _installed("native-sparse-attention-pytorch")
    from benchmarks import nsa_module

    row = nsa_module.bench_peer(128, runs=1, warmup=0)
    assert "peer_skipped" not in row, row["peer_skipped"]
    assert row["peer_fwdbwd_s"] > 0 and row["ours_fwdbwd_s"] > 0
