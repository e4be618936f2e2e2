"""Shared benchmark harness: timing, peak memory, physical floors, environment record, JSON, charts.

Used by ``benchmarks/moe.py`` and ``benchmarks/nsa.py``; nothing here knows about a particular op.

- Time: :func:`median_time` runs a callable after warm-up until a minimum number of runs *and* a time
  budget are reached (or a maximum number of runs), and reports the median, min and interquartile range.
  ``torch.utils.benchmark.Timer`` is not used because its default pins one thread and its autorange
  cannot be told "at most 3 runs" for a multi-second peer.
- Memory: :func:`peak_memory` runs the callable once under ``torch.profiler`` with ``profile_memory=True``
  and replays every allocation/free event in time order: the result is the peak of bytes allocated
  *by the call* above what was live before it (outputs + temporaries + autograd saved tensors), counted
  by the PyTorch CPU allocator. Inputs allocated before the call are not counted. RSS is not used:
  glibc keeps freed pages and the process maximum never goes down, so RSS deltas say little.
- Floors: :func:`measure_floors` measures copy bandwidth (bytes read + written per second of one large
  ``Tensor.copy_``) and fp32 / bf16 matmul rates (2·n³ FLOP per n×n×n matmul), in the same process,
  with the same thread count as the ops.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.metadata as _md
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

# run from a source checkout: benchmark its src/, as the tests do (pytest's pythonpath = src)
if (REPO_ROOT / "src" / "sparseops").is_dir() and str(REPO_ROOT / "src") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "src"))


# ----------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------


def make_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced sweep (about half a minute per script)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes, no peers: checks the script runs (tests)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--no-peers", action="store_true", help="skip the peer libraries")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG chart")
    p.add_argument("--peer-budget", type=float, default=None, metavar="S",
                   help="skip a slow peer's call when it is estimated to take more than S seconds")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads(N) before measuring (default: torch's choice, all cores)")
    p.add_argument("--report", action="store_true", help="print the last recorded run as Markdown, run nothing")
    p.add_argument("--spread", action="store_true",
                   help="print how much the last two recorded runs of the same mode differ, run nothing")
    p.add_argument("--profile", action="store_true",
                   help="profile ours on one benchmark shape with torch.profiler and print the top operators")
    return p


def last_record(path: Path) -> dict:
    runs = json.loads(Path(path).read_text())
    return runs[-1] if isinstance(runs, list) else runs


def spread_table(path: Path, keys: tuple[str, ...], metrics: tuple[str, ...]) -> str:
    """Markdown: for the last two runs of the same mode in ``path``, each metric's two medians (ms) and
    their relative difference ``|a - b| / min(a, b)``, row by row (rows matched on ``keys``)."""
    runs = json.loads(Path(path).read_text())
    mode = runs[-1]["mode"]
    same = [r for r in runs if r["mode"] == mode]
    if len(same) < 2:
        return f"only {len(same)} {mode} run(s) in {path}"
    a, b = same[-2], same[-1]
    index = {tuple(r[k] for k in keys): r for r in a["rows"]}
    hdr = [*keys, *(f"{m} (ms, earlier / later, diff)" for m in metrics)]
    lines = [f"{mode} runs of {a['env']['date_utc']} and {b['env']['date_utc']}", "",
             "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for rb in b["rows"]:
        ra = index.get(tuple(rb[k] for k in keys))
        cells = [str(rb[k]) for k in keys]
        for m in metrics:
            x, y = (ra or {}).get(m), rb.get(m)
            cells.append(f"{x * 1e3:.1f} / {y * 1e3:.1f}, {abs(x - y) / min(x, y):.0%}" if x and y else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_table(fn: Callable[[], object], *, row_limit: int = 15) -> str:
    """torch.profiler's operator table (self CPU time) for a few calls of ``fn`` after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


# ----------------------------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: other processes on the machine make timings noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    """Where and with what the numbers were taken."""
    import sparseops
    from sparseops import _compile

    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": "cpu",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "sparseops": getattr(sparseops, "__version__", None),
        "git_commit": git_commit(),
        "loadavg_start": loadavg(),
        "cpu_kernels": _compile.status(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None,
    }


# ----------------------------------------------------------------------------------------------------------------
# timing and memory
# ----------------------------------------------------------------------------------------------------------------


