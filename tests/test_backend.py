"""Which backend ``auto`` picks (no CUDA needed: the choice is a pure function of device and dtype)."""

import pytest
import torch

from sparseops import _backend, _checks


@pytest.fixture
def triton_importable(monkeypatch):
    monkeypatch.setattr(_checks, "triton_available", lambda: True)


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        ("cpu", torch.float32, ("torch", False)),
        ("cuda", torch.bfloat16, ("triton", True)),  # True: auto chose Triton (a kernel that does not fit: torch)
        ("cuda", torch.float32, ("triton", True)),
        ("cuda", torch.float64, ("torch", False)),  # the kernels take fp32/fp16/bf16; float64 is a testing dtype
    ],
    ids=["cpu", "cuda-bf16", "cuda-fp32", "cuda-fp64-falls-back"],
)
def test_auto_backend(triton_importable, device, dtype, expected):
    assert _backend.resolve("nsa", "auto", torch.device(device), dtype) == expected


def test_launch_metadata_reaches_the_device_without_a_blocking_copy(monkeypatch):
    # torch.tensor(list, device="cuda") copies from pageable memory and synchronizes the stream: the launchers
    # build their per-sequence tables through _varlen.device_tensor (pinned memory, non_blocking) instead
    import inspect

    from sparseops import _varlen
    from sparseops.nsa import triton_impl

    src = inspect.getsource(triton_impl)
    assert "torch.tensor(" not in src, "a launcher builds a device tensor from a list with a blocking copy"
    assert torch.equal(_varlen.device_tensor([3, 1, 2], torch.int32, "cpu"), torch.tensor([3, 1, 2], dtype=torch.int32))
    # on CUDA: pinned, then an asynchronous copy (simulated: no GPU here)
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append((str(device), non_blocking))
            return "on-device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned())
    assert _varlen.device_tensor([1, 2], torch.int64, "cuda:1") == "on-device" and calls == [("cuda:1", True)]
