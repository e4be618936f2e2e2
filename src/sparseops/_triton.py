"""One way to launch the Triton kernels of both op families (imported only by the ``triton_impl`` modules).

- The kernel runs on the device of its tensors, whatever the current CUDA device is (Triton launches on the
  current one: a tensor on ``cuda:1`` with ``cuda:0`` current would be read through a wrong context).
- A kernel whose pipelined loads need more shared memory than the device has (wide heads or big blocks on a GPU
  with less shared memory than the H100/H200 the launch settings were chosen on) is retried with fewer pipeline
  stages; the stage count that fitted is remembered per kernel, device and constexpr set. When even one stage
  does not fit, ``DoesNotFit`` (a ``ValueError``) says what the shape needs, what the device has, and how to get
  around it.
- ``arch(device)``: the compute capability a launch targets, for per-GPU launch settings.
- ``offline_compile(arch)``: inside it, a launch compiles its kernel for ``sm_<arch>`` (Triton's bundled
  ``ptxas``, no GPU needed) with exactly the arguments, constexprs, warps and stages it would run with, checks
  its shared memory against that GPU's limit (the retry and the error above included), records it, and runs
  nothing. The launchers' arguments can be CPU tensors there. That is how CI checks, without a GPU, that every
  kernel compiles for real GPUs at the documented shapes (tests/nsa/test_triton_fit.py, tests/test_triton.py).

Kernel arguments travel by name: ``launch(kernel, grid, device, {"q": q, ...}, num_warps=..., BLOCK=...)`` calls
``kernel[grid](q=q, ..., BLOCK=...)``, so a launcher cannot shift an argument into the wrong parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import _checks

#: the stage count that fitted, per (kernel, device, warps, stages asked, constexprs): a cache, not a knob
_STAGES: dict = {}
#: launches that do not fit even unpipelined, by the same key: their error, raised again without a retry
_NO_FIT: dict = {}


class DoesNotFit(ValueError):
    """A kernel needs more of a per-program resource (shared memory) than the device has, even unpipelined, or a
    grid larger than CUDA launches (:data:`GRID_LIMITS`).

    ``backend="auto"`` catches it and runs the op's torch path instead; an explicit ``backend="triton"`` gets it."""


#: shared memory one program may use (bytes, the opt-in maximum), by compute capability
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
GPU_NAMES = {80: "A100", 86: "RTX 30xx / A10 / A40", 89: "RTX 40xx / L4 / L40", 90: "H100 / H200",
             100: "B200 / GB200", 120: "RTX 50xx / RTX PRO Blackwell"}

#: inside ``offline_compile``: ``(arch, records)``
_OFFLINE: tuple[int, list] | None = None


