"""Benchmark: ``nsa_selected_attention`` forward + backward against fla-core's ``naive_nsa_selection``.

Same inputs on both sides: one causal sequence of T tokens (TND, N1 query heads sharing N2 KV heads), each
query attending K blocks of ``bs`` keys chosen by ``sparseops.testing.make_topk_indices``. fla takes
``[B, T, H, D]`` tensors with a batch dim and ``block_indices [B, T, N2, K]`` (int64), the same block ids, the
same ``-1`` = empty slot and the same causal rule (key position <= query position), so the mapping is
``x[None]`` and ``topk_indices[None].long()``.

What is timed (median after warm-up, one process):
- ``ours_fwdbwd``: ``sparseops.nsa_selected_attention`` under autograd then ``torch.autograd.grad`` of the
  output with respect to q, k, v (backend torch); ``ours_fwd`` and ``ours_bwd`` (the seed op
  ``nsa_selected_attention_grad`` given the forward's out / stats) separately;
- ``fla_fwdbwd``: fla's ``naive_nsa_selection`` then the same ``autograd.grad``;
- the matmul floor: FLOPs on visible (query head, key) pairs over the fp32 (and bf16) matmul rate measured
  in the same run. Per visible pair (docs/nsa.md): forward ``2·(Dqk + Dv)`` (S = Q·Kᵀ, O = P·V);
  backward ``2·(3·Dqk + 2·Dv)`` (S recomputed, dV = Pᵀ·dY, dP = dY·Vᵀ, dQ = dS·K, dK = dSᵀ·Q);
  forward + backward ``2·(4·Dqk + 3·Dv)``. A duplicated block counts twice (it is attended twice).

Run: ``python benchmarks/nsa.py [--quick | --smoke] [--out DIR | --record]`` (default out: ./sparseops-results/).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if __package__:
    from . import _common as C
else:
    import _common as C

# after _common, which puts a source checkout's src/ first on sys.path
import sparseops  # noqa: E402
from sparseops.nsa import reference as nsa_reference  # noqa: E402
from sparseops.testing import TOLERANCES, make_nsa_inputs, rel_rms_error  # noqa: E402

OP = "nsa_selected_attention"
SPEEDUP_GOAL = 10.0  # ours fwd+bwd at least this much faster than fla's naive fwd+bwd
MATMUL_GOAL = 0.30  # ours fwd+bwd at least this share of the measured fp32 matmul rate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = {"N1": 16, "N2": 1, "Dqk": 192, "Dv": 128, "bs": 64}


def _configs(quick: bool, smoke: bool) -> list[dict]:
    if smoke:
        return [
            {"T": 80, "K": 2, "N1": 4, "N2": 2, "Dqk": 32, "Dv": 16, "bs": 16, "dtype": "fp32"},
            {"T": 80, "K": 2, "N1": 4, "N2": 2, "Dqk": 32, "Dv": 16, "bs": 16, "dtype": "bf16"},
        ]
    if quick:
        tk = [(256, 4), (512, 8)]
        return [{"T": T, "K": K, **SHAPE, "dtype": "fp32"} for T, K in tk] + [
            {"T": 512, "K": 8, **SHAPE, "dtype": "bf16"}]
    tk = [(256, 4), (512, 8), (1024, 16), (2048, 16)]
    # then fewer query heads per KV head at T = 4096: G = 16, 4, 1 (N1 = 16 query heads throughout), and the
    # paper's heads (N1 = 64, N2 = 4) at T = 8192, where uniformly drawn blocks are rarely shared by the tokens
    # of a chunk (the torch path's global tiles)
    return [{"T": T, "K": K, **SHAPE, "dtype": dt} for dt in ("fp32", "bf16") for T, K in tk] + [
        {"T": 4096, "K": 16, **SHAPE, "N2": n2, "dtype": "fp32"} for n2 in (1, 4, 16)] + [
        {"T": 8192, "K": 16, **SHAPE, "N1": 64, "N2": 4, "dtype": "fp32"}]


def flops_per_pair(Dqk: int, Dv: int) -> dict:
    return {"fwd": 2 * (Dqk + Dv), "bwd": 2 * (3 * Dqk + 2 * Dv), "fwdbwd": 2 * (4 * Dqk + 3 * Dv)}


def visible_pairs(topk: torch.Tensor, seqlens_q: list[int], seqlens_kv: list[int], bs: int, G: int,
                  causal: bool) -> int:
    """Number of (query head, gathered key) pairs that are visible (docs/nsa.md), duplicates counted."""
    total = 0
    t0 = 0
    for S1, S2 in zip(seqlens_q, seqlens_kv):
        idx = topk[t0:t0 + S1].long()  # [S1, N2, K]
        start = idx * bs
        n = (S2 - start).clamp(max=bs)
        if causal:
            pos = torch.arange(S1)[:, None, None]
            n = torch.minimum(n, pos - start + 1)
        n = torch.where(idx >= 0, n.clamp(min=0), torch.zeros_like(n))
        total += int(n.sum())
        t0 += S1
    return total * G


def build_case(cfg: dict, seed: int = 0) -> dict:
    inp = make_nsa_inputs([cfg["T"]], N1=cfg["N1"], N2=cfg["N2"], Dqk=cfg["Dqk"], Dv=cfg["Dv"], bs=cfg["bs"],
                          K=cfg["K"], dtype=DTYPES[cfg["dtype"]], causal=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    dout = torch.randn(cfg["T"], cfg["N1"], cfg["Dv"], generator=g).to(DTYPES[cfg["dtype"]])
    return {"cfg": cfg, "inp": inp, "dout": dout}


def _op_kwargs(inp: dict) -> dict:
    return {k: inp[k] for k in ("actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}


def ours_fwd(case: dict, cast=None, requires_grad: bool = False):
    inp = case["inp"]
    cast = cast or (lambda t: t)
    q, k, v = (cast(inp[n]).detach().requires_grad_(requires_grad) for n in ("query", "key", "value"))
    res = sparseops.nsa_selected_attention(
        q, k, v, inp["topk_indices"], inp["scale_value"], inp["head_num"], inp["selected_block_size"],
        inp["selected_block_count"], **_op_kwargs(inp), backend="torch")
    return res, (q, k, v)


def ours_fwdbwd(case: dict, cast=None):
    cast = cast or (lambda t: t)
    (out, _, _), qkv = ours_fwd(case, cast, requires_grad=True)
    return (out, *torch.autograd.grad(out, qkv, cast(case["dout"])))


def ours_bwd(case: dict, out, m, l):
    inp = case["inp"]
    return sparseops.nsa_selected_attention_grad(
        inp["query"], inp["key"], inp["value"], out, case["dout"], m, l, inp["topk_indices"],
        scale_value=inp["scale_value"], selected_block_size=inp["selected_block_size"],
        selected_block_count=inp["selected_block_count"], head_num=inp["head_num"], **_op_kwargs(inp),
        backend="torch")


def fla_fwdbwd(naive, case: dict):
    inp = case["inp"]
    q, k, v = (inp[n][None].detach().requires_grad_(True) for n in ("query", "key", "value"))
    block_indices = inp["topk_indices"][None].long()
    o = naive(q, k, v, block_indices, inp["selected_block_size"], inp["scale_value"])
    dq, dk, dv = torch.autograd.grad(o, [q, k, v], case["dout"][None])
    return o[0], dq[0], dk[0], dv[0]


def gate_reference(dtypes=("fp32", "bf16")) -> list[dict]:
    """Ours (torch backend, through autograd) against the reference oracle on small odd shapes:
    two sequences, GQA, a partial last block, empty slots and duplicates, causal and not."""
    checks = []
    for causal in (True, False):
        # sequences of 9 and 28 tokens: the second ends inside its second block (28 = 16 + 12)
        inp64 = make_nsa_inputs([9, 28], N1=4, N2=2, Dqk=24, Dv=16, bs=16, K=3, dtype=torch.float64,
                                causal=causal, empty_frac=0.2, duplicates=True, seed=5)
        cu_q = [0] + list(inp64["actual_seq_qlen"])
        cu_kv = [0] + list(inp64["actual_seq_kvlen"])
        g = torch.Generator().manual_seed(11)
        dout64 = torch.randn(inp64["query"].shape[0], 4, 16, generator=g, dtype=torch.float64)
        q, k, v = inp64["query"], inp64["key"], inp64["value"]
        args = (inp64["topk_indices"], inp64["scale_value"], 16, cu_q, cu_kv, causal)
        out, m, l = nsa_reference.forward(q, k, v, *args)
        dq, dk, dv = nsa_reference.backward(q, k, v, out, dout64, m, l, *args)
        want = {"out": out, "dq": dq, "dk": dk, "dv": dv}
        for dt in ("float64", *dtypes):
            dtype = torch.float64 if dt == "float64" else DTYPES[dt]
            case = {"inp": inp64, "dout": dout64.to(dtype)}
            got = dict(zip(("out", "dq", "dk", "dv"), ours_fwdbwd(case, cast=lambda t, d=dtype: t.to(d))))
            for name in want:
                checks.append({"what": f"{dt} {'causal' if causal else 'full'} {name}",
                               "err": rel_rms_error(got[name], want[name]), "tol": TOLERANCES[dtype]})
    bad = [c for c in checks if not c["err"] <= c["tol"]]
    if bad:
        raise RuntimeError(f"{OP}: correctness gate against the reference failed: {bad}")
    return checks


def _time_seed_backward(case: dict, timing: dict) -> dict:
    """The seed op alone, given the forward's output and stats."""
    (out, m, l), _ = ours_fwd(case)
    t = C.median_time(lambda: ours_bwd(case, out, m, l), **timing)
    return {"ours_bwd_s": t["median_s"], "ours_bwd_runs": t["runs"],
            "ours_bwd_peak_bytes": C.peak_memory(lambda: ours_bwd(case, out, m, l))}


