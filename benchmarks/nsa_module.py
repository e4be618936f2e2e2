"""Benchmark: the Native Sparse Attention core and module (docs/nsa-module.md) on the CPU, fp32, one sequence.

(a) The NSA attention core — ``compress_kv`` (mean), ``compressed_attention``, ``select_blocks``,
    ``nsa_selected_attention`` (torch backend), ``sliding_window_attention``, the gated sum — forward + backward
    with respect to q, k, v, against dense causal ``F.scaled_dot_product_attention`` (``enable_gqa``) on the same
    q, k, v: N1 = 16, N2 = 1, Dqk = Dv = 128, blocks (l, d, l', n, w) = (32, 16, 64, 16, 512), T = 4096 .. 32768.
    Reported: both times, the speedup, the crossover length (where the core gets faster, interpolated in log T),
    the peak resident memory of a call (Linux ``VmHWM``) and per token, and (``--stages``) the time of each stage.
(b) ``sparseops.nn.NativeSparseAttention`` against ``native_sparse_attention_pytorch.SparseAttention`` (pip
    package, pure PyTorch) with the same hyper-parameters (hidden 1024, 16 heads over 1 KV head, head dim 128, mean
    compression on our side — the peer's default is a learned MLP — and the same blocks), forward + backward of a
    sum of outputs with respect to the input, at T = 4096 (1024 under ``--quick``: the peer's peak memory grows
    with T², ~14 GB at 4096). Skipped with a message when the package is missing or fails on the CPU.

Correctness first: the core at T = 300 in float64 against the dense-mask references (``module_reference``).
Timing: wall clock of whole forward + backward calls, median of the runs (one warm-up below 16384 tokens).
Run: ``python benchmarks/nsa_module.py [--quick | --smoke] [--out DIR] [--stages] [--no-peers]``.
"""

from __future__ import annotations

import ctypes
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__:
    from . import _common
else:
    import _common

# after _common, which puts a source checkout's src/ first on sys.path

import sparseops  # noqa: E402
from sparseops.nn import NativeSparseAttention  # noqa: E402
from sparseops.nsa_branches import compress_kv, compressed_attention, select_blocks, sliding_window_attention  # noqa: E402
from sparseops.nsa_branches import reference as module_reference  # noqa: E402
from sparseops.testing import TOLERANCES, rel_rms_error  # noqa: E402

NAME = "nsa_module"
BLOCKS = {"l": 32, "d": 16, "lb": 64, "n": 16, "w": 512}
HEADS = {"N1": 16, "N2": 1, "D": 128}
GOALS = {8192: 1.0, 16384: 2.5, 32768: 2.0}  # core fwd+bwd at least this much faster than SDPA
PEER_GOAL = 25.0  # module fwd+bwd at least this much faster than native-sparse-attention-pytorch
STAGES = ("compress", "cmp_attn", "select", "slc", "win", "sum")


def core(q, k, v, gates, blocks=BLOCKS, stages: dict | None = None):
    """The NSA attention core on one sequence; ``stages`` (optional) collects the forward time of each stage."""
    l, d, lb, n, w = (blocks[x] for x in ("l", "d", "lb", "n", "w"))
    T, N1, D = q.shape
    clock = [time.perf_counter()]

    def lap(name):
        if stages is not None:
            now = time.perf_counter()
            stages[name] = stages.get(name, 0.0) + now - clock[0]
            clock[0] = now

    kc, vc, cu_cmp = compress_kv(k, v, None, l, d)
    cu_cmp = [int(c) for c in cu_cmp.tolist()]
    lap("compress")
    o_cmp, lse = compressed_attention(q, kc, vc, None, cu_cmp, l, d)
    lap("cmp_attn")
    topk = select_blocks(q, kc, lse, None, cu_cmp, l, d, lb, n, 1, 2)
    lap("select")
    o_slc = sparseops.nsa_selected_attention(q, k, v, topk, D ** -0.5, N1, lb, n, actual_seq_qlen=[T],
                                             actual_seq_kvlen=[T], sparse_mode=2, backend="torch", validate=False)[0]
    lap("slc")
    o_win = sliding_window_attention(q, k, v, None, w)
    lap("win")
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    lap("sum")
    return o, topk


