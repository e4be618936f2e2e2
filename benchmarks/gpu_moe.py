"""GPU benchmark of the MoE Triton kernels: correctness first, then speed against the torch backend, Megatron-core
/ TransformerEngine when installed, and a device copy of the same byte count (the bandwidth limit).

    python benchmarks/gpu_moe.py                 # full sweep, T in {4096, 16384, 65536}, H in {4096, 7168}, K = 8
    python benchmarks/gpu_moe.py --quick         # T = 16384, H = 7168 only
    python benchmarks/gpu_moe.py --tune          # first sweep launch configs of the two kernels, report the best
    TRITON_INTERPRET=1 python benchmarks/gpu_moe.py --cpu-smoke   # tiny shapes on the CPU: catches Python errors

Bytes an op must move (b = token bytes, pb = prob bytes, N = T*K slots, R window rows; ``+ N*4`` reads
sorted_indices):
    unpermute_grad  read grad T*H*b + read x R*H*b + write ptg R*H*b + probs N*pb + probs_grad N*pb
    unpermute       read x R*H*b + write out T*H*b + probs N*pb
    permute         read tokens T*H*b + write R*H*b + probs N*pb + permuted_probs R*pb
    permute_grad    read ptg R*H*b + write T*H*b + read ppg R*pb + write probs_grad N*pb
The copy reference is ``dst.copy_(src)`` with ``src``, ``dst`` each half the op's byte count, so both move the
same bytes; "% copy" is copy time / op time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from sparseops import testing  # noqa: E402
from sparseops.moe import reference, triton_impl  # noqa: E402

try:
    from sparseops.moe import torch_impl
except ImportError:  # the torch backend lands on another branch
    torch_impl = None

OPS = ("unpermute_grad", "unpermute", "permute", "permute_grad")


# inputs


def sorted_indices_from(indices: torch.Tensor) -> torch.Tensor:
    """slot -> row (int32): the inverse of the stable argsort of the expert ids."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    out = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    return out.scatter_(0, order, torch.arange(flat.numel(), dtype=torch.int32, device=flat.device))


def make_inputs(T, H, K, E, window, dtype, probs_dtype, device, seed=0):
    """Everything the four ops read, built on the device. ``window`` is "full" or "quarter" (rank 1 of 4)."""
    g = torch.Generator(device=device).manual_seed(seed)
    N = T * K
    s, e = (0, N) if window == "full" else (N // 4, N // 2)
    R = e - s
    indices = torch.rand(T, E, generator=g, device=device).topk(K, dim=1).indices
    si = sorted_indices_from(indices)
    probs = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=-1).to(probs_dtype)
    return dict(
        T=T, H=H, K=K, E=E, s=s, e=e, R=R, indices=indices, si=si, probs=probs,
        tokens=torch.randn(T, H, generator=g, device=device, dtype=dtype),
        grad=torch.randn(T, H, generator=g, device=device, dtype=dtype),
        x=torch.randn(R, H, generator=g, device=device, dtype=dtype),
        ppg=torch.randn(R, generator=g, device=device).to(probs_dtype),
    )


def op_args(op, a):
    K, s, e = a["K"], a["s"], a["e"]
    return {
        "unpermute_grad": (a["grad"], a["si"], a["x"], a["probs"], K, s, e),
        "unpermute": (a["x"], a["si"], a["probs"], K, s, e),
        "permute": (a["tokens"], a["si"], a["probs"], K, s, e),
        "permute_grad": (a["x"], a["si"], a["ppg"], K, s, e),
    }[op]


def op_bytes(op, a) -> int:
    T, H, K, R = a["T"], a["H"], a["K"], a["R"]
    b, pb, N = a["grad"].element_size(), a["probs"].element_size(), T * K
    body = {
        "unpermute_grad": T * H * b + 2 * R * H * b + 2 * N * pb,
        "unpermute": R * H * b + T * H * b + N * pb,
        "permute": T * H * b + R * H * b + N * pb + R * pb,
        "permute_grad": R * H * b + T * H * b + R * pb + N * pb,
    }[op]
    return body + N * a["si"].element_size()


# correctness


