"""Run every public op (forward, seed grads, autograd backward) on every available backend against the
reference oracle in float64 on random inputs (varlen, GQA, EP windows partial and empty, fp32/fp16/bf16),
one row per (op, backend, dtype, case). Exit status 1 on any mismatch or exception. What runs and for how
long shows from the first second (the first call of a compiled CPU kernel compiles it)."""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

from ._progress import Status, fmt_duration

HELP = "check every op and backend against the float64 reference"

DTYPE_CHOICES = ("fp32", "fp16", "bf16")
COLUMNS = ("op", "backend", "dtype", "case", "worst output", "rel RMS err", "tol", "ms", "result")
WIDTHS = (42, 7, 5, 18, 28, 11, 7, 9, 6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("torch", "triton", "all"), default="all",
                        help="backends to check; all = torch, plus triton when CUDA or TRITON_INTERPRET=1 (default)")
    parser.add_argument("--dtype", nargs="+", choices=(*DTYPE_CHOICES, "all"), default=None,
                        help="input dtypes (default: all = fp32 fp16 bf16)")
    parser.add_argument("--op", choices=("moe", "nsa", "all"), default="all", help="op family (default all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device of the inputs (default: cuda when available; triton on CPU needs TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", "--quick", dest="tiny", action="store_true",
                        help="tiny shapes for every backend (a fast smoke check)")
    parser.add_argument("--failures-only", action="store_true", help="print only the failing rows")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the traceback of every exception")


def check_device(want: str = "auto"):
    """The device of the checked inputs: CUDA when available (``auto``) or asked for, else CPU."""
    import torch

    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("sparseops check: --device cuda asked for but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def available_backends(choice: str, device=None) -> tuple[list[str], list[str]]:
    """(backends to run, notes on skipped ones). torch always; triton for CUDA tensors, or for CPU tensors
    under TRITON_INTERPRET=1 (set before triton is imported)."""
    from sparseops import _checks

    device = check_device() if device is None else device
    notes = []
    triton_ok = _checks.triton_available() and (device.type == "cuda" or _checks.triton_interpret())
    if not _checks.triton_available():
        why = "triton does not import (pip install sparseops[triton])"
    elif not triton_ok:
        why = f"inputs on {device} need TRITON_INTERPRET=1 (no CUDA device, or --device cpu)"
    else:
        why = ""
    if choice == "torch":
        return ["torch"], notes
    if choice == "triton":
        if not triton_ok:
            raise SystemExit(f"sparseops check: --backend triton is not available here: {why}")
        return ["triton"], notes
    out = ["torch"]
    if triton_ok:
        out.append("triton")
    else:
        notes.append(f"triton backend skipped: {why}")
    return out, notes


def _family(name: str):
    from . import _check_moe, _check_nsa

    return _check_moe if name == "moe" else _check_nsa


def run_one(family: str, op: str, case, backend: str, dtype, seed: int, device):
    """One row: the op's outputs against the reference; an exception is a failed row, not a crash."""
    from ._check_common import DTYPE_NAMES, Result, compare

    res = Result(op=op, backend=backend, dtype=DTYPE_NAMES[dtype], case=case.name)
    try:
        cmps, ms = _family(family).check(op, case, backend, dtype, seed, device)
        res.ms = ms
        res.err, res.tol, res.worst, res.ok, res.error = compare(cmps)
    except Exception as exc:  # report it, keep going, exit 1 at the end
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}"
        res.trace = traceback.format_exc()
    return res


def fmt_row(cells) -> str:
    return "  ".join(str(c).ljust(w) if i < 5 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, WIDTHS))).rstrip()


def fmt_result(r) -> str:
    err = "exception" if r.error and math.isnan(r.err) else (f"{r.err:.2e}" if r.err == r.err else "-")
    tol = "exact" if r.tol == 0 else (f"{r.tol:.0e}" if r.tol == r.tol else "-")
    ms = f"{r.ms:.2f}" if r.ms == r.ms else "-"
    return fmt_row((r.op, r.backend, r.dtype, r.case, r.worst or "-", err, tol, ms, "PASS" if r.ok else "FAIL"))


def plan_checks(args: argparse.Namespace, backends: list[str], device) -> list[tuple]:
    """``(family, op, case, backend, dtype, device)`` of every row, in the order they run."""
    from ._check_common import DTYPES

    dtypes = list(DTYPES.values()) if not args.dtype or "all" in args.dtype else [DTYPES[d] for d in args.dtype]
    families = ("moe", "nsa") if args.op == "all" else (args.op,)
    plan = []
    for backend in backends:
        # the Triton interpreter is slow: tiny shapes on CPU tensors
        tiny = args.tiny or (backend == "triton" and device.type == "cpu")
        for family in families:
            mod = _family(family)
            for op in mod.OPS:
                for case in mod.cases(tiny):
                    for dtype in dtypes:
                        plan.append((family, op, case, backend, dtype, device))
    return plan


def run(args: argparse.Namespace) -> int:
    print("sparseops check: importing torch and the ops ...", file=sys.stderr, flush=True)
    from ._check_common import DTYPE_NAMES
    from ._flags import check_seed

    check_seed("sparseops check", args.seed)
    device = check_device(args.device)
    backends, notes = available_backends(args.backend, device)
    plan = plan_checks(args, backends, device)
    for n in notes:
        print(f"note: {n}")
    print(f"sparseops check: {len(plan)} checks, backends {', '.join(backends)} on {device}, "
          f"reference in float64 on CPU, seed {args.seed}", flush=True)
    print(fmt_row(COLUMNS))
    print(fmt_row(tuple("-" * w for w in WIDTHS)), flush=True)
    status = Status(len(plan))
    results = []
    t0 = time.perf_counter()
    try:
        for family, op, case, backend, dtype, dev in plan:
            status.begin(f"{op} {backend} {DTYPE_NAMES[dtype]} {case.name}")
            r = run_one(family, op, case, backend, dtype, args.seed, dev)
            status.end()
            results.append(r)
            if not (args.failures_only and r.ok):
                status.write(fmt_result(r))
            if r.error:
                status.write(f"    error: {r.error}")
                if args.verbose and r.trace:
                    status.write("    " + r.trace.rstrip().replace("\n", "\n    "))
    finally:
        status.close()
    failed = [r for r in results if not r.ok]
    took = time.perf_counter() - t0
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {took:.1f} s ({fmt_duration(took)})"
          + (f"; {len(failed)} FAILED:" if failed else ""))
    for r in failed:
        print(f"  FAIL {r.op} [{r.backend}, {r.dtype}, {r.case}]: "
              + (r.error or f"{r.worst}: rel RMS error {r.err:.3e} > tolerance {r.tol:.0e}"))
    return 1 if failed else 0