def core_reference(q, k, v, gates, blocks):
    """The same composition from the float64 dense-mask references."""
    l, d, lb, n, w = (blocks[x] for x in ("l", "d", "lb", "n", "w"))
    T, _, D = q.shape
    cu, s = [0, T], D ** -0.5
    kc, vc, cu_cmp = module_reference.compress_kv(k, v, cu, l, d)
    o_cmp, lse = module_reference.compressed_attention(q, kc, vc, cu, cu_cmp, l, d, s)
    topk = module_reference.select_blocks(q, kc, lse, cu, cu_cmp, l, d, lb, n, 1, 2, s)
    o_slc = module_reference.selected_attention(q, k, v, topk, cu, lb, s)
    o_win = module_reference.sliding_window_attention(q, k, v, cu, w, s)
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win, topk


def make_inputs(T, dtype=torch.float32, seed=0, N1=16, N2=1, D=128):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, n, D, generator=g).to(dtype) for n in (N1, N2, N2))
    gates = torch.rand(T, N1, 3, generator=g).to(dtype)
    do = torch.randn(T, N1, D, generator=g).to(dtype)
    return q, k, v, gates, do


def gate_correctness() -> list[dict]:
    """The core in float64 (and fp32) at a small shape against the references: output and the three gradients."""
    blocks = {"l": 32, "d": 16, "lb": 64, "n": 3, "w": 40}
    q, k, v, gates, do = make_inputs(300, torch.float64, seed=3, N1=4, N2=2, D=16)
    q = q * 3
    qkv = [t.requires_grad_() for t in (q, k, v)]
    o_ref, topk_ref = core_reference(*qkv, gates, blocks)
    want = (o_ref, *torch.autograd.grad(o_ref, qkv, do))
    checks = []
    for dtype in (torch.float64, torch.float32):
        x = [t.detach().to(dtype).requires_grad_() for t in qkv]
        o, topk = core(*x, gates.to(dtype), blocks)
        got = (o, *torch.autograd.grad(o, x, do.to(dtype)))
        checks.append({"what": f"{dtype} topk", "err": 0.0 if torch.equal(topk, topk_ref) else math.inf, "tol": 0})
        for name, a, e in zip(("o", "dq", "dk", "dv"), got, want):
            checks.append({"what": f"{dtype} {name}", "err": rel_rms_error(a, e), "tol": TOLERANCES[dtype]})
    bad = [c for c in checks if not c["err"] <= c["tol"]]
    if bad:
        raise RuntimeError(f"{NAME}: correctness gate against the references failed: {bad}")
    return checks


def sdpa(q, k, v):
    """Dense causal attention, ``[T, N, D]`` in and out."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1)


def fwd_bwd(fn, inputs, do):
    x = [t.detach().requires_grad_() for t in inputs]
    o = fn(*x)
    o = o[0] if isinstance(o, tuple) else o
    return torch.autograd.grad(o, x, do)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    """Hands the pages glibc keeps from freed blocks back to the OS (``malloc_trim``), so that a call reusing
    them counts them again; a no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_peak(fn) -> tuple[object, int | None]:
    """``(fn(), peak resident bytes during the call above the resident bytes before it)``: Linux's ``VmHWM``,
    reset through ``/proc/self/clear_refs`` after the freed heap pages went back to the OS (else a call reusing
    an earlier call's pages would show 0); None where that is not available. Includes what the allocator keeps
    cached, so it is an upper bound of the live tensors."""
    _trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
    except OSError:
        before = None
    result = fn()
    hwm = _status_kib("VmHWM")
    return result, (None if before is None or hwm is None else (hwm - before) * 1024)


def timed(fn, runs: int, warmup: int) -> dict:
    """Median wall time of ``runs`` calls after ``warmup``; the peak resident bytes of one more, untimed call (its
    heap trimmed first, which makes it fault its pages in again), or without a warm-up of the first call (whose
    pages are fresh anyway: a long call is not repeated for its memory)."""
    for _ in range(warmup):
        fn()
    times, peak = [], None
    for i in range(runs):
        t0 = time.perf_counter()
        if warmup == 0 and i == 0:
            _, peak = rss_peak(fn)
        else:
            fn()
        times.append(time.perf_counter() - t0)
    if peak is None:
        _, peak = rss_peak(fn)
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": runs, "peak_bytes": peak}