#: (T*K, seconds) of each fla call measured in this process, to skip calls that would take too long. fla
#: gathers all K*bs keys of every query, visible or not, so its cost grows with T*K.
_FLA_SPEED: list[tuple[int, float]] = []


def fla_estimate_s(naive, case: dict) -> float:
    """fla's fwd+bwd time for this shape, extrapolated linearly in T*K from the largest call measured so far
    (or from a probe on the first 64 tokens: a causal prefix is a smaller instance of the same problem)."""
    cfg = case["cfg"]
    if not _FLA_SPEED:
        n = min(cfg["T"], 64)
        inp = dict(case["inp"])
        for name in ("query", "key", "value", "topk_indices"):
            inp[name] = inp[name][:n]
        probe = {"cfg": cfg, "inp": inp, "dout": case["dout"][:n]}
        t0 = time.perf_counter()
        fla_fwdbwd(naive, probe)
        _FLA_SPEED.append((n * cfg["K"], time.perf_counter() - t0))
    work, secs = max(_FLA_SPEED)
    return secs * cfg["T"] * cfg["K"] / work


def bench_case(case: dict, floors: dict, naive, *, quick: bool, smoke: bool, fla_budget_s: float = 60.0) -> dict:
    cfg = case["cfg"]
    T, dtype = cfg["T"], DTYPES[cfg["dtype"]]
    inp = case["inp"]
    G = cfg["N1"] // cfg["N2"]
    pairs = visible_pairs(inp["topk_indices"], [T], [T], cfg["bs"], G, causal=True)
    fpp = flops_per_pair(cfg["Dqk"], cfg["Dv"])
    row = {**cfg, "causal": True, "visible_pairs": pairs, "flops_fwd": fpp["fwd"] * pairs,
           "flops_bwd": fpp["bwd"] * pairs, "flops_fwdbwd": fpp["fwdbwd"] * pairs}
    row["floor_fwdbwd_s"] = row["flops_fwdbwd"] / floors["matmul_fp32_flops"]
    tol = TOLERANCES[dtype]
    timing = {"min_runs": 2, "budget_s": 0.05} if smoke else (
        {"min_runs": 3, "budget_s": 0.5} if quick else {"min_runs": 5 if T < 1024 else 3, "budget_s": 1.0})

    # correctness on the benchmark shape: ours against ours in float64 (tied to the oracle by the gate)
    want = ours_fwdbwd(case, cast=lambda t: t.to(torch.float64))
    got = ours_fwdbwd(case)
    names = ("out", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want):
        row[f"err_ours_{name}"] = rel_rms_error(a, b)
    if not all(row[f"err_ours_{n}"] <= tol for n in names):
        raise RuntimeError(f"{OP}: ours disagrees with float64 on {cfg}: {row}")
    del got

    t = C.median_time(lambda: ours_fwdbwd(case), **timing)
    row.update(ours_fwdbwd_s=t["median_s"], ours_fwdbwd_iqr_s=t["iqr_s"], ours_fwdbwd_runs=t["runs"])
    row["ours_fwdbwd_peak_bytes"] = C.peak_memory(lambda: ours_fwdbwd(case))
    t = C.median_time(lambda: ours_fwd(case), **timing)
    row.update(ours_fwd_s=t["median_s"], ours_fwd_runs=t["runs"])
    row["ours_fwd_peak_bytes"] = C.peak_memory(lambda: ours_fwd(case))
    row.update(_time_seed_backward(case, timing))
    row["ours_fwdbwd_flops_per_s"] = row["flops_fwdbwd"] / row["ours_fwdbwd_s"]
    row["ours_share_of_matmul_fp32"] = row["ours_fwdbwd_flops_per_s"] / floors["matmul_fp32_flops"]
    row["ours_share_of_matmul_bf16"] = (row["ours_fwdbwd_flops_per_s"] / floors["matmul_bf16_flops"]
                                        if floors.get("matmul_bf16_units", True) else None)
    row["goal_matmul_met"] = row["ours_share_of_matmul_fp32"] >= MATMUL_GOAL
    row["ours_peak_bytes_per_token"] = (row["ours_fwdbwd_peak_bytes"] / T) if row["ours_fwdbwd_peak_bytes"] else None

    if naive is not None:
        est = row["fla_estimated_s"] = fla_estimate_s(naive, case)
        if est > fla_budget_s:
            row["fla_skipped"] = f"estimated {est:.0f} s per call > budget {fla_budget_s:.0f} s"
            naive = None
        elif dtype != torch.float32 and T > 256 and not smoke:
            # fla computes in fp32 whatever the input dtype: beyond the smallest shape its bf16 time is its
            # fp32 time again, not worth timing twice
            row["fla_skipped"] = "bf16: fla computes in fp32, timed at T=256 only"
            naive = None
    if naive is not None:
        try:
            # the correctness check is also fla's warm-up and its peak-memory measurement
            t0 = time.perf_counter()
            row["fla_fwdbwd_peak_bytes"], got = C.peak_memory_and_result(lambda: fla_fwdbwd(naive, case))
            row["fla_first_call_s"] = time.perf_counter() - t0  # under the profiler: indicative only
            for name, a, b in zip(names, got, want):
                row[f"err_fla_{name}"] = rel_rms_error(a, b)
            row["fla_agrees"] = all(row[f"err_fla_{n}"] <= tol for n in names)
            del got
        except Exception as exc:  # noqa: BLE001 - a broken peer is reported, not fatal
            row["fla_error"] = C.format_exc_line(exc)
            row["fla_agrees"] = False
        if row["fla_agrees"]:
            # fla loops over queries in Python: seconds per call. The check above was the warm-up; then a
            # median of 3 when a call is short, else one more call.
            first = row["fla_first_call_s"]
            n = 1 if first > 3.0 or smoke else 3
            t = C.median_time(lambda: fla_fwdbwd(naive, case), warmup=0, min_runs=n, max_runs=n, budget_s=0.0)
            row.update(fla_fwdbwd_s=t["median_s"], fla_fwdbwd_iqr_s=t["iqr_s"], fla_fwdbwd_runs=t["runs"])
            _FLA_SPEED.append((T * cfg["K"], row["fla_fwdbwd_s"]))
            row["speedup_vs_fla"] = row["fla_fwdbwd_s"] / row["ours_fwdbwd_s"]
            row["goal_speedup_met"] = row["speedup_vs_fla"] >= SPEEDUP_GOAL
    del want
    return row


