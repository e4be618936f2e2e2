"""``sparseops._varlen``: cumulative lengths reach the device without a blocking copy."""

import torch


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
