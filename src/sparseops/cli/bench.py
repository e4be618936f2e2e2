"""Run the side-by-side benchmarks (benchmarks/<subject>.py of the source repository; they are not part of
the installed package, and need the peers and matplotlib) and say where the JSON/PNG results went.

Results go to ./sparseops-results/ unless --out DIR says otherwise; --record appends the run to the
repository's recorded results (benchmarks/results/), which a plain run never touches. Each subject prints
what it runs and for how long from its start."""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ._flags import check_out_dir
from ._progress import fmt_duration

HELP = "side-by-side benchmarks vs the peers (needs a source checkout: its benchmarks/ folder)"

#: the benchmark subjects: ``benchmarks/<subject>.py``, each with ``main(argv=None) -> int`` that accepts
#: ``--quick``, ``--smoke`` and ``--out DIR`` (``benchmarks/_common.make_parser`` gives all three)
SUBJECTS = ("moe", "nsa", "moe_layer", "nsa_module", "dsa")

#: where a run's results go by default, relative to the working directory (in .gitignore)
DEFAULT_OUT = "sparseops-results"

_REPO_HINT = ("The benchmark scripts are part of the source repository, not of the installed package: run "
              "from a source checkout (git clone the repository, pip install -e '.[bench]', run sparseops bench "
              "there), or pass --repo PATH to one (or set SPARSEOPS_BENCHMARKS=PATH/benchmarks).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", "--subject", dest="op", choices=(*SUBJECTS, "all"), default="all",
                        help="which benchmark subject (default all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    mode.add_argument("--smoke", action="store_true",
                      help="the smallest run that exercises every code path (for CI); default --out: a new temporary directory")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", default=None,
                       help=f"directory for the JSON/PNG results (default: ./{DEFAULT_OUT}/)")
    where.add_argument("--record", action="store_true",
                       help="append the run to the repository's recorded results, benchmarks/results/ (on purpose only)")
    parser.add_argument("--repo", metavar="PATH", default=None,
                        help="a source checkout whose benchmarks/ to run (default: the checkout this package runs "
                        "from, else the working directory)")


def benchmarks_dir(repo: str | None = None) -> Path | None:
    """The ``benchmarks/`` folder to run: ``--repo``, ``$SPARSEOPS_BENCHMARKS``, the checkout this package runs
    from (an editable install), or ``./benchmarks``; None when none of them holds a benchmark script."""
    if repo is not None:
        p = Path(repo)
        candidates = [p / "benchmarks", p]
    else:
        env = os.environ.get("SPARSEOPS_BENCHMARKS")
        candidates = [Path(env)] if env else []
        candidates += [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if any((c / f"{s}.py").is_file() for s in SUBJECTS):
            return c.resolve()
    return None


def load_benchmark(name: str, repo: str | None = None):
    """Import ``benchmarks/<name>.py`` as the module ``benchmarks.<name>`` (its folder's name) with the
    folder's parent on ``sys.path``; SystemExit with what it needs when it is not there.

    A real, importable name: what a script hands to a spawned process (``sparseops.distributed.spawn``'s
    worker function, pickled by module and name) is imported again there, and a spawned process starts with
    this process's ``sys.path``. The parent therefore stays on ``sys.path``."""
    d = benchmarks_dir(repo)
    if d is None or not (d / f"{name}.py").is_file():
        looked = f"{d}" if d is not None else (repo or "this package's checkout and ./benchmarks")
        raise SystemExit(f"sparseops bench: benchmarks/{name}.py not found (looked in {looked}). {_REPO_HINT}")
    path = d / f"{name}.py"
    package = d.name
    if not package.isidentifier():
        raise SystemExit(f"sparseops bench: {d}: expected a folder whose name is a Python identifier (it is "
                         f"imported as a package, {package!r}.{name})")
    _put_first_on_path(str(d.parent))
    if _imported_elsewhere(package, name, path):
        # another checkout's scripts under the same name (several --repo in one process): import these instead
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]
    importlib.invalidate_caches()
    try:
        if package not in sys.modules:  # this folder, even where another `package` comes earlier on sys.path
            _import_package(package, d)
        mod = importlib.import_module(f"{package}.{name}")
    except ImportError as exc:
        raise SystemExit(f"sparseops bench: importing {path} as {package}.{name} failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if Path(mod.__file__).resolve() != path.resolve():
        raise SystemExit(f"sparseops bench: {package}.{name} imports {mod.__file__}, not {path}: another "
                         f"package named {package!r} comes first")
    if not callable(getattr(mod, "main", None)):
        raise SystemExit(f"sparseops bench: {path} has no main(argv) function")
    return mod


def _imported_elsewhere(package: str, name: str, path: Path) -> bool:
    """Whether ``package`` or ``package.name`` is already imported from another folder than ``path``'s."""
    pkg, mod = sys.modules.get(package), sys.modules.get(f"{package}.{name}")
    if pkg is not None and str(path.parent) not in {str(Path(p).resolve()) for p in getattr(pkg, "__path__", [])}:
        return True
    return mod is not None and Path(getattr(mod, "__file__", None) or "").resolve() != path.resolve()


def _import_package(package: str, folder: Path) -> None:
    init = folder / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[str(folder)])
    else:  # a folder without __init__.py: a namespace package of this folder alone
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
    mod = importlib.util.module_from_spec(spec)
    sys.modules[package] = mod
    try:
        if spec.loader is not None:
            spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[package]
        raise