def _plot(rows: list[dict], path: Path) -> None:
    panels = []
    g = rows[0]["N1"] // rows[0]["N2"]  # the main sweep's G (the extra G rows come last)
    for dt in DTYPES:
        rs = sorted((r for r in rows if r["dtype"] == dt and r["N1"] // r["N2"] == g), key=lambda r: r["T"])
        if not rs:
            continue
        ms = lambda key, rs=rs: [r[key] * 1e3 if r.get(key) is not None else None for r in rs]  # noqa: E731
        series = {"ours fwd+bwd": ms("ours_fwdbwd_s"), "ours bwd (seed op)": ms("ours_bwd_s"),
                  "ours fwd": ms("ours_fwd_s"), "fla naive fwd+bwd": ms("fla_fwdbwd_s")}
        panels.append({
            "title": f"{dt}: N1={rs[0]['N1']}, N2={rs[0]['N2']}, Dqk={rs[0]['Dqk']}, Dv={rs[0]['Dv']}, "
                     f"bs={rs[0]['bs']}, causal",
            "x": [r["T"] for r in rs], "xticklabels": [f"{r['T']}\nK={r['K']}" for r in rs],
            "series": {k: v for k, v in series.items() if any(y is not None for y in v)},
            "floor": ms("floor_fwdbwd_s"), "floor_label": "fwd+bwd FLOPs / fp32 matmul rate",
        })
    C.plot_panels(path, panels, title=f"{OP} forward + backward on CPU", xlabel="tokens T (blocks K)")


def run(quick: bool = False, smoke: bool = False, out: Path | str | None = None, peers: bool = True,
        plot: bool = True, peer_budget_s: float | None = None) -> dict:
    """Run the benchmark; returns ``{"env", "floors", "gate", "peers", "rows"}`` and appends it to
    ``<out>/nsa.json`` (and draws ``<out>/nsa.png``); ``out`` defaults to ./sparseops-results/. fla calls
    estimated to take longer than ``peer_budget_s`` seconds (default 10 quick, 25 full) are skipped and
    reported as such. Each step is announced on stderr as it starts."""
    t0 = time.perf_counter()
    out = Path(out) if out is not None else C.DEFAULT_OUT
    env = C.environment()
    cfgs = _configs(quick, smoke)
    use_peer = peers and not smoke
    st = C.steps("nsa", 2 + use_peer + len(cfgs))
    try:
        with st.step("correctness gate: ours against the float64 reference"):
            gate = gate_reference()
        with st.step("floors: copy bandwidth and matmul rates"):
            floors = C.op_floors(quick=quick, smoke=smoke)
        naive, why = (None, "skipped (--smoke / --no-peers)")
        if use_peer:
            with st.step("peer: import fla-core's naive_nsa_selection"):
                naive, why = C.load_peer("fla.ops.nsa.naive", "naive_nsa_selection")
        rows = []
        _FLA_SPEED.clear()
        budget = peer_budget_s or (10.0 if quick else 25.0)
        for i, cfg in enumerate(cfgs):
            label = (f"shape {i + 1}/{len(cfgs)}: T={cfg['T']} K={cfg['K']} N1={cfg['N1']} N2={cfg['N2']} "
                     f"{cfg['dtype']}" + (", fla too (when it fits the budget)" if naive is not None else ""))
            with st.step(label):
                case = build_case(cfg)
                rows.append(bench_case(case, floors, naive, quick=quick, smoke=smoke, fla_budget_s=budget))
                del case
    finally:
        st.close()
    peer_info = {"fla_core": {"version": C.peer_version("fla-core"), "function":
                 "fla.ops.nsa.naive.naive_nsa_selection", "available": naive is not None, "why_not": why}}
    return C.save_run("nsa", OP, quick=quick, smoke=smoke, env=env, out=out, rows=rows, plot=_plot if plot else None,
                      floors=floors, flops_per_visible_pair=flops_per_pair(192, 128), gate=gate, peers=peer_info,
                      duration_s=time.perf_counter() - t0)


def markdown_table(record: dict) -> str:
    """The run as Markdown: the floors, then one table row per configuration."""
    lines = C.table_preamble(record)
    hdr = ("T", "K", "G", "dtype", "ours fwd+bwd ms", "ours fwd ms", "ours bwd (seed) ms", "fla fwd+bwd ms",
           "speedup", "GFLOP/s", "% of fp32 matmul", "ours peak", "peak / token", "fla peak",
           "goals (10x, 30%)")
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in record["rows"]:
        def ms(key, r=r):
            return f"{r[key] * 1e3:.1f}" if r.get(key) is not None else "-"

        sp = f"{r['speedup_vs_fla']:.1f}x" if r.get("speedup_vs_fla") else (
            "skipped" if r.get("fla_skipped") else "-")
        goals = C.goal_cell(r, "goal_speedup_met") + ", " + C.goal_cell(r, "goal_matmul_met")
        cells = [str(r["T"]), str(r["K"]), str(r["N1"] // r["N2"]), r["dtype"], ms("ours_fwdbwd_s"), ms("ours_fwd_s"), ms("ours_bwd_s"),
                 ms("fla_fwdbwd_s") if r.get("fla_fwdbwd_s") else (
                     "(fp32 math: as fp32)" if "bf16" in r.get("fla_skipped", "") else
                     f"(est. {r['fla_estimated_s']:.0f} s)" if r.get("fla_skipped") else "-"),
                 sp, f"{r['ours_fwdbwd_flops_per_s'] / 1e9:.1f}", f"{100 * r['ours_share_of_matmul_fp32']:.0f}%",
                 C.fmt_bytes(r.get("ours_fwdbwd_peak_bytes")), C.fmt_bytes(r.get("ours_peak_bytes_per_token")),
                 C.fmt_bytes(r.get("fla_fwdbwd_peak_bytes")), goals]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = C.make_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if C.answer_report(args, "nsa", markdown_table, ("T", "K", "N2", "dtype"), ("ours_fwdbwd_s", "fla_fwdbwd_s")):
        return 0
    if args.profile:
        fp32 = [c for c in _configs(args.quick, args.smoke) if c["dtype"] == "fp32"]
        # the largest T of the main sweep (G = 16), not the extra G rows
        case = build_case(([c for c in fp32 if c["N2"] == SHAPE["N2"] and c["T"] <= 2048] or fp32)[-1])
        print(C.profile_table(lambda: ours_fwdbwd(case)))
        return 0
    record = run(quick=args.quick, smoke=args.smoke, out=C.out_dir(args), peers=not args.no_peers,
                 plot=not args.no_plot, peer_budget_s=args.peer_budget)
    print(markdown_table(record))
    print(C.gate_line(record["gate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