def bench_core(T: int, runs: int, stages: bool, warmup: int | None = None, side: str = "both") -> dict:
    q, k, v, gates, do = make_inputs(T)
    ours = lambda: fwd_bwd(lambda q, k, v: core(q, k, v, gates), (q, k, v), do)  # noqa: E731
    dense = lambda: fwd_bwd(sdpa, (q, k, v), do)  # noqa: E731
    warm = (1 if T < 16384 else 0) if warmup is None else warmup
    row = {"T": T}
    nan = {"median_s": math.nan, "runs": 0, "peak_bytes": None}
    t = timed(ours, runs, warm) if side != "sdpa" else nan
    row.update(ours_fwdbwd_s=t["median_s"], ours_runs=t["runs"], ours_peak_bytes=t["peak_bytes"])
    t = timed(dense, runs, warm) if side != "core" else nan
    row.update(sdpa_fwdbwd_s=t["median_s"], sdpa_runs=t["runs"], sdpa_peak_bytes=t["peak_bytes"])
    row["speedup"] = row["sdpa_fwdbwd_s"] / row["ours_fwdbwd_s"]
    if stages:
        st: dict = {}
        x = [t_.detach().requires_grad_() for t_ in (q, k, v)]
        o, _ = core(*x, gates, stages=st)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(o, x, do)
        st["backward"] = time.perf_counter() - t0
        ops = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
        st["bwd_slc"] = ops.get("sparseops::nsa_selected_attention_bwd", 0.0)
        st["bwd_cmp_win"] = ops.get("sparseops::nsa_chunked_attention_bwd", 0.0)
        row["stages_s"] = st
    return row


def crossover(rows: list[dict]) -> float | None:
    """The length where the speedup crosses 1, interpolated linearly in (log T, log speedup)."""
    pts = [(math.log(r["T"]), math.log(r["speedup"])) for r in rows]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if y0 < 0 <= y1:
            return math.exp(x0 + (x1 - x0) * (0 - y0) / (y1 - y0))
    if pts and pts[0][1] >= 0:
        return float(rows[0]["T"])  # already faster at the shortest length measured
    return None


def visible_pairs(T: int, topk: torch.Tensor, blocks=BLOCKS) -> dict:
    """Per branch, the (query token, key) pairs one query head of one sequence of T tokens attends: the selected
    blocks' keys up to the token (``topk [T, 1, n]``), the window's ``min(t + 1, w)``, the compressed blocks
    ``j`` with ``j*d + l - 1 <= t``."""
    l, d, lb, w = (blocks[x] for x in ("l", "d", "lb", "w"))
    t = torch.arange(T)
    ids = topk[:, 0, :].long()
    keys = ids[..., None] * lb + torch.arange(lb)
    slc = int(((ids[..., None] >= 0) & (keys <= t[:, None, None])).sum())
    win = int(torch.clamp(t + 1, max=w).sum())
    cmp = int(torch.where(t >= l - 1, torch.div(t - (l - 1), d, rounding_mode="floor") + 1, 0).sum())
    return {"slc": slc, "win": win, "cmp": cmp}


def module_flops(T: int, hidden: int, pairs: dict, heads=HEADS) -> float:
    """The FLOPs of the module's forward + backward with respect to its input (no weight gradients): every
    projection twice (its product and its input gradient), each branch ``14 D`` per (query head, key) pair (the
    forward's ``q.k`` and ``p v``, the backward's ``q.k`` again, ``dO.v``, ``dq``, ``dk``, ``dv``: seven products of
    ``2 D``), the selection's compressed scores once (``2 D`` per pair)."""
    N1, N2, D = heads["N1"], heads["N2"], heads["D"]
    cols = N1 * D + 3 * N2 * 2 * D + 3 * N1  # q, the three branches' k and v, the gates
    proj = 2 * (2 * T * hidden * cols + 2 * T * N1 * D * hidden)  # ... and o_proj
    attn = 14 * D * N1 * (pairs["slc"] + pairs["win"] + pairs["cmp"]) + 2 * D * N1 * pairs["cmp"]
    return float(proj + attn)


