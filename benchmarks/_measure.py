"""How the benchmarks measure: time per call, peak memory of a call, and the machine's limits (floors).

- Time: :func:`median_time` runs a callable after warm-up until a minimum number of runs *and* a time
  budget are reached (or a maximum number of runs), and reports the median, min and interquartile range.
  ``torch.utils.benchmark.Timer`` is not used because its default pins one thread and its autorange
  cannot be told "at most 3 runs" for a multi-second peer.
- Memory: :func:`peak_memory` runs the callable once under ``torch.profiler`` with ``profile_memory=True``
  and replays every allocation/free event in time order: the result is the peak of bytes allocated
  *by the call* above what was live before it (outputs + temporaries + autograd saved tensors), counted
  by the PyTorch CPU allocator. Inputs allocated before the call are not counted. RSS is not used:
  glibc keeps freed pages and the process maximum never goes down, so RSS deltas say little. The
  profiler's own start/stop lines (kineto writes them to stderr whatever its log level) are dropped.
- Floors: :func:`measure_floors` measures copy bandwidth (bytes read + written per second of one large
  ``Tensor.copy_``) and fp32 / bf16 matmul rates (2·n³ FLOP per n×n×n matmul), in the same process,
  with the same thread count as the ops. A CPU without bf16 matmul units emulates bf16 far below its
  fp32 rate: that rate is no floor, and :func:`bf16_matmul_units` says why.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def median_time(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    min_runs: int = 5,
    max_runs: int = 50,
    budget_s: float = 1.0,
) -> dict:
    """Seconds per call of ``fn()``: median, min, IQR over the runs. Runs ``warmup`` untimed calls, then at
    least ``min_runs`` timed ones, more while the total stays under ``budget_s``, at most ``max_runs``."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    total = 0.0
    gc_was = gc.isenabled()
    gc.disable()
    try:
        while len(times) < max_runs and (len(times) < min_runs or total < budget_s):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times.append(dt)
            total += dt
    finally:
        if gc_was:
            gc.enable()
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "iqr_s": q[2] - q[0], "runs": len(times)}


@contextlib.contextmanager
def quiet_stderr():
    """Drop what native code writes to file descriptor 2 inside the block (Python's ``sys.stderr`` is
    flushed first, so nothing of ours is lost)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Peak bytes allocated by one call of ``fn()`` above what was live before it (see the module doc).
    None when this torch's profiler does not expose allocation events."""
    return peak_memory_and_result(fn)[0]


def peak_memory_and_result(fn: Callable[[], object]) -> tuple[int | None, object]:
    """``(peak_memory(fn), what fn returned)``: one call serves as both a check and a measurement."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, fn()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.start()
    try:
        result = fn()
    finally:
        with quiet_stderr():
            prof.stop()
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError:
        return None, result
    events: list[tuple[int, int]] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith("cpu"):
            events.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        stack.extend(node.children)
    events.sort()
    cur = peak = 0
    for _, size in events:
        cur += size
        peak = max(peak, cur)
    return peak, result


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``); None when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_matmul_units(fp32_flops: float, bf16_flops: float, flags: set[str] | None | str = "read") -> str | None:
    """Why the bf16 matmul rate is no floor, or None when it is one: the CPU's flags are known and name no
    bf16 units (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``), or bf16 runs below a quarter of the fp32
    rate (emulated). ``flags``: the CPU's (default: read them; None: unknown)."""
    flags = cpu_flags() if flags == "read" else flags
    if flags is not None and not flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return "no bf16 matmul units on this CPU"
    if bf16_flops < fp32_flops / 4:
        return "bf16 matmul runs below a quarter of the fp32 rate here (emulated)"
    return None


def measure_floors(*, copy_mb: int = 512, matmul_n: int = 2048, budget_s: float = 1.0) -> dict:
    """Copy bandwidth (bytes read + written per second) and fp32 / bf16 matmul FLOP/s, measured now;
    ``matmul_bf16_units`` False (and ``matmul_bf16_not_a_floor`` the reason) when the bf16 rate is no floor."""
    n_el = copy_mb * 2**20 // 4

    def copy_time() -> float:
        src = torch.randn(n_el)
        dst = torch.empty_like(src)
        return median_time(lambda: dst.copy_(src), warmup=2, min_runs=5, budget_s=budget_s)["median_s"]

    t_copy = copy_time()
    out = {"copy_bytes": 2 * n_el * 4, "copy_bandwidth_Bps": 2 * n_el * 4 / t_copy, "copy_time_s": t_copy}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(matmul_n, matmul_n).to(dtype)
        b = torch.randn(matmul_n, matmul_n).to(dtype)
        t = median_time(lambda a=a, b=b: torch.mm(a, b), warmup=1, min_runs=3, budget_s=budget_s)
        out[f"matmul_{name}_n"] = matmul_n
        out[f"matmul_{name}_flops"] = 2 * matmul_n**3 / t["median_s"]
    why_not = bf16_matmul_units(out["matmul_fp32_flops"], out["matmul_bf16_flops"])
    out["matmul_bf16_units"] = why_not is None
    if why_not:
        out["matmul_bf16_not_a_floor"] = why_not
    return out


def floors_line(f: dict) -> str:
    """The floors of a run, in words, for the reports."""
    bf16 = f"bf16 {f['matmul_bf16_flops'] / 1e9:.1f} GFLOP/s"
    if f.get("matmul_bf16_units") is False:
        why = f.get("matmul_bf16_not_a_floor", "no bf16 matmul units on this CPU")
        bf16 = f"bf16 — ({why}: {f['matmul_bf16_flops'] / 1e9:.1f} GFLOP/s is not a floor)"
    return (f"Floors measured in the run: copy {f['copy_bandwidth_Bps'] / 1e9:.2f} GB/s (read + write), matmul "
            f"fp32 {f['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s, {bf16}.")