#: the folders :func:`load_benchmark` added to ``sys.path`` (only the last checkout loaded stays there)
_ADDED_TO_PATH: list[str] = []


def _put_first_on_path(folder: str) -> None:
    for earlier in _ADDED_TO_PATH:
        while earlier != folder and earlier in sys.path:
            sys.path.remove(earlier)
    if folder in sys.path:
        _ADDED_TO_PATH[:] = [f for f in _ADDED_TO_PATH if f == folder]
        sys.path.remove(folder)
    else:
        _ADDED_TO_PATH[:] = [folder]
    sys.path.insert(0, folder)


def out_dir(args: argparse.Namespace, name: str, bench_dir: Path) -> Path:
    """Where subject ``name`` writes: --out, --record (the recorded results), a temporary directory for
    --smoke, else ./sparseops-results/."""
    if args.out:
        return Path(args.out)
    if args.record:
        return bench_dir / "results"
    if args.smoke:  # a plumbing check: its rows join nothing
        return Path(tempfile.mkdtemp(prefix=f"sparseops-bench-smoke-{name}-"))
    return Path.cwd() / DEFAULT_OUT


def previous_duration(out: Path, name: str, mode: str) -> float | None:
    """Seconds the last ``mode`` run recorded in ``out/<name>.json`` took (None when unknown)."""
    try:
        runs = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    runs = runs if isinstance(runs, list) else [runs]
    for r in reversed(runs):
        if isinstance(r, dict) and r.get("mode") == mode and isinstance(r.get("duration_s"), (int, float)):
            return float(r["duration_s"])
    return None


def written_files(out: Path, name: str, since: float) -> list[str]:
    """The result files ``<out>/<name>.*`` and ``<out>/<name>_<variant>.*`` (nsa_module's ``_smoke``) the run
    wrote (modified since it started); another subject's files (``moe_layer.json`` beside ``moe``) are not
    its own."""
    if not out.is_dir():
        return []
    longer = [s for s in SUBJECTS if s != name and s.startswith(name + "_")]

    def own(p: Path) -> bool:
        n = p.name
        return (n.startswith(name + ".") or n.startswith(name + "_")) and \
            not any(n.startswith(s + ".") or n.startswith(s + "_") for s in longer)

    return sorted(str(p) for p in out.iterdir() if own(p) and p.is_file() and p.stat().st_mtime >= since - 1)


def run(args: argparse.Namespace) -> int:
    names = list(SUBJECTS) if args.op == "all" else [args.op]
    mods = [(n, load_benchmark(n, args.repo)) for n in names]  # fail before running anything
    if args.out:
        check_out_dir("sparseops bench", "--out", args.out)
    mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
    status = 0
    for name, mod in mods:
        bench_dir = Path(mod.__file__).resolve().parent
        out = out_dir(args, name, bench_dir)
        argv = (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []) + ["--out", str(out)]
        prev = previous_duration(out, name, mode)
        print(f"== benchmarks/{name}.py {' '.join(argv)}"
              + (f" (the last {mode} run in {out} took {fmt_duration(prev)})" if prev else ""), flush=True)
        t0, started = time.perf_counter(), time.time()
        try:
            rc = mod.main(argv)
        except Exception as exc:
            print(f"== benchmarks/{name}.py FAILED: {type(exc).__name__}: {exc}", flush=True)
            status = 1
            continue
        files = written_files(out, name, started)
        print(f"results: {', '.join(files) if files else f'(nothing named {name}.* written in {out})'}")
        print(f"({name} took {fmt_duration(time.perf_counter() - t0)})", flush=True)
        if rc:
            status = 1
    return status