def matmul_rate() -> float:
    """fp32 FLOP/s of a ``[2048, 2048]`` matmul now, with this process's threads (the floors of ``_measure``)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / _common.median_time(lambda: torch.mm(a, b), warmup=1, min_runs=5)["median_s"]


def bench_peer(T: int, runs: int, warmup: int = 1) -> dict:
    """The module against native_sparse_attention_pytorch.SparseAttention, fwd+bwd with respect to the input."""
    row = {"T": T}
    try:
        from native_sparse_attention_pytorch import SparseAttention
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is unavailable
        row["peer_skipped"] = f"native-sparse-attention-pytorch not importable ({type(e).__name__}: {e})"
    hidden = 1024
    torch.manual_seed(0)
    ours = NativeSparseAttention(hidden, HEADS["N1"], HEADS["N2"], HEADS["D"], compress_block_size=BLOCKS["l"],
                                 compress_stride=BLOCKS["d"], select_block_size=BLOCKS["lb"],
                                 select_count=BLOCKS["n"], window_size=BLOCKS["w"], compressor="mean",
                                 backend="torch")
    x = torch.randn(T, hidden)

    def run_ours():
        xx = x.detach().requires_grad_()
        return torch.autograd.grad(ours(xx).sum(), xx)

    t = timed(run_ours, runs, warmup)
    row.update(ours_fwdbwd_s=t["median_s"], ours_runs=t["runs"])
    with torch.no_grad():
        pairs = visible_pairs(T, ours(x, return_info=True)[1]["topk_indices"])
    rate = matmul_rate()
    row.update(pairs=pairs, flops=module_flops(T, hidden, pairs), matmul_fp32_flops=rate)
    row["floor_s"] = row["flops"] / rate
    if "peer_skipped" in row:
        return row
    try:
        peer = SparseAttention(dim=hidden, dim_head=HEADS["D"], heads=HEADS["N1"], kv_heads=HEADS["N2"],
                               sliding_window_size=BLOCKS["w"], compress_block_size=BLOCKS["l"],
                               compress_block_sliding_stride=BLOCKS["d"], selection_block_size=BLOCKS["lb"],
                               num_selected_blocks=BLOCKS["n"], causal=True)

        def run_peer():
            xx = x[None].detach().requires_grad_()
            return torch.autograd.grad(peer(xx).sum(), xx)

        t = timed(run_peer, runs, warmup)
        row.update(peer_fwdbwd_s=t["median_s"], peer_runs=t["runs"], speedup=t["median_s"] / row["ours_fwdbwd_s"])
    except Exception as e:  # noqa: BLE001 - report why the peer cannot run here instead of failing the benchmark
        row["peer_skipped"] = f"native-sparse-attention-pytorch failed on the CPU ({type(e).__name__}: {e})"
    return row


def environment() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "threads": torch.get_num_threads(), "loadavg": _common.loadavg(),
            "commit": _common.git_commit(), "peer_version": _common.peer_version("native-sparse-attention-pytorch"),
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def table(rows: list[dict], peer_rows: list[dict]) -> str:
    lines = ["| T | core fwd+bwd s | SDPA fwd+bwd s | speedup | goal | core peak RSS | per token | SDPA peak RSS |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = GOALS.get(r["T"])
        mark = "-" if goal is None else f">= {goal}x: {'met' if r['speedup'] >= goal else 'missed'}"
        pk = r.get("ours_peak_bytes")
        lines.append(f"| {r['T']} | {r['ours_fwdbwd_s']:.2f} | {r['sdpa_fwdbwd_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{mark} | {_common.fmt_bytes(pk)} | {_common.fmt_bytes(pk / r['T'] if pk else None)} | "
                     f"{_common.fmt_bytes(r.get('sdpa_peak_bytes'))} |")
    co = crossover(rows) if rows else None
    lines.append("")
    lines.append(f"crossover (core as fast as SDPA): T ~ {co:.0f}" if co else
                 "crossover: not reached in the lengths measured")
    for r in rows:
        if "stages_s" in r:
            lines.append(f"T = {r['T']} forward stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["stages_s"].items()))
    for p in peer_rows:
        lines.append("")
        if "speedup" in p:
            lines.append(f"module vs native-sparse-attention-pytorch at T = {p['T']}: ours {p['ours_fwdbwd_s']:.2f} s, "
                         f"peer {p['peer_fwdbwd_s']:.2f} s, speedup {p['speedup']:.2f}x " +
                         (f"(goal >= {PEER_GOAL}x: {'met' if p['speedup'] >= PEER_GOAL else 'missed'})"
                          if p["T"] == 4096 else f"(the goal, >= {PEER_GOAL}x, is set at T = 4096)"))
        if "floor_s" in p:
            best = f"; at the floor the speedup would be {p['peer_fwdbwd_s'] / p['floor_s']:.1f}x" \
                if "peer_fwdbwd_s" in p else ""
            lines.append(f"module floor: {p['flops'] / 1e9:.0f} GFLOP at the fp32 matmul rate of the run "
                         f"({p['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s) = {p['floor_s']:.2f} s; ours at "
                         f"{p['floor_s'] / p['ours_fwdbwd_s']:.0%} of that rate{best}")
        else:
            lines.append(f"module at T = {p['T']}: ours {p['ours_fwdbwd_s']:.2f} s; peer skipped: "
                         f"{p.get('peer_skipped')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _common.make_parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="*", default=None, help="override the sequence lengths of (a)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per measurement")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before timing (default 1 below 16384 tokens, else 0; the correctness gate "
                        "has already made the first calls of every op)")
    p.add_argument("--stages", action="store_true", help="also time each stage of the core's forward")
    p.add_argument("--peer-only", action="store_true", help="run (b) only")
    p.add_argument("--side", choices=("both", "core", "sdpa"), default="both",
                   help="time only one side of (a) (two processes can then measure one length in parallel)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    print(f"{NAME}: torch {env['torch']}, {env['threads']} threads, load average {env['loadavg']}, "
          f"commit {env['commit']}", flush=True)
    checks = gate_correctness()
    print(f"correctness gate: {len(checks)} checks within tolerance of the float64 references", flush=True)
    if args.smoke:
        lengths, runs = [256, 512], 1
    elif args.quick:
        lengths, runs = [2048, 4096], 1
    else:
        lengths, runs = [4096, 8192, 16384, 32768], 3
    lengths = args.lengths or lengths
    runs = args.runs or runs
    rows = []
    for T in [] if args.peer_only else lengths:
        r = bench_core(T, runs if T < 16384 else 1, args.stages, args.warmup, args.side)
        print(f"  T = {T}: core {r['ours_fwdbwd_s']:.2f} s, SDPA {r['sdpa_fwdbwd_s']:.2f} s, "
              f"speedup {r['speedup']:.2f}x, peak RSS core {_common.fmt_bytes(r['ours_peak_bytes'])}, "
              f"SDPA {_common.fmt_bytes(r['sdpa_peak_bytes'])}; stages {r.get('stages_s')}", flush=True)
        rows.append(r)
    peer_rows = []
    if not args.no_peers and not args.smoke:
        # --quick (make run's) at T = 1024: the peer holds ~2 GB there, ~14 GB at 4096 (docs/perf.md)
        peer_rows.append(bench_peer(1024 if args.quick else 4096, runs if not args.quick else 1,
                                    1 if args.warmup is None else args.warmup))
    text = table(rows, peer_rows)
    print(text)
    out = _common.out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    record = {"name": NAME, "env": env, "quick": args.quick, "smoke": args.smoke, "checks": checks, "core": rows,
              "peer": peer_rows, "crossover_T": crossover(rows) if rows else None}
    suffix = ("_smoke" if args.smoke else "") + ("_peer" if args.peer_only else "") + \
        ("" if args.side == "both" else f"_{args.side}")
    path = out / f"{NAME}{suffix}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
