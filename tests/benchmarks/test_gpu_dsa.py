"""benchmarks/gpu_dsa.py's rows on the CPU at tiny sizes (the plumbing of the GPU check's DSA rows): the module row
passes against float64 in fp32, reports (does not gate) bf16, and the timing row skips without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_dsa  # noqa: E402


def test_module_rows_on_the_cpu():
    ctx = {"device": torch.device("cpu")}
    ratio, detail = gpu_dsa.check_dsa_module(ctx, torch.float32)
    assert ratio <= 1.0 and "indexer selections" in detail
    ratio, detail = gpu_dsa.check_dsa_module(ctx, torch.bfloat16)
    assert ratio is None and "not gated" in detail
    ratio, detail = gpu_dsa.check_dsa_module(ctx, torch.float32, autocast=True)  # fp32 parameters, bf16 autocast
    assert ratio is None and "not gated" in detail


def test_timing_row_skips_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the row runs for real in the GPU check")
    with pytest.raises(gpu_dsa.Skip):
        gpu_dsa.check_dsa_speed({"device": torch.device("cpu")})
