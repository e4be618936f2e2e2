"""Compile the NSA selected-attention Triton kernels (forward; backward atomic, deterministic and DQ_ATOMIC)
for a GPU architecture at one shape, without running them and without a GPU, and print each kernel's shared
memory, registers and register spill. Exit status 1 when a kernel does not fit that GPU (backend='triton'
would raise there, 'auto' runs the torch path)."""

from __future__ import annotations

import argparse
import sys

HELP = "will the NSA Triton kernels fit a GPU at a shape (compiled offline, no GPU needed)"

DTYPES = ("bf16", "fp16", "fp32")
#: the op's name of each shape parameter (its checks' messages start with it) -> the flag that sets it
FLAGS = {"G": "-G", "N2": "--kv-heads", "Dqk": "--dqk", "Dv": "--dv", "selected_block_size": "--block-size",
         "selected_block_count": "--block-count"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=int, choices=(80, 86, 89, 90, 100, 120), default=None,
                        help="compute capability x10: 90 H100/H200, 100 B200, 80 A100, 86/89/120 consumer Ampere/Ada/"
                        "Blackwell (default: this machine's GPU, else 90)")
    parser.add_argument("--group", "-G", type=int, default=16, help="query heads per KV head, G = N1 / N2 (default 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads N2 (default 4)")
    parser.add_argument("--dqk", type=int, default=192, help="query/key head dim (default 192)")
    parser.add_argument("--dv", type=int, default=128, help="value head dim (default 128)")
    parser.add_argument("--block-size", type=int, default=64, help="selected_block_size (default 64)")
    parser.add_argument("--block-count", type=int, default=16, help="selected_block_count K (default 16)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype (default bf16)")
    parser.add_argument("--no-causal", action="store_true", help="sparse_mode 0 instead of 2")


def fit_lines(rows: list[dict]) -> list[str]:
    """The rows of the NSA compile report as a table, one launch per line."""
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['variant']:<14} does not fit: {r['error']}")
        else:
            rows_ = f"rows={r['rows']}" if r.get("rows") else ""
            keys = f"keys={r['keys']}" if r.get("keys") else ""
            lines.append(f"  {r['variant']:<14} {r['kernel']:<24} {rows_:<7} {keys:<8} warps={r['warps']:<2} "
                         f"stages={r['stages']} "
                         f"smem={r['shared'] / 1024:>6.1f} KiB  regs={r['registers']:<3} spill={r['spill_bytes']} B")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    from sparseops import _checks

    if _checks.triton_interpret():
        print("sparseops fit compiles the kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    if not _checks.triton_available():
        print("sparseops fit needs triton (pip install sparseops[triton])", file=sys.stderr)
        return 2
    from sparseops import _triton
    from sparseops.nsa import triton_fit

    arch = args.arch
    if arch is None:
        arch = _triton.arch(torch.device("cuda")) if torch.cuda.is_available() else 90
        if arch not in _triton.SHARED_LIMIT:
            print(f"sparseops fit: this GPU is sm_{arch}; pass --arch (one of {sorted(_triton.SHARED_LIMIT)})",
                  file=sys.stderr)
            return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shape = dict(G=args.group, N2=args.kv_heads, Dqk=args.dqk, Dv=args.dv, bs=args.block_size, K=args.block_count)
    try:
        rows = triton_fit.compile_report(arch, **shape, dtype=dtype, causal=not args.no_causal)
    except (ValueError, TypeError) as e:
        flag = FLAGS.get(str(e).split(":", 1)[0])
        print(f"sparseops fit: {f'{flag}: ' if flag else ''}{e}", file=sys.stderr)
        return 2
    print(f"NSA selected attention, {args.dtype}, " + ", ".join(f"{k}={v}" for k, v in shape.items())
          + f", {'not ' if args.no_causal else ''}causal: compiled for sm_{arch} ({_triton.GPU_NAMES[arch]}, "
          f"{_triton.SHARED_LIMIT[arch] // 1024} KiB of shared memory per program), nothing run")
    for line in fit_lines(rows):
        print(line)
    bad = sorted({r["variant"] for r in rows if "error" in r})
    if bad:
        print(f"does not fit: {', '.join(bad)}. backend='triton' raises there; backend='auto' runs the torch path "
              "for what does not fit")
        return 1
    spill = max(r["spill_bytes"] for r in rows)
    print("fits: backend='triton' (and 'auto') runs every kernel on such a GPU"
          + (f"; up to {spill} bytes of register spill per thread" if spill else ", without register spills"))
    return 0
