"""Which backend ``auto`` picks (no CUDA needed: the choice is a pure function of device and dtype)."""

import pytest
import torch

from sparseops import _checks
from sparseops.nsa import api


@pytest.fixture
def triton_importable(monkeypatch):
    monkeypatch.setattr(_checks, "triton_available", lambda: True)


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        ("cpu", torch.float32, "torch"),
        ("cuda", torch.bfloat16, api.AUTO_TRITON),
        ("cuda", torch.float32, api.AUTO_TRITON),
        ("cuda", torch.float64, "torch"),  # the kernels take fp32/fp16/bf16; float64 is a testing dtype
    ],
    ids=["cpu", "cuda-bf16", "cuda-fp32", "cuda-fp64-falls-back"],
)
def test_auto_backend(triton_importable, device, dtype, expected):
    assert api._resolve_backend("auto", torch.device(device), dtype) == expected