def env_line(env: dict) -> str:
    """One line naming where and when a run was taken (the first line of each script's Markdown report)."""
    return (
        f"{env['date_utc']}, {env['cpu_model']}, {env['cpu_count']} cores ({env['torch_threads']} torch threads), "
        f"torch {env['torch']}, commit {env['git_commit']}, load average at start {env.get('loadavg_start')}"
    )


def save_run(name: str, op: str, *, quick: bool, smoke: bool, env: dict, out: Path, rows: list[dict],
             plot: Callable[[list[dict], Path], None] | None, **fields) -> dict:
    """Close a run: stamp the end load, append the record to ``out/<name>.json``, draw ``out/<name>.png``."""
    env["loadavg_end"] = loadavg()
    record = {"op": op, "mode": "smoke" if smoke else ("quick" if quick else "full"), "env": env, **fields,
              "rows": rows}
    append_json(out / f"{name}.json", record)
    if plot is not None:
        plot(rows, out / f"{name}.png")
    return record


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


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Peak bytes allocated by one call of ``fn()`` above what was live before it (see module doc).
    None when this torch's profiler does not expose allocation events."""
    return peak_memory_and_result(fn)[0]


def peak_memory_and_result(fn: Callable[[], object]) -> tuple[int | None, object]:
    """``(peak_memory(fn), what fn returned)``: one call serves as both a check and a measurement."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
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


# ----------------------------------------------------------------------------------------------------------------
# physical floors
# ----------------------------------------------------------------------------------------------------------------


def measure_floors(*, copy_mb: int = 512, matmul_n: int = 2048, budget_s: float = 1.0) -> dict:
    """Copy bandwidth (bytes read + written per second) and fp32 / bf16 matmul FLOP/s, measured now."""
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
    return out


# ----------------------------------------------------------------------------------------------------------------
# peers
# ----------------------------------------------------------------------------------------------------------------


def load_peer(module: str, attr: str) -> tuple[Callable | None, str | None]:
    """``(function, None)`` or ``(None, why)``: a missing or broken peer is reported, never fatal."""
    import warnings

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(module)
        fn = getattr(mod, attr)
    except Exception as exc:  # noqa: BLE001 - any import failure means "peer unavailable"
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"[peer] {module}.{attr} unavailable: {why}", file=sys.stderr)
        return None, why
    print(f"[peer] {module}.{attr} imported in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return fn, None


def peer_version(dist: str) -> str | None:
    return _version(dist)


def format_exc_line(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


# ----------------------------------------------------------------------------------------------------------------
# progress, results, charts
# ----------------------------------------------------------------------------------------------------------------


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on stderr (plain iteration if tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True, leave=True)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def append_json(path: Path, record: dict) -> None:
    """Append one run record to a JSON list file (created if missing; a corrupt file is kept aside)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    runs: list = []
    if path.exists():
        try:
            runs = json.loads(path.read_text())
            if not isinstance(runs, list):
                runs = [runs]
        except json.JSONDecodeError:
            path.rename(path.with_suffix(".json.corrupt"))
            runs = []
    runs.append(_jsonable(record))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    tmp.replace(path)


def plot_panels(
    path: Path,
    panels: list[dict],
    *,
    title: str,
    xlabel: str,
    ylabel: str = "time per call (ms)",
) -> None:
    """One PNG, one subplot per panel. A panel is ``{"title", "x": [...], "series": {label: [y...]},
    "floor": [y...] or None, "xticklabels": [...] or None}``; missing points are None. Log-scale y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
    markers = "osD^v<>"
    for ax, panel in zip(axes.flat, panels):
        x = panel["x"]
        for i, (label, ys) in enumerate(panel["series"].items()):
            pts = [(a, b) for a, b in zip(x, ys) if b is not None]
            if pts:
                ax.plot(*zip(*pts), marker=markers[i % len(markers)], label=label)
        if panel.get("floor") is not None:
            pts = [(a, b) for a, b in zip(x, panel["floor"]) if b is not None]
            if pts:
                ax.plot(*zip(*pts), "k--", marker="_", markersize=14, label=panel.get("floor_label", "floor"))
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        if panel.get("xticklabels"):
            ax.set_xticks(x)
            ax.set_xticklabels(panel["xticklabels"])
        ax.minorticks_off()
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
