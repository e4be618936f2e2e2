"""Shared benchmark harness: the command line, the environment record, JSON results, charts, progress.

Used by every ``benchmarks/<subject>.py``; nothing here knows about a particular op. How time, memory and
the machine's limits are measured is in ``_measure.py`` (re-exported here).

Where results go: ``--out DIR``, else ``./sparseops-results/`` (ignored by git); ``--record`` appends the
run to the repository's recorded results, ``benchmarks/results/``, which a plain run never touches.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.metadata as _md
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
#: a user's run, relative to the working directory
DEFAULT_OUT = Path("sparseops-results")

# run from a source checkout: benchmark its src/, as the tests do (pytest's pythonpath = src)
if (REPO_ROOT / "src" / "sparseops").is_dir() and str(REPO_ROOT / "src") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "src"))

if __package__:
    from ._measure import (  # noqa: F401 (the benchmarks' vocabulary: C.median_time, C.peak_memory, ...)
        bf16_matmul_units,
        floors_line,
        measure_floors,
        median_time,
        peak_memory,
        peak_memory_and_result,
        quiet_stderr,
    )
else:
    from _measure import (  # noqa: F401
        bf16_matmul_units,
        floors_line,
        measure_floors,
        median_time,
        peak_memory,
        peak_memory_and_result,
        quiet_stderr,
    )

from sparseops.cli._progress import Status  # noqa: E402
from sparseops.cli.info import cpu_model  # noqa: E402

# command line


def make_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced sweep (about half a minute per script)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes, no peers: checks the script runs (tests)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help=f"results folder (default ./{DEFAULT_OUT}/)")
    where.add_argument("--record", action="store_true",
                       help=f"append the run to the recorded results, {RESULTS_DIR} (on purpose only)")
    p.add_argument("--no-peers", action="store_true", help="skip the peer libraries")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG chart")
    p.add_argument("--peer-budget", type=float, default=None, metavar="S",
                   help="skip a slow peer's call when it is estimated to take more than S seconds")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads(N) before measuring (default: torch's choice, all cores)")
    p.add_argument("--report", action="store_true",
                   help="print the last run in --out (default: the recorded results) as Markdown, run nothing")
    p.add_argument("--spread", action="store_true",
                   help="print how much the last two recorded runs of the same mode differ, run nothing")
    p.add_argument("--profile", action="store_true",
                   help="profile ours on one benchmark shape with torch.profiler and print the top operators")
    return p


def out_dir(args: argparse.Namespace) -> Path:
    """Where a run writes: ``--out``, ``--record`` (the recorded results), else ``./sparseops-results/``."""
    if args.out is not None:
        return Path(args.out)
    return RESULTS_DIR if args.record else DEFAULT_OUT


def report_dir(args: argparse.Namespace) -> Path:
    """Where ``--report`` / ``--spread`` read: ``--out``, else the recorded results."""
    return Path(args.out) if args.out is not None else RESULTS_DIR


def read_runs(path: Path):
    """The runs recorded in ``path``; a missing file ends the process with a message naming it (``--report`` /
    ``--spread`` of an ``--out DIR`` that holds no run), not a traceback."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such results file (--report / --spread read the runs --out DIR holds, "
                         f"else {RESULTS_DIR}: run the benchmark with that --out first)")
    return json.loads(path.read_text())


def last_record(path: Path) -> dict:
    runs = read_runs(path)
    return runs[-1] if isinstance(runs, list) else runs


def spread_table(path: Path, keys: tuple[str, ...], metrics: tuple[str, ...]) -> str:
    """Markdown: for the last two runs of the same mode in ``path``, each metric's two medians (ms) and
    their relative difference ``|a - b| / min(a, b)``, row by row (rows matched on ``keys``)."""
    runs = read_runs(path)
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


def answer_report(args: argparse.Namespace, name: str, table: Callable[[dict], str], keys: tuple[str, ...],
                  metrics: tuple[str, ...]) -> bool:
    """``--report`` (``table`` of the last record of ``<name>.json``) or ``--spread`` (``spread_table`` over ``keys``
    and ``metrics``), printed; whether either was asked for."""
    path = report_dir(args) / f"{name}.json"
    if args.report:
        print(table(last_record(path)))
    elif args.spread:
        print(spread_table(path, keys, metrics))
    return bool(args.report or args.spread)


def profile_table(fn: Callable[[], object], *, row_limit: int = 15) -> str:
    """torch.profiler's operator table (self CPU time) for a few calls of ``fn`` after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


# environment


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


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
    out.mkdir(parents=True, exist_ok=True)
    record = {"op": op, "mode": "smoke" if smoke else ("quick" if quick else "full"), "env": env, **fields,
              "rows": rows}
    append_json(out / f"{name}.json", record)
    if plot is not None:
        plot(rows, out / f"{name}.png")
    return record


# peers


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


# progress, results, charts


def steps(name: str, total: int) -> Status:
    """The progress of a run of ``total`` steps (``with st.step("floors"): ...``), announced as each starts with
    the time since the run started and an estimate of what is left, on stderr; close it at the end."""
    return Status(total, name=name, announce=True, every_s=30.0)


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


def op_floors(*, quick: bool, smoke: bool) -> dict:
    """The op benchmarks' floors: copy bandwidth and matmul rates, sized by the mode."""
    if smoke:
        return measure_floors(copy_mb=16, matmul_n=256, budget_s=0.05)
    return measure_floors(copy_mb=256 if quick else 512, budget_s=0.3 if quick else 1.0)


def goal_cell(row: dict, key: str) -> str:
    """``met`` / ``missed``, or ``—`` when the row has no number for that goal (the peer did not run)."""
    return "—" if key not in row else ("met" if row[key] else "missed")


def table_preamble(record: dict) -> list[str]:
    """The lines above a run's table: the environment, then the floors."""
    return [env_line(record["env"]), "", floors_line(record["floors"]), ""]


def gate_line(gate: list[dict]) -> str:
    """One line on the correctness gate of a run: how many checks held and the closest to its tolerance."""
    ok = sum(1 for g in gate if g["err"] <= g["tol"])
    worst = max(gate, key=lambda g: g["err"] / g["tol"] if g["tol"] else math.inf)
    return (f"correctness gate vs the float64 reference: {ok}/{len(gate)} within tolerance (closest: "
            f"{worst['what']}, {worst['err']:.2e} <= {worst['tol']:.0e})")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
