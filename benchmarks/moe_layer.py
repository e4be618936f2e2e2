"""Benchmark: the MoE layer (router + grouped SwiGLU experts + dispatch) against Hugging Face's sparse MoE block.

What is computed (both sides, the same function, the same weights): ``y_t = sum_k p_tk * expert_e(x_t)`` with
a softmax top-K router (probs renormalised over the K picks) and SwiGLU experts, ``T`` tokens, ``H`` hidden,
``F`` expert FFN size, ``E`` experts, ``K`` picks. Ours: ``sparseops.nn.MoELayer`` (one process). The peer:
``transformers``' ``Qwen3MoeSparseMoeBlock`` with ``gate_up_proj = cat(w1, w3)``, ``down_proj = w2``, timed with
each of its expert implementations that fits in memory (``grouped_mm``, its default, and ``eager``, the
per-expert loop); the fastest is the one we compare with. Outputs are checked first (fp32: the same routing
and y within the fp32 tolerance; bf16 and fp32 parameters under ``torch.autocast(bf16)``, the third row: the
tokens both route the same way, within the bf16 tolerance).

What is timed: forward + backward (``y.backward(gy)``, gradients of x and every weight), median of several
runs after a warm-up, ours and the peer's paths in turn run after run (the machine's load may drift); the
process CPU time of each call is recorded beside its wall time. The floor is the experts' matmul FLOPs, ``18 * T * K * H * F`` (forward 3 GEMMs,
backward 6), at the fp32 matmul rate measured in the same run. Goals: ours >= 1.2x faster than the peer's
fastest path, and >= 60 % of the matmul rate (floor / ours >= 0.6).

The EP section spawns 2 gloo processes and counts the bytes each dispatcher sends per rank (forward +
backward, every collective) against the minimum for the same routing: each token's row goes once to each
other rank that holds one of its experts and one combined row comes back, forward and backward.

Run: ``python benchmarks/moe_layer.py [--quick | --smoke] [--out DIR] [--no-peers]``.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

if __package__:
    from . import _common, _hf_block
else:
    import _common
    import _hf_block

# after _common, which puts a source checkout's src/ first on sys.path

from sparseops.nn import MoELayer  # noqa: E402
from sparseops.nn.reference import moe_reference  # noqa: E402
from sparseops.testing import TOLERANCES, rel_rms_error  # noqa: E402

SPEEDUP_GOAL = 1.2
FLOOR_GOAL = 0.6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the one-process rows: the parameters' dtype and the forward's autocast dtype (None: no autocast)
RUNS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "fp32 autocast bf16": (torch.float32, torch.bfloat16)}
SHAPES = {
    "full": {"T": 4096, "H": 1024, "F": 512, "E": 64, "K": 8},
    "quick": {"T": 1024, "H": 512, "F": 256, "E": 16, "K": 4},
    "smoke": {"T": 64, "H": 32, "F": 16, "E": 8, "K": 2},
}
EP_SHAPES = {
    "full": {"T": 2048, "H": 512, "F": 256, "E": 16, "K": 4},
    "quick": {"T": 512, "H": 256, "F": 128, "E": 8, "K": 2},
    "smoke": {"T": 32, "H": 16, "F": 8, "E": 4, "K": 2},
}
PEER_IMPLS = ("grouped_mm", "eager")


def median_time(fn, *, warmup: int, runs: int) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    gc.collect()
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": runs}


def matmul_rate(dtype: torch.dtype, n: int, runs: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_time(lambda: torch.mm(a, b), warmup=1, runs=runs)["median_s"]


def environment() -> dict:
    commit, load = _common.git_commit(), _common.loadavg()
    return {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": "cpu",
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": commit, "loadavg_start": load}


# ---------------------------------------------------------------------------------------------------- one process


def gate_reference() -> list[dict]:
    """Ours against the float64 per-token oracle on a small case (same choices), before anything is timed."""
    out = []
    for name, dtype in DTYPES.items():
        torch.manual_seed(3)
        layer = MoELayer(24, 12, 8, 2, shared_ffn_size=8).to(dtype)
        x = torch.randn(37, 24).to(dtype)
        with torch.no_grad():
            y = layer(x)[0]
            idx = layer.router.route(x)[2].tolist()
            p = {"router": layer.router.weight.double(), "w1": layer.experts.w1.double(),
                 "w3": layer.experts.w3.double(), "w2": layer.experts.w2.double(),
                 "shared": tuple(w.double() for w in (layer.shared.w1, layer.shared.w3, layer.shared.w2))}
            ref = moe_reference([x.double()], p, top_k=2, indices=[idx])["ys"][0]
        out.append({"dtype": name, "err": rel_rms_error(y, ref), "tol": TOLERANCES[dtype]})
    return out



def build_ours(s: dict, dtype: torch.dtype, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(s["H"], s["F"], s["E"], s["K"])
    return layer.to(dtype)


def build_peer(ours: MoELayer, s: dict, impl: str):
    """The Qwen3-MoE sparse block with our weights, or ``(None, why)``."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as exc:  # missing or broken install: reported, never fatal
        return None, f"transformers not importable ({type(exc).__name__}: {exc})"
    cfg = Qwen3MoeConfig(hidden_size=s["H"], moe_intermediate_size=s["F"], num_experts=s["E"],
                         num_experts_per_tok=s["K"], norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = impl
    dtype = ours.experts.w1.dtype
    block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        block.experts.down_proj.copy_(ours.experts.w2)
    return block, None


def fwd_bwd(module, x: torch.Tensor, gy: torch.Tensor, peer: bool, autocast: torch.dtype | None = None):
    def step():
        for p in module.parameters():
            p.grad = None
        xx = x.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = module(xx[None])[0] if peer else module(xx)[0]
        y.backward(gy.to(y.dtype))
        return y
    return step


def check_equal(ours: MoELayer, block, x: torch.Tensor, dtype: torch.dtype, autocast=None) -> dict:
    """Our y against the peer's on the same input: fp32 all tokens, bf16 (or autocast) the tokens routed alike."""
    dtype = autocast or dtype
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        y1 = ours(x)[0]
        y2 = block(x[None])[0]
        i1 = ours.router.route(x)[2].sort(-1).values
        i2 = block.gate(x)[2].sort(-1).values
    same = (i1 == i2).all(-1)
    err = rel_rms_error(y2[same], y1[same])
    ok = err <= TOLERANCES[dtype] and (dtype != torch.float32 or bool(same.all()))
    return {"same_routing_frac": float(same.float().mean()), "rel_rms_err": err, "ok": ok}


def bench_one_process(mode: str, peers: bool, warmup: int, runs: int, log) -> tuple[dict, list[dict]]:
    """Ours and each peer implementation timed in turn, run after run (ABC ABC ...), so that a change of the
    machine's load during the run affects every column alike; the median of each column is reported."""
    s = SHAPES[mode]
    floors = {"matmul_fp32_flops": matmul_rate(torch.float32, 256 if mode == "smoke" else 2048, runs),
              "matmul_bf16_flops": matmul_rate(torch.bfloat16, 256 if mode == "smoke" else 2048, runs)}
    flops = 18 * s["T"] * s["K"] * s["H"] * s["F"]
    floor_s = flops / floors["matmul_fp32_flops"]
    rows = []
    for name, (dtype, autocast) in RUNS.items():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(s["T"], s["H"], generator=g).to(dtype)
        gy = torch.randn(s["T"], s["H"], generator=g).to(dtype)
        ours = build_ours(s, dtype)
        row = {**s, "dtype": name, "flops": flops, "floor_s": floor_s, "peer": {}}
        steps = {"ours": fwd_bwd(ours, x, gy, False, autocast)}
        for impl in (PEER_IMPLS if peers else ()):
            block, why = build_peer(ours, s, impl)
            if block is None:
                row["peer_why_not"] = why
                log(f"peer skipped: {why}")
                break
            chk = check_equal(ours, block, x, dtype, autocast)
            row["peer"][impl] = {"check": chk}
            if chk["ok"]:
                steps[impl] = fwd_bwd(block, x, gy, True, autocast)
            else:
                row["peer"][impl]["error"] = "outputs differ: not timed"
        times: dict[str, list[float]] = {k: [] for k in steps}
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        for k, fn in list(steps.items()):
            try:
                for _ in range(warmup):
                    fn()
            except Exception as exc:  # a peer path this torch cannot run: reported, not fatal
                row["peer"][k]["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                del steps[k], times[k], cpu[k]
        gc.collect()
        for _ in range(runs):
            for k, fn in steps.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        row["ours_s"] = statistics.median(times["ours"])
        row["ours_cpu_s"] = statistics.median(cpu["ours"])
        row["ours_min_s"] = min(times["ours"])
        row["floor_over_ours"] = floor_s / row["ours_s"]
        log(f"{name}: ours {row['ours_s'] * 1e3:.0f} ms (floor {floor_s * 1e3:.0f} ms)")
        for k in times:
            if k != "ours":
                row["peer"][k]["time_s"] = statistics.median(times[k])
                row["peer"][k]["cpu_s"] = statistics.median(cpu[k])
                log(f"{name}: peer {k} {row['peer'][k]['time_s'] * 1e3:.0f} ms")
        timed = {k: v["time_s"] for k, v in row["peer"].items() if "time_s" in v}
        if timed:
            best = min(timed, key=timed.get)
            row["peer_best"] = best
            row["peer_best_s"] = timed[best]
            row["speedup_vs_peer"] = timed[best] / row["ours_s"]
            row["cpu_speedup_vs_peer"] = row["peer"][best]["cpu_s"] / row["ours_cpu_s"]
            row["goal_speedup_met"] = row["speedup_vs_peer"] >= SPEEDUP_GOAL
        row["goal_floor_met"] = row["floor_over_ours"] >= FLOOR_GOAL
        rows.append(row)
        del ours, steps
        gc.collect()
    return floors, rows


# ----------------------------------------------------------------------------------------------------------- EP = 2


def _ep_worker(rank, ws, s, warmup, runs):
    import torch.distributed as dist

    sent = {"bytes": 0}
    a2a, ag = dist.all_to_all_single, dist.all_gather

    def counting_a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        splits = input_split_sizes or [input.shape[0] // ws] * ws
        me = dist.get_rank(group)
        sent["bytes"] += sum(n for q, n in enumerate(splits) if q != me) * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def counting_ag(tensor_list, tensor, group=None, **kw):
        sent["bytes"] += (len(tensor_list) - 1) * tensor.numel() * tensor.element_size()
        return ag(tensor_list, tensor, group=group, **kw)

    dist.all_to_all_single, dist.all_gather = counting_a2a, counting_ag
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(s["T"], s["H"], generator=g)
    gy = torch.randn(s["T"], s["H"], generator=g)
    out = {}
    for d in ("allgather", "alltoall"):
        torch.manual_seed(0)
        layer = MoELayer(s["H"], s["F"], s["E"], s["K"], ep_group=dist.group.WORLD, dispatcher=d)
        layer(x)  # the first forward's shape check, not counted
        sent["bytes"] = 0
        step = fwd_bwd(layer, x, gy, False)
        step()
        out[d] = {"sent_bytes": sent["bytes"]}
        t = median_time(step, warmup=warmup, runs=runs)
        out[d]["time_s"] = t["median_s"]
        with torch.no_grad():
            idx = layer.router.route(x)[2]
        El = s["E"] // ws
        remote = torch.zeros(s["T"], ws, dtype=torch.bool).scatter_(1, (idx // El), True)
        remote[:, rank] = False
        out[d]["remote_pairs"] = int(remote.sum())
    return out


def bench_ep(mode: str, warmup: int, runs: int) -> dict:
    from sparseops.distributed import spawn

    s = EP_SHAPES[mode]
    res = spawn(_ep_worker, 2, s, warmup, runs, timeout=900.0)
    b = 4  # fp32
    out = {"shape": s, "ep": 2, "dtype": "fp32", "dispatchers": {}}
    pairs = [r["allgather"]["remote_pairs"] for r in res]
    # each (token, other rank) pair: x there and y back (forward), dy there and dx back (backward)
    minimum = [4 * p * s["H"] * b for p in pairs]
    minimum_per_rank = sum(minimum) / len(minimum)
    out["minimum_bytes_per_rank"] = minimum_per_rank
    for d in ("allgather", "alltoall"):
        sent = [r[d]["sent_bytes"] for r in res]
        out["dispatchers"][d] = {"sent_bytes_per_rank": sent, "mean_over_minimum": sum(sent) / len(sent) /
                                 minimum_per_rank, "time_s_per_rank": [r[d]["time_s"] for r in res]}
    return out


# ------------------------------------------------------------------------------------------------------- reporting


def markdown(record: dict) -> str:
    f, env = record["floors"], record["env"]
    lines = [f"{env['date_utc']}, {env['cpu_count']} cores ({env['torch_threads']} torch threads), torch "
             f"{env['torch']}, transformers {record.get('transformers')}, commit {env['git_commit']}, "
             f"load average {env['loadavg_start']} -> {env.get('loadavg_end')}", "",
             f"Matmul rate measured in the run: fp32 {f['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s, bf16 "
             f"{f['matmul_bf16_flops'] / 1e9:.1f} GFLOP/s.", ""]
    hdr = ("dtype", "T, H, F, E, K", "ours ms", "HF grouped_mm ms", "HF eager ms", "speedup vs HF fastest",
           "floor ms", "floor / ours", "goals (1.2x, 60 %)")
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in record["rows"]:
        def peer(impl, r=r):
            e = r["peer"].get(impl, {})
            return f"{e['time_s'] * 1e3:.0f}" if "time_s" in e else (e.get("error", "-")[:40] or "-")
        sp = f"{r['speedup_vs_peer']:.2f}x ({r['peer_best']})" if "speedup_vs_peer" in r else "-"
        g1 = "met" if r.get("goal_speedup_met") else ("missed" if "goal_speedup_met" in r else "n/a")
        g2 = "met" if r["goal_floor_met"] else "missed"
        lines.append("| " + " | ".join([r["dtype"], f"{r['T']}, {r['H']}, {r['F']}, {r['E']}, {r['K']}",
                                         f"{r['ours_s'] * 1e3:.0f}", peer("grouped_mm"), peer("eager"), sp,
                                         f"{r['floor_s'] * 1e3:.0f}", f"{r['floor_over_ours']:.0%}",
                                         f"{g1}, {g2}"]) + " |")
    lines += ["", cpu_line(record["rows"])]
    ep = record.get("ep")
    if ep:
        s = ep["shape"]
        lines += ["", f"EP = 2 (gloo, fp32, T = {s['T']} per rank, H = {s['H']}, E = {s['E']}, K = {s['K']}): bytes "
                  f"sent per rank, forward + backward; minimum for this routing "
                  f"{ep['minimum_bytes_per_rank'] / 2**20:.1f} MiB", "",
                  "| dispatcher | MiB sent (rank 0, rank 1) | mean / minimum | fwd+bwd ms (rank 0, rank 1) |",
                  "|---|---|---|---|"]
        for d, v in ep["dispatchers"].items():
            mib = ", ".join(f"{b / 2**20:.1f}" for b in v["sent_bytes_per_rank"])
            ms = ", ".join(f"{t * 1e3:.0f}" for t in v["time_s_per_rank"])
            lines.append(f"| {d} | {mib} | {v['mean_over_minimum']:.2f} | {ms} |")
    if record.get("transformers_block"):
        lines += _hf_block.markdown(record["transformers_block"], SPEEDUP_GOAL)
    return "\n".join(lines)


def cpu_line(rows: list[dict]) -> str:
    """The process CPU seconds of each timed column (all threads, median): steadier than wall time on a machine
    that other jobs share, where a preempted OpenMP thread stalls its whole region."""
    parts = []
    for r in rows:
        cols = [f"ours {r['ours_cpu_s']:.2f} s"] + [f"{k} {v['cpu_s']:.2f} s" for k, v in r["peer"].items() if "cpu_s" in v]
        ratio = f", HF fastest / ours {r['cpu_speedup_vs_peer']:.2f}x" if "cpu_speedup_vs_peer" in r else ""
        parts.append(f"{r['dtype']}: " + ", ".join(cols) + ratio)
    return "Process CPU time per fwd+bwd (median): " + "; ".join(parts) + "."


def main(argv=None) -> int:
    p = _common.make_parser(__doc__.splitlines()[0])
    p.add_argument("--no-ep", action="store_true", help="skip the EP = 2 traffic run")
    p.add_argument("--only-transformers-block", action="store_true",
                   help="time only the transformers block's experts backends (sparseops, grouped_mm, eager)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mode_name = "smoke" if args.smoke else ("quick" if args.quick else "full")
    warmup, runs = (0, 1) if args.smoke else (1, 3)
    env = environment()

    def log(msg):
        print(f"[moe_layer] {msg}", file=sys.stderr, flush=True)

    gate = gate_reference()
    bad = [g for g in gate if not g["err"] <= g["tol"]]
    if bad:
        print(f"moe_layer: ours differs from the float64 oracle: {bad}; nothing timed", file=sys.stderr)
        return 1
    if args.only_transformers_block:
        floors, rows = {"matmul_fp32_flops": matmul_rate(torch.float32, 256, 1),
                        "matmul_bf16_flops": matmul_rate(torch.bfloat16, 256, 1)}, []
    else:
        floors, rows = bench_one_process(mode_name, not args.no_peers, warmup, runs, log)
    record = {"op": "MoELayer forward + backward", "mode": mode_name, "env": env, "gate": gate, "floors": floors,
              "rows": rows}
    if not args.no_peers:
        record["transformers_block"] = _hf_block.bench(SHAPES[mode_name], RUNS, warmup, runs, SPEEDUP_GOAL, log)
    try:
        import importlib.metadata as md

        record["transformers"] = md.version("transformers")
    except Exception:
        record["transformers"] = None
    if not args.no_ep and not args.only_transformers_block:
        record["ep"] = bench_ep(mode_name, warmup, runs)
    try:
        env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    out = _common.out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "moe_layer.json"
    runs_so_far = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(runs_so_far + [record], indent=1) + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
