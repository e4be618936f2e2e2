"""One way to launch the Triton kernels of both op families (imported only by the ``triton_impl`` modules).

- The kernel runs on the device of its tensors, whatever the current CUDA device is (Triton launches on the
  current one: a tensor on ``cuda:1`` with ``cuda:0`` current would be read through a wrong context).
- A kernel whose pipelined loads need more shared memory than the device has (wide heads or big blocks on a GPU
  with less shared memory than the H100/H200 the launch settings were chosen on) is retried with fewer pipeline
  stages; the stage count that fitted is remembered per kernel, device and constexpr set. When even one stage
  does not fit, a ``ValueError`` says what the shape needs, what the device has, and how to get around it.
"""

from __future__ import annotations

import torch

_STAGES: dict = {}


def launch(kernel, grid, device: torch.device, args, *, num_warps: int, num_stages: int | None = None,
           shape: str = "", **meta) -> None:
    """``kernel[grid](*args, num_warps=..., num_stages=..., **meta)`` on ``device``.

    ``shape`` names the arguments that size the kernel's tiles, for the error message
    (e.g. ``"selected_block_size=128, Dqk=256, Dv=256"``)."""
    from triton.runtime.errors import OutOfResources

    key = (getattr(kernel, "__name__", repr(kernel)), str(device), num_warps, num_stages,
           tuple(sorted((k, str(v)) for k, v in meta.items())))
    stages = _STAGES.get(key, num_stages)
    while True:
        opts = {"num_warps": num_warps} if stages is None else {"num_warps": num_warps, "num_stages": stages}
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    kernel[grid](*args, **opts, **meta)
            else:
                kernel[grid](*args, **opts, **meta)
        except OutOfResources as e:
            if e.name == "shared memory" and stages is not None and stages > 1:
                stages -= 1
                continue
            unit = " bytes" if e.name == "shared memory" else ""
            raise ValueError(
                f"{key[0]}: {shape or 'this shape'} needs {e.required}{unit} of {e.name} per program, the "
                f"device ({_device_name(device)}) has {e.limit}{unit}, even without pipelining; use "
                "backend='torch', or smaller head dims / block size"
            ) from e
        if stages != num_stages:
            _STAGES[key] = stages
        return


def _device_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    except Exception:  # noqa: BLE001
        return str(device)