def check_small(device) -> None:
    """All four ops, with and without probs, against the float64 reference on a small odd shape. Raises."""
    for dtype, pdtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float32)):
        for window in ((0, 45), (7, 31), (12, 12)):
            T, K, H = 9, 5, 100
            d = testing.make_moe_inputs(T, K, H, dtype=dtype, probs_dtype=pdtype, seed=1)
            si = reference.sorted_indices_from(d["indices"])
            s, e = window
            x = torch.randn(e - s, H, dtype=torch.float64).to(dtype)
            grad = torch.randn(T, H, dtype=torch.float64).to(dtype)
            ppg = torch.randn(e - s, dtype=torch.float64).to(pdtype)
            up = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
            dev = lambda t: None if t is None else t.to(device)  # noqa: E731
            for probs in (d["probs"], None):
                name = f"{dtype}/{pdtype} window {window} probs={probs is not None}"
                got = triton_impl.unpermute_grad(dev(grad), dev(si), dev(x) if probs is not None else None, dev(probs), K, s, e)
                want = reference.unpermute_grad(up(grad), si, up(x) if probs is not None else None, up(probs), K, s, e)
                testing.assert_close(got[0], want[0], dtype=dtype, name=f"unpermute_grad ptg {name}")
                if probs is not None:
                    testing.assert_close(got[1], want[1], dtype=pdtype, name=f"unpermute_grad probs_grad {name}")
                elif not torch.equal(got[0].cpu(), reference.unpermute_grad(grad, si, None, None, K, s, e)[0]):
                    raise AssertionError(f"unpermute_grad without probs is not an exact copy: {name}")
                got = triton_impl.unpermute(dev(x), dev(si), dev(probs), K, s, e)
                testing.assert_close(got, reference.unpermute(up(x), si, up(probs), K, s, e), dtype=dtype,
                                     name=f"unpermute {name}")
                got = triton_impl.permute(dev(d["tokens"]), dev(si), dev(probs), K, s, e)
                want = reference.permute(d["tokens"], si, probs, K, s, e)
                if not torch.equal(got[0].cpu(), want[0]) or (probs is not None and not torch.equal(got[1].cpu(), want[1])):
                    raise AssertionError(f"permute is not exact: {name}")
                pp = ppg if probs is not None else None
                got = triton_impl.permute_grad(dev(x), dev(si), dev(pp), K, s, e)
                want = reference.permute_grad(up(x), si, pp, K, s, e)
                testing.assert_close(got[0], want[0], dtype=dtype, name=f"permute_grad tokens_grad {name}")
                if pp is not None and not torch.equal(got[1].cpu(), want[1]):
                    raise AssertionError(f"permute_grad probs_grad is not exact: {name}")


def check_sampled(op, out, a, n=48) -> None:
    """Check ``out`` of ``op`` at full scale on a sample of tokens (always the first and the last: int64 address
    arithmetic) against float64 math done here. Raises AssertionError."""
    T, K, s, e = a["T"], a["K"], a["s"], a["e"]
    dev = a["si"].device
    ts = torch.unique(torch.cat([torch.tensor([0, T - 1], device=dev), torch.randint(0, T, (n,), device=dev)]))
    v = a["si"].view(T, K)[ts].long()
    live = (v >= s) & (v < e)
    rows = torch.where(live, v - s, 0)
    dt, pdt = a["grad"].dtype, a["probs"].dtype
    f = torch.float64
    if op == "unpermute_grad":
        ptg, pg = out
        g = a["grad"][ts].to(f)
        want_ptg = g[:, None, :] * a["probs"][ts].to(f)[:, :, None]
        testing.assert_close(ptg[rows[live]], want_ptg[live], dtype=dt, name="ptg (sampled)")
        want_pg = torch.where(live, (a["x"][rows].to(f) * g[:, None, :]).sum(-1), 0)
        testing.assert_close(pg[ts], want_pg, dtype=pdt, name="probs_grad (sampled)")
    elif op == "unpermute":
        w = torch.where(live, a["probs"][ts].to(f), 0)
        want = (a["x"][rows].to(f) * w[:, :, None]).sum(1)
        testing.assert_close(out[ts], want, dtype=dt, name="unpermute (sampled)")
    elif op == "permute":
        pt, pp = out
        want = a["tokens"][ts][:, None, :].expand(-1, K, -1)
        if not torch.equal(pt[rows[live]], want[live]) or not torch.equal(pp[rows[live]], a["probs"][ts][live]):
            raise AssertionError("permute (sampled) is not exact")
    else:
        tg, pg = out
        want = (a["x"][rows].to(f) * live[:, :, None]).sum(1)
        testing.assert_close(tg[ts], want, dtype=dt, name="permute_grad tokens_grad (sampled)")
        want_pg = torch.where(live, a["ppg"][rows], torch.zeros((), dtype=pdt, device=dev))
        if not torch.equal(pg[ts], want_pg):
            raise AssertionError("permute_grad probs_grad (sampled) is not exact")


