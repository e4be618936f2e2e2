"""NSA selected attention on the GPU: Triton forward / backward (atomic and deterministic) vs a bf16 matmul.

    python benchmarks/gpu_nsa.py              # full run (T = 8K, 32K, 64K at G = 16; G = 1, 4 at 32K)
    python benchmarks/gpu_nsa.py --quick      # T = 8K and 32K only
    python benchmarks/gpu_nsa.py --cpu-smoke  # correctness part + table code under TRITON_INTERPRET=1, tiny
    python benchmarks/gpu_nsa.py --compile-check [--arch 80]  # cubins without a GPU: shared memory, spills

First checks correctness (Triton vs the float64 reference on a tiny shape, and vs a dense fp32 gather
implementation with autograd and the torch backend on a moderate shape; a failure is recorded in the JSON and
every row is marked ``verified: false``: the device run is one shot), then times each op with
``triton.testing.do_bench`` (median) and reports TFLOP/s on *visible-key* FLOPs:
forward ``2 * (Dqk + Dv) * G * visible (token, key) pairs``, backward 2.5x that, and the ratio to a
bf16 matmul measured in the same run. fla-core's ``parallel_nsa`` is timed when installed (it needs G a
power of two >= 16). Results: a table on stdout and JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import sys

if __name__ == "__main__" and "--cpu-smoke" in sys.argv:
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sparseops import testing  # noqa: E402
from sparseops.nsa import reference, triton_fit, triton_impl, triton_plan  # noqa: E402

if __package__:
    from .gpu_nsa_inputs import dense_gather, make_inputs, traffic, visible_pairs  # noqa: E402
else:
    from gpu_nsa_inputs import dense_gather, make_inputs, traffic, visible_pairs  # noqa: E402

PAPER = dict(N2=4, G=16, Dqk=192, Dv=128, bs=64, K=16)


def copy_gbps(device, smoke):
    """Device copy bandwidth (read + write bytes / time) of a 1 GiB clone, in GB/s."""
    n = (1 << 16) if smoke else (1 << 28)
    x = torch.empty(n, dtype=torch.float32, device=device)
    ms = bench(lambda: x.clone(), smoke)
    return 2 * 4 * n / ms / 1e6


# correctness gate


def check_reference(device):
    """Tiny shape, fp32 inputs, against the float64 reference: forward and all gradients, both dK/dV paths."""
    a = testing.make_nsa_inputs([7, 21], [30, 40], N1=4, N2=2, Dqk=48, Dv=32, bs=16, K=3, empty_frac=0.2,
                                duplicates=True, device=device)
    q, k, v, topk = a["query"], a["key"], a["value"], a["topk_indices"]
    cu_q = [0] + a["actual_seq_qlen"]
    cu_kv = [0] + a["actual_seq_kvlen"]
    sc, bs = a["scale_value"], a["selected_block_size"]
    out, m, l = triton_impl.forward(q, k, v, topk, sc, bs, cu_q, cu_kv, True)
    r = reference.forward(q.double(), k.double(), v.double(), topk, sc, bs, cu_q, cu_kv, True)
    testing.assert_close(out, r[0], torch.float32, "out (tiny)")
    dout = torch.randn_like(out)
    rg = reference.backward(q.double(), k.double(), v.double(), r[0], dout.double(), r[1], r[2], topk, sc, bs,
                            cu_q, cu_kv, True)
    for det in (False, True):
        gs = triton_impl.backward(q, k, v, out, dout, m, l, topk, sc, bs, cu_q, cu_kv, True, deterministic=det)
        for name, x, y in zip(("dq", "dk", "dv"), gs, rg):
            testing.assert_close(x, y, torch.float32, f"{name} (tiny, deterministic={det})")


def check_dense(device, T, G, dtype, Dqk, Dv, bs, K, N2, pattern="uniform"):
    """Moderate shape in the benchmark dtype against the dense fp32 gather (inputs upcast from the same values).
    ``pattern="nsa"``: neighbours share blocks, so the forward and dQ run mostly wide packs."""
    q, k, v, topk, cu = make_inputs([T // 2, T - T // 2], N2=N2, G=G, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=dtype,
                                    device=device, seed=1, pattern=pattern)
    sc = 1.0 / math.sqrt(Dqk)
    out, m, l = triton_impl.forward(q, k, v, topk, sc, bs, cu, cu, True)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = dense_gather(*leaves, topk, sc, bs, cu, cu, True)
    where = f"T={T}, G={G}, {pattern}"
    testing.assert_close(out, ref, dtype, f"out ({where})")
    dout = torch.randn_like(out)
    ref.backward(dout.float())
    gs = triton_impl.backward(q, k, v, out, dout, m, l, topk, sc, bs, cu, cu, True, deterministic=False)
    gd = triton_impl.backward(q, k, v, out, dout, m, l, topk, sc, bs, cu, cu, True, deterministic=True)
    gd2 = triton_impl.backward(q, k, v, out, dout, m, l, topk, sc, bs, cu, cu, True, deterministic=True)
    for name, x, y, z, w in zip(("dq", "dk", "dv"), gs, gd, gd2, leaves):
        testing.assert_close(x, w.grad, dtype, f"{name} ({where})")
        testing.assert_close(y, w.grad, dtype, f"{name} deterministic ({where})")
        if not torch.equal(y, z):
            raise AssertionError(f"{name}: deterministic backward differs between two calls")
    try:
        from sparseops.nsa import torch_impl
    except ImportError:
        return
    # the torch backend on the same (upcast) inputs: a second, independent implementation
    up = [t.detach().float() for t in (q, k, v)]
    t_out, _, _ = torch_impl.forward(*up, topk, sc, bs, cu, cu, True)
    testing.assert_close(out, t_out, dtype, f"out vs torch_impl ({where})")
    tg = torch_impl.backward(*up, t_out, dout.float(), m, l, topk, sc, bs, cu, cu, True)
    for name, x, y in zip(("dq", "dk", "dv"), gs, tg):
        testing.assert_close(x, y, dtype, f"{name} vs torch_impl ({where})")


# timing


def bench(fn, smoke, rep=60):
    """Median ms; ``rep``: ms of repetitions (the big rows take 200, so that a 30 ms call still gets ~7)."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def extra_mib(fn, device):
    """Memory one call allocates above what was live before it, from one call outside ``bench`` (do_bench holds
    a 256 MiB L2-flush buffer while it times, which would count)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def matmul_tflops(device, smoke):
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if not smoke else torch.float32)
    b = torch.randn(n, n, device=device, dtype=a.dtype)
    ms = bench(lambda: a @ b, smoke)
    return 2 * n**3 / ms / 1e9


def fla_runner(q, k, v, topk, bs, cu, scale, ref_out=None, dout=None, ref_grads=None):
    """fla-core's parallel_nsa forward+backward closures and its errors against ours (output; dq, dk, dv for the
    same ``dout``), or a string saying why it cannot run."""
    try:
        from fla.ops.nsa import parallel_nsa  # type: ignore
    except Exception as e:  # noqa: BLE001
        return f"not installed ({type(e).__name__}: {str(e)[:200]})"
    N1, N2 = q.shape[1], k.shape[1]
    G = N1 // N2
    if G < 16 or G & (G - 1):
        return f"cannot run: fla needs G a power of two >= 16, got {G}"
    cu_t = torch.tensor(cu, dtype=torch.int64, device=q.device)
    qq, kk, vv = (t.detach()[None].requires_grad_(True) for t in (q, k, v))
    bi = topk.to(torch.int64)[None]
    K = topk.shape[2]
    try:
        # the selected-attention kernels alone: parallel_nsa would add mean-pooled compressed keys and a gate
        # multiply that are not part of this op. block_counts = K: fla skips -1 slots itself.
        from fla.ops.nsa.parallel import ParallelNSAFunction  # type: ignore

        def fwd():
            return ParallelNSAFunction.apply(qq, kk, vv, bi, K, bs, scale, cu_t)
    except ImportError:
        kw = dict(g_slc=None, g_swa=None, block_indices=bi, block_counts=K, block_size=bs, scale=scale,
                  cu_seqlens=cu_t)

        def fwd():
            return parallel_nsa(qq, kk, vv, **kw)

    try:
        o = fwd()
        do = dout[None] if dout is not None else torch.randn_like(o)
        o.backward(do)
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {str(e)[:160]}"
    err = {}
    if ref_grads is not None:
        grads = (qq.grad[0], kk.grad[0], vv.grad[0])
        err.update({n: testing.rel_rms_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    o = fwd()
    if ref_out is not None:
        err["out"] = testing.rel_rms_error(o[0], ref_out)
    if err:
        print("  fla parallel_nsa vs ours: relative RMS " + ", ".join(f"{n} {e:.2e}" for n, e in err.items()),
              flush=True)

    def bwd():
        for t in (qq, kk, vv):
            t.grad = None
        o.backward(do, retain_graph=True)

    return fwd, bwd, err


def run_row(device, T, G, dtype, smoke, cfg, pattern="uniform"):
    N2, Dqk, Dv, bs, K = cfg["N2"], cfg["Dqk"], cfg["Dv"], cfg["bs"], cfg["K"]
    q, k, v, topk, cu = make_inputs([T], N2=N2, G=G, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=dtype, device=device,
                                    pattern=pattern)
    sc = 1.0 / math.sqrt(Dqk)
    vis = visible_pairs(topk, bs, cu, cu, True)
    fwd_flop = 2.0 * (Dqk + Dv) * G * vis
    bwd_flop = 2.5 * fwd_flop
    out, m, l = triton_impl.forward(q, k, v, topk, sc, bs, cu, cu, True)
    dout = torch.randn_like(out)
    row = {"T": T, "G": G, "selection": pattern, "N2": N2, "Dqk": Dqk, "Dv": Dv, "bs": bs, "K": K, "visible_pairs": vis,
           "fwd_flop": fwd_flop, "bwd_flop": bwd_flop, **traffic(q, topk, vis, bs, Dv, cu)}
    # what the forward's launches do here: wide / ordinary programs and their block loads, against one per token
    pack = triton_plan.pack_stats(q, topk, cu, cu, bs, Dv)
    row.update({f"fwd_{n}": x for n, x in pack.items()})
    row["fwd_block_loads_vs_per_token"] = (pack["wide_steps"] + pack["ordinary_steps"]) / max(1, pack["token_steps"])
    bwd = partial(triton_impl.backward, q, k, v, out, dout, m, l, topk, sc, bs, cu, cu, True)
    rep = 200 if T >= 32768 else 60
    row["fwd_ms"] = bench(lambda: triton_impl.forward(q, k, v, topk, sc, bs, cu, cu, True), smoke, rep)
    row["bwd_ms"] = bench(bwd, smoke, rep)
    row["bwd_det_ms"] = bench(partial(bwd, deterministic=True), smoke, rep)
    row["bwd_extra_mib"] = extra_mib(bwd, device)
    row["bwd_det_extra_mib"] = extra_mib(partial(bwd, deterministic=True), device)
    # the peer last, and on its own: its failure must not lose our numbers of this row
    try:
        fla = fla_runner(q, k, v, topk, bs, cu, sc, out, dout, bwd()) if not smoke else "skipped (smoke)"
        if isinstance(fla, str):
            row["fla"] = fla
        else:
            row.update({f"fla_{n}_rel_rms_vs_ours": e for n, e in fla[2].items()})
            row["fla_fwd_ms"] = bench(fla[0], smoke, rep)
            row["fla_bwd_ms"] = bench(fla[1], smoke, rep)
            row["fla"] = "ok"
    except Exception as e:  # noqa: BLE001
        row["fla"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    return row


# offline compile check (no GPU needed): cubins for a GPU, shared memory, registers and spills


def compile_check(Gs=(1, 4, 16, 32), cfg=None, arch=90):
    """Compile every launch of the forward and the three backward variants for ``sm_<arch>`` without a GPU
    (``triton_fit.compile_report``, as ``sparseops fit``) at each G and print each kernel's shared memory,
    registers and spill stack. Returns the rows, each with its G."""
    from sparseops import _triton
    from sparseops.cli.fit import fit_lines

    cfg = cfg or PAPER
    shape = {k: cfg[k] for k in ("N2", "Dqk", "Dv", "bs", "K")}
    print(f"sm_{arch} ({_triton.GPU_NAMES[arch]}), {_triton.SHARED_LIMIT[arch]} bytes of shared memory per program; "
          + ", ".join(f"{k}={v}" for k, v in shape.items()) + ", bf16")
    rows = []
    for G in Gs:
        tile = triton_plan._q_tile(G, shape["K"], shape["bs"], triton_plan._head_blocks(shape["Dqk"], shape["Dv"]))[0]
        print(f"G={G}: forward / dQ tiles of {tile['PACK']} token(s) x {tile['BLOCK_G']} head rows, and wide packs of "
              f"{triton_plan.wide_pack_size(G)} tokens x {triton_plan._next_pow2(G)} (forward and dQ on sm_90 / "
              "sm_100, the forward alone on mma.sync GPUs; rows= below)")
        got = triton_fit.compile_report(arch, G=G, **shape)
        for line in fit_lines(got):
            print(line, flush=True)
        rows += [{"G": G, **r} for r in got]
    return rows


def tune(device, cfg, smoke=False, on_step=None):
    """Time forward / backward variants of the launch settings (``triton_plan.SETTINGS``) at T = 32K, G = 16."""
    N2, Dqk, Dv, bs, K = cfg["N2"], cfg["Dqk"], cfg["Dv"], cfg["bs"], cfg["K"]
    q, k, v, topk, cu = make_inputs([48 if smoke else 32768], N2=N2, G=2 if smoke else 16, Dqk=Dqk, Dv=Dv, bs=bs,
                                    K=K, dtype=torch.float32 if smoke else torch.bfloat16, device=device)
    sc = 1.0 / math.sqrt(Dqk)
    # token packing at G = 16: wide packs (4 tokens x 16 heads, wgmma) where a pack shares enough blocks
    # (WIDE_SHARE), off (WIDE_ROWS = 0), always (WIDE_SHARE = 1e9), and ordinary packs of 2 tokens (PACK_ROWS =
    # 32). A variant names its knobs in capitals in the results; they are the settings' fields in lower case. With uniformly drawn ids neighbours rarely share a block (the adaptive rule should keep them ordinary:
    # its cost there is the pack table); on the NSA-like selection (first, own and previous block forced, the rest
    # shared by each 64-token window) a shared block loads once per pack.
    nsa_ids = testing.make_topk_indices([q.shape[0]], [q.shape[0]], N2, K, bs, seed=2, device=device, chunk=8192,
                                        pattern="nsa")
    selections = {"uniform": topk, "nsa": nsa_ids}
    # the forward's out and stats with the base settings, the backward's inputs for every variant
    fwd = {name: triton_impl.forward(q, k, v, ids, sc, bs, cu, cu, True) for name, ids in selections.items()}
    dout = torch.randn_like(fwd["uniform"][0])
    # most telling first: a run cut short by its time limit keeps the variants it finished
    # (DKV_KEY_ROWS = 32: two dK/dV programs per 64-key block, half the shared memory each, q/dY gathered twice)
    variants = [{}, {"DKV_ROWS": 64}, {"DQ_ATOMIC": True}, {"CHUNK": 64}, {"DKV_KEY_ROWS": 16}] if smoke else [
        {}, {"DQ_ATOMIC": True}, {"DKV_ROWS": 64}, {"DQ_ATOMIC": True, "DKV_ROWS": 16}, {"DKV_KEY_ROWS": 32},
        {"FWD_STAGES": 3},
        {"FWD_STAGES": 1}, {"DKV_ROWS": 16}, {"DKV_STAGES": 3}, {"DKV_STAGES": 1}, {"CHUNK": 64}, {"CHUNK": 1024},
        {"DKV_WARPS": 4}]
    # (settings, selection, time the deterministic backward too); the first run of a selection is its base
    packing = [{}, {"WIDE_ROWS": 0}, {"WIDE_SHARE": 1e9}, {"WIDE_SHARE": 0.25}, {"WIDE_ROWS": 0, "PACK_ROWS": 32}]
    runs = [(var, "uniform", True) for var in variants] + [({"WIDE_ROWS": 0}, "uniform", False)] + [
        (var, "nsa", False) for var in packing]
    res, refs = [], {}
    for var, sel, det in runs:
        label = var if sel == "uniform" else {**var, "selection": sel}
        ids = selections[sel]
        out, m, l = fwd[sel]
        try:
            with triton_plan.SETTINGS.override(**{n.lower(): x for n, x in var.items()}):
                row, err = _tune_run(q, k, v, ids, out, dout, m, l, sc, bs, cu, refs, sel, det, smoke)
            res.append({**label, **row, "rel_rms_vs_base": err})
            times = ", ".join(f"{n[:-3].replace('_', ' ')} {row[n]:.3f} ms" for n in row if n.endswith("_ms"))
            print(f"tune {label or 'base'}: {times} (out/dq/dk/dv vs base: rel. RMS <= {err:.1e})", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"tune {label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            res.append({**label, "error": f"{type(e).__name__}: {e}"})
        if on_step is not None:
            on_step(res)
    return res


def _tune_run(q, k, v, ids, out, dout, m, l, sc, bs, cu, refs, sel, det, smoke):
    """One tuning variant under the settings in force: its times, and its results' error against its selection's
    base (a wrong variant must not look fast)."""
    fwd_call = partial(triton_impl.forward, q, k, v, ids, sc, bs, cu, cu, True)
    bwd_call = partial(triton_impl.backward, q, k, v, out, dout, m, l, ids, sc, bs, cu, cu, True)
    got = (*fwd_call()[:1], *bwd_call())
    ref = refs.setdefault(sel, got)
    err = max(testing.rel_rms_error(x, y) for x, y in zip(got, ref))
    row = {"fwd_ms": bench(fwd_call, smoke), "bwd_ms": bench(bwd_call, smoke)}
    if det:
        row["bwd_det_ms"] = bench(partial(bwd_call, deterministic=True), smoke)
    return row, err


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_nsa.json"


def output_path(out: str, smoke: bool) -> Path | None:
    """Where the JSON goes: ``--out``; the CPU rehearsal only where ``--out`` says, since the default is the GPU
    runs' recorded results (as gpu_moe.py)."""
    return None if smoke and Path(out) == DEFAULT_OUT else Path(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 8K and 32K only")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--tune", action="store_true", help="also time launch-setting variants at T=32K, G=16")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile the kernels for a GPU without one and print shared memory / registers / spills")
    ap.add_argument("--arch", type=int, default=90,
                    help="--compile-check target: 90 (H100/H200), 100 (B200), 80, 86, 89, 120")
    args = ap.parse_args()
    if args.compile_check:
        compile_check(arch=args.arch)
        return
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("gpu_nsa.py needs a CUDA device (or --cpu-smoke)")
    device = "cpu" if smoke else "cuda"
    import triton

    t0 = time.time()
    out = output_path(args.out, smoke)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(), "smoke": smoke,
        **{n: getattr(triton_plan.SETTINGS.get(), n) for n in ("chunk", "dq_atomic", "wide_rows", "wide_share")},
    }
    res = {"meta": meta, "rows": [], "tune": None}

    def save(stage):
        # written after every stage, so a run cut short by its time limit still leaves what it measured
        meta["stage"], meta["wall_s"] = stage, time.time() - t0
        if out is not None:
            out.write_text(json.dumps(res, indent=1))

    print("correctness: tiny shape vs float64 reference ...", flush=True)
    try:
        check_reference(device)
        if smoke:
            check_dense(device, 40, 2, torch.float32, 48, 32, 16, 2, 2)
            check_dense(device, 40, 2, torch.float32, 48, 32, 16, 2, 2, pattern="nsa")
        else:
            paper = {k: PAPER[k] for k in ("Dqk", "Dv", "bs", "K", "N2")}
            check_dense(device, 1024, 16, torch.bfloat16, **paper)
            check_dense(device, 1024, 16, torch.bfloat16, **paper, pattern="nsa")  # wide packs
            check_dense(device, 512, 1, torch.bfloat16, **paper)
        meta["correct"] = True
        print(f"correctness ok ({time.time() - t0:.1f}s)", flush=True)
    except AssertionError as e:
        # a device run is one shot: record the failure loudly and still time, every row marked unverified (no
        # speed is claimed from it; docs/perf.md)
        meta["correct"], meta["correct_error"] = False, str(e)[:2000]
        traceback.print_exc()
        print("CORRECTNESS GATE FAILED: every timing below is unverified", flush=True)

    mm = meta["matmul_tflops"] = matmul_tflops(device, smoke)
    bw = meta["copy_gbps"] = copy_gbps(device, smoke)
    print(f"bf16 matmul 8192^3: {mm:.1f} TFLOP/s; device copy (1 GiB clone): {bw:.0f} GB/s", flush=True)
    if smoke:
        cfg = dict(N2=2, Dqk=32, Dv=16, bs=32, K=2)
        rows_todo = [(48, 2, "uniform"), (48, 1, "uniform"), (48, 2, "nsa")]
        dtype = torch.float32
    else:
        cfg = {k: PAPER[k] for k in ("N2", "Dqk", "Dv", "bs", "K")}
        Ts = [8192, 32768] if args.quick else [8192, 32768, 65536]
        rows_todo = [(T, 16, "uniform") for T in Ts] + [(32768 if not args.quick else 8192, g, "uniform")
                                                         for g in (1, 4)]
        # NSA-like selection (neighbours share most blocks: more L2 reuse, and packs load a shared block once for
        # all their tokens: wide packs of 4 tokens at G = 16, 64 at G = 1); --tune times the packing variants
        rows_todo += [(32768 if not args.quick else 8192, g, "nsa") for g in (16, 1)]
        dtype = torch.bfloat16
    meta["config"], meta["dtype"] = cfg, str(dtype)
    save("correct")
    rows = res["rows"]
    for T, G, pattern in rows_todo:
        try:
            r = run_row(device, T, G, dtype, smoke, cfg, pattern)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            print(f"row T={T} G={G} {pattern} failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"T": T, "G": G, "selection": pattern, "error": f"{type(e).__name__}: {e}"})
            save(f"row T={T} G={G} {pattern}")
            continue
        for p in ("fwd", "bwd", "bwd_det"):
            r[f"{p}_tflops"] = r[f"{p.split('_')[0]}_flop"] / r[f"{p}_ms"] / 1e9
        r["fwd_pct_matmul"] = 100 * r["fwd_tflops"] / mm
        r["bwd_pct_matmul"] = 100 * r["bwd_tflops"] / mm
        r["det_over_default"] = r["bwd_det_ms"] / r["bwd_ms"]
        # gathered bytes per second, and as a multiple of the device copy bandwidth (> 1: L2 serves reuse)
        r["fwd_gather_gbps"] = r["fwd_gather_bytes"] / r["fwd_ms"] / 1e6
        r["bwd_gather_gbps"] = r["bwd_gather_bytes"] / r["bwd_ms"] / 1e6
        r["fwd_gather_x_copy"] = r["fwd_gather_gbps"] / bw
        r["bwd_gather_x_copy"] = r["bwd_gather_gbps"] / bw
        if "fla_bwd_ms" in r:
            r["bwd_speedup_vs_fla"] = r["fla_bwd_ms"] / r["bwd_ms"]
            r["fwd_speedup_vs_fla"] = r["fla_fwd_ms"] / r["fwd_ms"]
        r["verified"] = meta["correct"]
        rows.append(r)
        save(f"row T={T} G={G} {pattern}")
        print(f"row T={T} G={G} {pattern}: fwd {r['fwd_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} ms, det {r['bwd_det_ms']:.3f} ms",
              flush=True)

    hdr = (f"{'T':>6} {'G':>3} {'sel':>7} | {'fwd ms':>8} {'TF/s':>6} {'%mm':>5} {'xcopy':>5} {'loads':>5} | "
           f"{'bwd ms':>8} {'TF/s':>6} "
           f"{'%mm':>5} {'xcopy':>5} | {'det ms':>8} {'det/def':>7} | fla")
    print()
    print(f"NSA selected attention, N2={cfg['N2']} Dqk={cfg['Dqk']} Dv={cfg['Dv']} bs={cfg['bs']} K={cfg['K']}, "
          f"causal, {str(dtype).replace('torch.', '')}; matmul {mm:.1f} TFLOP/s, copy {bw:.0f} GB/s; FLOPs on "
          "visible keys; xcopy = gathered K/V bytes per second / copy bandwidth; loads = key blocks the forward "
          "loads (wide packs share them) / one load per token's slot; sel = block ids drawn uniformly "
          "per token, or NSA-like (first/own/previous block forced, the rest shared per 64-token window)")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>6} {r['G']:>3} {r['selection']:>7} | failed: {r['error'][:80]}")
            continue
        fla = r["fla"] if "fla_bwd_ms" not in r else (
            f"fwd {r['fla_fwd_ms']:.3f} ms (x{r['fwd_speedup_vs_fla']:.2f}), bwd {r['fla_bwd_ms']:.3f} ms "
            f"(x{r['bwd_speedup_vs_fla']:.2f})")
        print(f"{r['T']:>6} {r['G']:>3} {r['selection']:>7} | {r['fwd_ms']:>8.3f} {r['fwd_tflops']:>6.1f} {r['fwd_pct_matmul']:>5.1f} "
              f"{r['fwd_gather_x_copy']:>5.2f} {r['fwd_block_loads_vs_per_token']:>5.2f} | {r['bwd_ms']:>8.3f} "
              f"{r['bwd_tflops']:>6.1f} "
              f"{r['bwd_pct_matmul']:>5.1f} {r['bwd_gather_x_copy']:>5.2f} | "
              f"{r['bwd_det_ms']:>8.3f} {r['det_over_default']:>7.2f} | {fla}")

    if args.tune:
        res["tune"] = tune(device, cfg, smoke, lambda t: (res.__setitem__("tune", t), save("tune")))
    save("done")
    print(f"\nwrote {out} ({time.time() - t0:.0f}s)" if out is not None else
          f"\n(--cpu-smoke without --out: nothing written; {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