@dataclasses.dataclass
class OfflineLaunch:
    """One launch compiled by ``offline_compile``: what it would run with on ``sm_<arch>``."""

    kernel: str
    grid: tuple
    shape: str
    arch: int
    num_warps: int
    num_stages: int | None  # what the launcher asked for
    stages: int  # what fitted (fewer than asked after a shared-memory retry)
    shared: int  # bytes per program
    meta: dict = dataclasses.field(repr=False, default_factory=dict)  # the constexprs
    compiled: object = dataclasses.field(repr=False, default=None)

    def resources(self) -> dict:
        """``{"registers": int, "spill_bytes": int}`` per thread, read from the cubin with ``cuobjdump``."""
        tool = shutil.which("cuobjdump") or str(_nvidia_bin() / "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(self.compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
        words = [w for line in text.splitlines() if "REG:" in line for w in line.split()]
        value = {w.split(":")[0]: int(w.split(":")[1]) for w in words if w[:4] in ("REG:", "STAC")}
        return {"registers": value.get("REG", 0), "spill_bytes": value.get("STACK", 0)}


def _nvidia_bin() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _OfflineDriver:
    """What Triton's JIT asks of its driver to specialise and compile a kernel (never to launch one)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return f"offline-sm_{self.arch}"  # a key of the JIT's per-device caches, distinct per arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def offline_compile(arch: int = 90):
    """Compile, instead of run, every kernel launched inside: ``with offline_compile(90) as launches: ...``.

    ``launches`` fills with one ``OfflineLaunch`` per launch. Outputs of the launchers are left unwritten.
    A launch that does not fit ``SHARED_LIMIT[arch]`` even with one stage raises the same ``ValueError`` as on
    such a GPU."""
    global _OFFLINE
    if arch not in SHARED_LIMIT:
        raise ValueError(f"arch: expected one of {sorted(SHARED_LIMIT)}, got {arch!r}")
    if _checks.triton_interpret():
        raise RuntimeError("offline_compile needs compiled Triton: unset TRITON_INTERPRET")
    from triton.runtime import driver

    if _OFFLINE is not None:
        raise RuntimeError("offline_compile does not nest")
    previous = driver._active
    records: list[OfflineLaunch] = []
    driver.set_active(_OfflineDriver(arch))
    _OFFLINE = (arch, records)
    try:
        yield records
    finally:
        _OFFLINE = None
        driver._active = previous


def _compile_offline(kernel, grid, args: dict, opts: dict, meta: dict, shape: str, asked: int | None) -> None:
    from triton.runtime.errors import OutOfResources

    arch, records = _OFFLINE
    compiled = kernel.warmup(grid=grid, **args, **opts, **meta)
    shared = compiled.metadata.shared
    if shared > SHARED_LIMIT[arch]:
        raise OutOfResources(shared, SHARED_LIMIT[arch], "shared memory")
    records.append(OfflineLaunch(
        kernel=getattr(kernel, "__name__", repr(kernel)), grid=tuple(grid), shape=shape, arch=arch,
        num_warps=opts["num_warps"], num_stages=asked, stages=compiled.metadata.num_stages, shared=shared,
        meta=dict(meta), compiled=compiled,
    ))


#: the most programs along each grid axis that CUDA launches (x, y, z)
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def launch(kernel, grid, device: torch.device, args: dict, *, num_warps: int, num_stages: int | None = None,
           shape: str = "", **meta) -> None:
    """``kernel[grid](**args, num_warps=..., num_stages=..., **meta)`` on ``device``.

    ``args``: the kernel's run-time arguments (tensors, scalars) by parameter name; ``meta``: its constexprs, which
    with the warps and stages key the remembered stage count. ``shape`` names the arguments that size the kernel's
    tiles, for the error message (e.g. ``"selected_block_size=128, Dqk=256, Dv=256"``)."""
    from triton.runtime.errors import OutOfResources

    for axis, (n, most) in enumerate(zip(grid, GRID_LIMITS)):
        if n > most:  # checked everywhere (the interpreter would run it), so a shape behaves as it would on a GPU
            raise DoesNotFit(f"{getattr(kernel, '__name__', repr(kernel))}: {shape or 'this shape'} needs {n} programs "
                             f"along grid axis {axis}, CUDA launches at most {most}; use backend='torch'")
    where = f"offline-sm_{_OFFLINE[0]}" if _OFFLINE is not None else str(device)
    key = (getattr(kernel, "__name__", repr(kernel)), where, num_warps, num_stages,
           tuple(sorted((k, str(v)) for k, v in meta.items())))
    if key in _NO_FIT:
        raise DoesNotFit(_NO_FIT[key])
    stages = _STAGES.get(key, num_stages)
    while True:
        opts = {"num_warps": num_warps} if stages is None else {"num_warps": num_warps, "num_stages": stages}
        try:
            if _OFFLINE is not None:
                _compile_offline(kernel, grid, args, opts, meta, shape, num_stages)
            elif device.type == "cuda":
                with torch.cuda.device(device):
                    kernel[grid](**args, **opts, **meta)
            else:
                kernel[grid](**args, **opts, **meta)
        except OutOfResources as e:
            if e.name == "shared memory" and stages is not None and stages > 1:
                stages -= 1
                continue
            unit = " bytes" if e.name == "shared memory" else ""
            _NO_FIT[key] = (
                f"{key[0]}: {shape or 'this shape'} needs {e.required}{unit} of {e.name} per program, the "
                f"device ({_device_name(device)}) has {e.limit}{unit}, even without pipelining; use "
                "backend='torch', or smaller head dims / block size"
            )
            raise DoesNotFit(_NO_FIT[key]) from e
        if stages != num_stages:
            _STAGES[key] = stages
        return


def arch(device: torch.device) -> int:
    """Compute capability as ``major * 10 + minor`` of the GPU a launch on ``device`` targets: the offline target
    inside ``offline_compile``; 90 for the interpreter (CPU tensors), whose results do not depend on it."""
    if _OFFLINE is not None:
        return _OFFLINE[0]
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def mma_sync_only(arch_: int) -> bool:
    """Whether ``sm_<arch_>`` multiplies with warp-level ``mma.sync`` only (Ampere, Ada, consumer Blackwell), not
    with Hopper's warpgroup ``wgmma`` or datacenter Blackwell's ``tcgen05`` (sm_90, sm_100): its accumulators then
    live in the registers of one warp's tile, and big tiles spill sooner."""
    return not 90 <= arch_ < 120


def _device_name(device: torch.device) -> str:
    if _OFFLINE is not None:
        return f"sm_{_OFFLINE[0]}, {GPU_NAMES[_OFFLINE[0]]}"
    try:
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    except Exception:  # noqa: BLE001
        return str(device)