def compare(out, other, a, name) -> None:
    """Our output against another implementation's, within the dtype tolerances."""
    outs = out if isinstance(out, tuple) else (out,)
    others = other if isinstance(other, tuple) else (other,)
    for i, (x, y) in enumerate(zip(outs, others)):
        if x is None and y is None:
            continue
        testing.assert_close(x, y.to(torch.float64), dtype=x.dtype, name=f"{name}[{i}] vs torch backend")


# timing


def bench_ms(fn, device, slow_ok=False) -> float:
    """Median ms. GPU: ``triton.testing.do_bench`` (it flushes L2 between runs); a call over 20 ms is timed
    three times with events instead, so a slow peer cannot eat the time budget. CPU (smoke): wall clock."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    fn()
    en.record()
    torch.cuda.synchronize()
    first = st.elapsed_time(en)
    if first > 20:
        ts = [first]
        for _ in range(2 if slow_ok else 0):
            st.record()
            fn()
            en.record()
            torch.cuda.synchronize()
            ts.append(st.elapsed_time(en))
        return sorted(ts)[len(ts) // 2]
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_ms(nbytes, device) -> float:
    n = max(1, nbytes // 4)  # two uint8 buffers of half the op's bytes each
    src = torch.empty(n * 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src), device)


def peers():
    """Megatron-core / TransformerEngine unpermute, when importable: ``{name: module or None}``, reasons."""
    found, why = {}, {}
    try:
        from megatron.core.transformer.moe import moe_utils

        found["megatron-core"] = moe_utils.unpermute
    except Exception as exc:
        why["megatron-core"] = f"not installed ({type(exc).__name__})"
    try:
        import transformer_engine.pytorch as te

        found["transformer-engine"] = te.moe_unpermute
    except Exception as exc:
        why["transformer-engine"] = f"not installed ({type(exc).__name__})"
    return found, why


def megatron_backward(unpermute, a):
    """Megatron's unpermute (mask routing map) forward once, then a closure timing its backward. Megatron keeps
    no EP window, so only the full window is measured. Its row order equals ours (expert-major, stable)."""
    T, H, K, E = a["T"], a["H"], a["K"], a["E"]
    routing_map = torch.zeros(T, E, dtype=torch.bool, device=a["grad"].device)
    routing_map.scatter_(1, a["indices"], True)
    probs_dense = torch.zeros(T, E, dtype=a["probs"].dtype, device=a["grad"].device)
    probs_dense.scatter_(1, a["indices"], a["probs"])
    slots = torch.empty_like(a["si"], dtype=torch.int64)
    slots[a["si"].long()] = torch.arange(T * K, device=a["si"].device)
    row_token = slots // K
    x = a["x"].detach().requires_grad_()
    p = probs_dense.requires_grad_()
    out = unpermute(x, row_token, torch.Size([T, H]), probs=p, routing_map=routing_map)
    grad = a["grad"]

    def run():
        x.grad = None
        p.grad = None
        out.backward(grad, retain_graph=True)

    run()  # its gradient must be ours before it is timed
    ptg, pg = triton_impl.unpermute_grad(grad, a["si"], a["x"], a["probs"], K, 0, T * K)
    testing.assert_close(x.grad, ptg.to(torch.float64), dtype=ptg.dtype, name="megatron-core x.grad vs ours")
    testing.assert_close(p.grad.gather(1, a["indices"]), pg.to(torch.float64), dtype=pg.dtype,
                         name="megatron-core probs.grad vs ours")
    return run


def te_backward(moe_unpermute, a):
    import transformer_engine.pytorch as te

    tokens = a["tokens"]
    permuted, row_id_map = te.moe_permute(tokens, a["indices"].to(torch.int32), map_type="index")
    x = permuted.detach().requires_grad_()
    p = a["probs"].float().detach().requires_grad_()
    out = moe_unpermute(x, row_id_map, p, map_type="index")
    grad = a["grad"]

    def run():
        x.grad = None
        p.grad = None
        out.backward(grad, retain_graph=True)

    return run


# tuning


def tune(device, log, ops=OPS) -> dict:
    """Sweep (BLOCK_K, BLOCK_J, BLOCK_H, num_warps) of the two kernel shapes at T=16384, H=7168, K=8, bf16, full and
    quarter window, and report the best next to the built-in choice. Reports only: the sweep that follows runs
    the built-in choice, as users get it."""
    grids = {
        "unpermute_grad": [(8, bj, bh, 4) for bj in (1, 2, 4, 8) for bh in (512, 1024, 2048, 4096) if bj * bh <= 16384]
        + [(8, 8, 1024, 8), (8, 2, 4096, 8)],
        "unpermute": [(8, bj, bh, 4) for bj in (1, 2, 4, 8) for bh in (1024, 2048, 4096)] + [(8, 8, 2048, 8)],
        "permute": [(8, bj, bh, 4) for bj in (2, 4, 8) for bh in (1024, 2048, 4096) if bj * bh <= 16384],
        "permute_grad": [(8, bj, bh, w) for bj in (1, 2) for bh in (1024, 2048, 4096) for w in (4, 8)],
    }
    grids = {op: grid for op, grid in grids.items() if op in ops}
    best = {}
    for window in ("full", "quarter"):
        a = make_inputs(16384, 7168, 8, 64, window, torch.bfloat16, torch.float32, device)
        for op, grid in grids.items():
            default_ms = bench_ms(lambda op=op, a=a: getattr(triton_impl, op)(*op_args(op, a)), device)
            results = []
            for cfg in grid:
                try:
                    with triton_impl.SETTINGS.override(**{f"{op}_tile": cfg}):
                        ms = bench_ms(lambda op=op, a=a: getattr(triton_impl, op)(*op_args(op, a)), device)
                    results.append((ms, cfg))
                    log(f"  tune {op:15s} {window:8s} BLOCK_K={cfg[0]} BLOCK_J={cfg[1]} BLOCK_H={cfg[2]} "
                        f"warps={cfg[3]}: {ms:.3f} ms")
                except Exception as exc:
                    log(f"  tune {op:15s} {window:8s} {cfg}: failed {type(exc).__name__}: {exc}")
            if results:
                ms, cfg = min(results)
                best[f"{op}/{window}"] = {"config": cfg, "ms": ms, "default_ms": default_ms}
                log(f"best {op} {window}: BLOCK_K={cfg[0]} BLOCK_J={cfg[1]} BLOCK_H={cfg[2]} warps={cfg[3]} "
                    f"({ms:.3f} ms; built-in choice {default_ms:.3f} ms)")
    return best


# main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only T=16384, H=7168")
    ap.add_argument("--tune", action="store_true", help="sweep launch configs first and report the best")
    ap.add_argument("--tune-ops", default=",".join(OPS), help="comma-separated ops to --tune (default: all four)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--torch-max-T", type=int, default=16384,
                    help="time the torch backend only up to this T (its chunked loop is slow on GPUs)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_moe.json"))
    args = ap.parse_args(argv)

    t_start = time.time()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    if args.cpu_smoke:
        device = "cpu"
        Ts, Hs, K, E = (5, 12), (33,), 3, 8
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke under TRITON_INTERPRET=1 for a smoke test", file=sys.stderr)
            return 2
        device = "cuda"
        Ts, Hs, K, E = ((16384,), (7168,), 8, 64) if args.quick else ((4096, 16384, 65536), (4096, 7168), 8, 64)
    dtype, pdtype = torch.bfloat16, torch.float32
    if args.cpu_smoke:
        dtype = torch.float32  # the CPU smoke only exercises the code paths

    import triton

    env = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "commit": _commit(), "torch_backend": "sparseops.moe.torch_impl" if torch_impl else "missing",
    }
    found, missing = peers()
    env["peers"] = {**{k: "installed" for k in found}, **missing}
    log(f"env: {json.dumps(env)}")

    check_small(device)
    log("correctness: all four ops match the float64 reference on small shapes (bf16/f16/f32, 3 windows)")

    tuned = tune(device, log, args.tune_ops.split(",")) if args.tune and device == "cuda" else {}

    rows = []
    for T in Ts:
        for H in Hs:
            for window in ("full", "quarter"):
                try:
                    a = make_inputs(T, H, K, E, window, dtype, pdtype, device)
                except Exception as exc:
                    log(f"T={T} H={H} {window}: inputs failed: {type(exc).__name__}: {exc}")
                    rows.append(dict(T=T, H=H, K=K, window=window, error=f"inputs: {exc}"))
                    continue
                for op in OPS:
                    rows.extend(bench_op(op, a, window, device, found, args, log))
                del a
                if device == "cuda":
                    torch.cuda.empty_cache()

    log("")
    log(f"{'op':15s} {'T':>6s} {'H':>5s} {'window':8s} {'impl':19s} {'ms':>9s} {'TB/s':>7s} {'% copy':>7s}")
    for r in rows:
        if "error" in r:
            log(f"{r.get('op', '-'):15s} {r['T']:6d} {r['H']:5d} {r['window']:8s} {r.get('impl', '-'):19s} "
                f"FAILED: {r['error'][:80]}")
        else:
            log(f"{r['op']:15s} {r['T']:6d} {r['H']:5d} {r['window']:8s} {r['impl']:19s} {r['ms']:9.3f} "
                f"{r['tbps']:7.2f} {r['pct_copy']:6.1f}%")
    seed = [r for r in rows if r.get("op") == "unpermute_grad" and r.get("impl") == "sparseops-triton"
            and r.get("T") == 16384 and r.get("H") == 7168 and r.get("window") == "full" and "ms" in r]
    if seed:
        log(f"seed op at T=16384 H=7168 K=8 bf16 full window: {seed[0]['pct_copy']:.1f}% of copy bandwidth "
            f"(goal >= 80%)")
    log(f"total {time.time() - t_start:.1f} s")

    result = {"env": env, "tuned": tuned, "rows": rows, "log": lines}
    if not args.cpu_smoke or args.out != ap.get_default("out"):
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        log(f"wrote {args.out}")
    failed = [r for r in rows if "error" in r and r.get("impl") == "sparseops-triton"]
    return 1 if failed else 0


def bench_op(op, a, window, device, found, args, log) -> list:
    T, H, K = a["T"], a["H"], a["K"]
    base = dict(op=op, T=T, H=H, K=K, window=window, R=a["R"], dtype=str(a["grad"].dtype)[6:],
                probs_dtype=str(a["probs"].dtype)[6:], bytes=op_bytes(op, a))
    out_rows = []

    def row(impl, fn, copy, slow_ok=False):
        r = dict(base, impl=impl)
        try:
            ms = bench_ms(fn, device, slow_ok)
            r.update(ms=ms, tbps=base["bytes"] / ms / 1e9, pct_copy=100.0 * copy / ms)
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{op} T={T} H={H} {window} {impl}: {r['error']}")
            if os.environ.get("SPARSEOPS_BENCH_TRACEBACK"):
                traceback.print_exc()
        out_rows.append(r)
        return r

    args_ = op_args(op, a)
    fn = getattr(triton_impl, op)
    try:
        out = fn(*args_)
        check_sampled(op, out, a)
    except Exception as exc:
        log(f"{op} T={T} H={H} {window}: sparseops-triton WRONG or failed: {type(exc).__name__}: {exc}")
        out_rows.append(dict(base, impl="sparseops-triton", error=f"check: {type(exc).__name__}: {exc}"))
        return out_rows
    try:
        copy = copy_ms(base["bytes"], device)
        out_rows.append(dict(base, impl="device-copy", ms=copy, tbps=base["bytes"] / copy / 1e9, pct_copy=100.0))
    except Exception as exc:
        log(f"copy failed: {exc}")
        copy = math.nan
    row("sparseops-triton", lambda: fn(*args_), copy)
    del out

    if torch_impl is not None and T <= args.torch_max_T:
        tfn = getattr(torch_impl, op)
        try:
            compare(fn(*args_), tfn(*args_), a, op)
            row("sparseops-torch", lambda: tfn(*args_), copy, slow_ok=True)
        except Exception as exc:
            log(f"{op} T={T} H={H} {window} torch backend: {type(exc).__name__}: {exc}")
            out_rows.append(dict(base, impl="sparseops-torch", error=f"{type(exc).__name__}: {exc}"))
        if device == "cuda":
            torch.cuda.empty_cache()

    if op == "unpermute_grad" and window == "full":
        if "megatron-core" in found:
            try:
                row("megatron-core (bwd)", megatron_backward(found["megatron-core"], a), copy, slow_ok=True)
            except Exception as exc:
                out_rows.append(dict(base, impl="megatron-core (bwd)", error=f"{type(exc).__name__}: {exc}"))
        if "transformer-engine" in found:
            try:
                row("transformer-engine (bwd)", te_backward(found["transformer-engine"], a), copy, slow_ok=True)
            except Exception as exc:
                out_rows.append(dict(base, impl="transformer-engine (bwd)", error=f"{type(exc).__name__}: {exc}"))
    return out_rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
