"""Benchmark: ``moe_token_unpermute_with_ep_grad`` (the seed op) against Megatron-core's ``unpermute`` backward.

What is computed (both sides, the same function): for T tokens routed to K of E experts, the expert-sorted
buffer holds N = T*K rows; an expert-parallel rank owns the rows ``[s, e)`` (R = e - s) = all rows of a
contiguous group of experts. Given the gradient of the unpermuted output ``grad [T, H]``, the rank's permuted
tokens ``[R, H]`` and the router probs, compute ``permuted_tokens_grad [R, H] = grad[token] * prob`` and
``probs_grad [T, K] = <permuted_tokens[row], grad[token]>`` (0 for slots outside the window).

Megatron-core's ``unpermute`` takes ``sorted_indices`` as row -> token (ours is slot -> row), dense
``probs [T, E]`` and a ``routing_map [T, E]``, and lays rows out expert-major, tokens ascending. That is the
same layout as ours when each token picks distinct experts, so the equivalent Megatron inputs are: the
window's rows of ``stable_argsort(indices.flatten()) // K``, and the columns of ``probs``/``routing_map`` of
the rank's experts. Its backward is autograd's. Its ``probs`` gradient is dense ``[T, E_local]``; we gather it
at ``indices`` to compare with ours.

What is timed (median of several runs after warm-up, one process, same inputs):
- ``ours``: one call of ``sparseops.moe_token_unpermute_with_ep_grad`` (backend torch, default checks);
- ``megatron_bwd``: ``torch.autograd.grad`` of Megatron's ``unpermute`` output with respect to the permuted
  tokens and the local probs, on a graph built once and retained (backward only: what the seed op replaces);
- ``ours_fwdbwd`` / ``megatron_fwdbwd``: forward (``moe_token_unpermute_with_ep`` / ``unpermute``) then the
  same ``autograd.grad``, for context;
- ``floor``: ``b*H*(T + 2R)`` bytes (read grad, read permuted tokens, write permuted_tokens_grad; probs are
  negligible) divided by the copy bandwidth measured in the same run.

Run: ``python benchmarks/moe.py [--quick | --smoke] [--out DIR | --record]`` (default out: ./sparseops-results/).
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
from sparseops.moe import torch_impl  # noqa: E402
from sparseops.moe.torch_impl import _unpermute_grad_fused  # noqa: E402
from sparseops.testing import TOLERANCES, make_moe_inputs, rel_rms_error  # noqa: E402

OP = "moe_token_unpermute_with_ep_grad"
SPEEDUP_GOAL = 2.0  # ours at least this much faster than Megatron's backward
FLOOR_GOAL = 2.5  # ours at most this multiple of the memory floor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _configs(quick: bool, smoke: bool) -> list[dict]:
    if smoke:
        return [
            {"T": 96, "K": 4, "H": 48, "E": 8, "dtype": "fp32", "window": "full"},
            {"T": 96, "K": 4, "H": 48, "E": 8, "dtype": "bf16", "window": "quarter"},
        ]
    Hs = [1024] if quick else [1024, 2048]
    return [
        {"T": 4096, "K": 8, "H": H, "E": 64, "dtype": dt, "window": w}
        for dt in ("fp32", "bf16")
        for w in ("full", "quarter")
        for H in Hs
    ]


def sorted_indices_of(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot -> row int32 = ours, row -> slot int64 = ``stable_argsort(indices.flatten())``)."""
    order = torch.argsort(indices.reshape(-1).long(), stable=True)
    si = torch.empty_like(order)
    si[order] = torch.arange(order.numel())
    return si.to(torch.int32), order


def build_case(cfg: dict, seed: int = 0) -> dict:
    """Inputs for one configuration: ours and the equivalent Megatron ones (see the module doc)."""
    T, K, H, E = cfg["T"], cfg["K"], cfg["H"], cfg["E"]
    dtype = DTYPES[cfg["dtype"]]
    inp = make_moe_inputs(T, K, H, num_experts=E, dtype=dtype, seed=seed)
    indices, probs = inp["indices"], inp["probs"]
    si, order = sorted_indices_of(indices)
    counts = torch.bincount(indices.reshape(-1).long(), minlength=E)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    # quarter window: the second quarter of the experts, so that s > 0 and e < N
    e0, e1 = (0, E) if cfg["window"] == "full" else (E // 4, E // 2)
    s, e = int(starts[e0]), int(starts[e1])
    g = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(T, H, generator=g).to(dtype)
    permuted_tokens = torch.randn(e - s, H, generator=g).to(dtype)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, indices.long(), True)
    probs_dense = torch.zeros(T, E, dtype=probs.dtype).scatter_(1, indices.long(), probs)
    return {
        "cfg": cfg, "dtype": dtype, "indices": indices, "probs": probs, "sorted_indices": si, "grad": grad,
        "permuted_tokens": permuted_tokens, "s": s, "e": e, "e0": e0, "e1": e1,
        "meg_sorted_indices": (order[s:e] // K).contiguous(),
        "meg_routing_map": routing_map[:, e0:e1].contiguous(),
        "meg_probs": probs_dense[:, e0:e1].contiguous(),
    }


def ours_grad(case: dict, backend: str = "torch", cast=None):
    cast = cast or (lambda t: t)
    return sparseops.moe_token_unpermute_with_ep_grad(
        cast(case["grad"]), case["sorted_indices"], cast(case["permuted_tokens"]), cast(case["probs"]),
        range=[case["s"], case["e"]], topk_num=case["cfg"]["K"], backend=backend,
    )


def ours_fwdbwd(case: dict):
    pt = case["permuted_tokens"].detach().requires_grad_(True)
    pr = case["probs"].detach().requires_grad_(True)
    out = sparseops.moe_token_unpermute_with_ep(
        pt, case["sorted_indices"], pr, topk_num=case["cfg"]["K"], range=[case["s"], case["e"]], backend="torch"
    )
    return torch.autograd.grad(out, [pt, pr], case["grad"])


def megatron_graph(unpermute, case: dict):
    """Megatron forward under autograd: ``(out, permuted_tokens leaf, local probs leaf)``."""
    pt = case["permuted_tokens"].detach().requires_grad_(True)
    pr = case["meg_probs"].detach().requires_grad_(True)
    T, H = case["grad"].shape
    out = unpermute(pt, case["meg_sorted_indices"], restore_shape=torch.Size((T, H)), probs=pr,
                    routing_map=case["meg_routing_map"])
    return out, pt, pr


def megatron_probs_grad_as_ours(case: dict, dense_local: torch.Tensor) -> torch.Tensor:
    """Megatron's dense ``[T, E_local]`` probs gradient gathered at ``indices`` -> ``[T, K]`` (0 off-window)."""
    T, E = case["grad"].shape[0], case["cfg"]["E"]
    full = torch.zeros(T, E, dtype=dense_local.dtype)
    full[:, case["e0"]:case["e1"]] = dense_local
    return full.gather(1, case["indices"].long())


def gate_reference(dtypes=("fp32", "bf16")) -> list[dict]:
    """Ours (torch backend) against the reference oracle on small shapes, in float64 and in each dtype."""
    checks = []
    for window in ("full", "quarter"):
        cfg = {"T": 37, "K": 4, "H": 33, "E": 8, "dtype": "fp32", "window": window}
        case = build_case(cfg, seed=3)
        f64 = lambda t: t.to(torch.float64)  # noqa: E731
        want_ptg, want_pg = ours_grad(case, backend="reference", cast=f64)
        got_ptg, got_pg = ours_grad(case, backend="torch", cast=f64)
        for name, got, want in (("permuted_tokens_grad", got_ptg, want_ptg), ("probs_grad", got_pg, want_pg)):
            checks.append({"what": f"float64 {window} {name}", "err": rel_rms_error(got, want),
                           "tol": TOLERANCES[torch.float64]})
        for dt in dtypes:
            c = build_case({**cfg, "dtype": dt}, seed=3)
            want_ptg, want_pg = ours_grad(c, backend="reference", cast=f64)
            got_ptg, got_pg = ours_grad(c, backend="torch")
            for name, got, want in (("permuted_tokens_grad", got_ptg, want_ptg), ("probs_grad", got_pg, want_pg)):
                checks.append({"what": f"{dt} {window} {name}", "err": rel_rms_error(got, want),
                               "tol": TOLERANCES[DTYPES[dt]]})
    bad = [c for c in checks if not c["err"] <= c["tol"]]
    if bad:
        raise RuntimeError(f"{OP}: correctness gate against the reference failed: {bad}")
    return checks


def bench_case(case: dict, floors: dict, unpermute, *, quick: bool, smoke: bool) -> dict:
    cfg = case["cfg"]
    T, K, H = cfg["T"], cfg["K"], cfg["H"]
    dtype = case["dtype"]
    b = torch.empty((), dtype=dtype).element_size()
    R = case["e"] - case["s"]
    floor_bytes = b * H * (T + 2 * R)
    row = {**cfg, "s": case["s"], "e": case["e"], "R": R, "N": T * K, "floor_bytes": floor_bytes,
           "floor_s": floor_bytes / floors["copy_bandwidth_Bps"]}
    tol = TOLERANCES[dtype]
    timing = {"min_runs": 2, "budget_s": 0.05} if smoke else (
        {"min_runs": 3, "budget_s": 0.4} if quick else {"min_runs": 5, "budget_s": 0.8})

    # correctness on the benchmark shape: ours (dtype) against ours in float64, which the gate tied to the oracle.
    # This first call also compiles the fused CPU kernel when its dtype is new to the process (not timed below).
    fused_calls, t0 = _unpermute_grad_fused.calls, time.perf_counter()
    got_ptg, got_pg = ours_grad(case)
    row["ours_first_call_s"] = time.perf_counter() - t0
    row["ours_kernel"] = "compiled" if _unpermute_grad_fused.calls > fused_calls else "eager"
    want_ptg, want_pg = ours_grad(case, cast=lambda t: t.to(torch.float64))
    row["err_ours_ptg"] = rel_rms_error(got_ptg, want_ptg)
    row["err_ours_probs_grad"] = rel_rms_error(got_pg, want_pg)
    if not (row["err_ours_ptg"] <= tol and row["err_ours_probs_grad"] <= tol):
        raise RuntimeError(f"{OP}: ours disagrees with float64 on {cfg}: {row}")
    del got_ptg, got_pg

    t = C.median_time(lambda: ours_grad(case), **timing)
    row.update(ours_s=t["median_s"], ours_iqr_s=t["iqr_s"], ours_runs=t["runs"])
    with torch_impl.SETTINGS.override(pool_bytes=0):  # what a call allocates, not what the recycled buffers hold
        row["ours_peak_bytes"] = C.peak_memory(lambda: ours_grad(case))
    t = C.median_time(lambda: ours_fwdbwd(case), **timing)
    row.update(ours_fwdbwd_s=t["median_s"], ours_fwdbwd_runs=t["runs"])
    with torch_impl.SETTINGS.override(pool_bytes=0):
        row["ours_fwdbwd_peak_bytes"] = C.peak_memory(lambda: ours_fwdbwd(case))
    row["ours_over_floor"] = row["ours_s"] / row["floor_s"]
    row["goal_floor_met"] = row["ours_over_floor"] <= FLOOR_GOAL

    if unpermute is not None:
        try:
            out, pt, pr = megatron_graph(unpermute, case)
            m_ptg, m_pg = torch.autograd.grad(out, [pt, pr], case["grad"], retain_graph=True)
            m_pg = megatron_probs_grad_as_ours(case, m_pg)
            row["err_megatron_ptg"] = rel_rms_error(m_ptg, want_ptg)
            row["err_megatron_probs_grad"] = rel_rms_error(m_pg, want_pg)
            row["megatron_agrees"] = row["err_megatron_ptg"] <= tol and row["err_megatron_probs_grad"] <= tol
            del m_ptg, m_pg
        except Exception as exc:  # noqa: BLE001 - a broken peer is reported, not fatal
            row["megatron_error"] = C.format_exc_line(exc)
            row["megatron_agrees"] = False
            out = None
        if row["megatron_agrees"]:
            grad = case["grad"]
            t = C.median_time(lambda: torch.autograd.grad(out, [pt, pr], grad, retain_graph=True), **timing)
            row.update(megatron_bwd_s=t["median_s"], megatron_bwd_iqr_s=t["iqr_s"], megatron_bwd_runs=t["runs"])
            row["megatron_bwd_peak_bytes"] = C.peak_memory(
                lambda: torch.autograd.grad(out, [pt, pr], grad, retain_graph=True))
            del out, pt, pr

            def meg_fwdbwd():
                o, p, q = megatron_graph(unpermute, case)
                return torch.autograd.grad(o, [p, q], grad)

            t = C.median_time(meg_fwdbwd, **timing)
            row.update(megatron_fwdbwd_s=t["median_s"], megatron_fwdbwd_runs=t["runs"])
            row["megatron_fwdbwd_peak_bytes"] = C.peak_memory(meg_fwdbwd)
            row["speedup_vs_megatron_bwd"] = row["megatron_bwd_s"] / row["ours_s"]
            row["speedup_fwdbwd_vs_megatron"] = row["megatron_fwdbwd_s"] / row["ours_fwdbwd_s"]
            row["goal_speedup_met"] = row["speedup_vs_megatron_bwd"] >= SPEEDUP_GOAL
    return row


def _plot(rows: list[dict], path: Path) -> None:
    panels = []
    for dt in DTYPES:
        for w in ("full", "quarter"):
            rs = sorted((r for r in rows if r["dtype"] == dt and r["window"] == w), key=lambda r: r["H"])
            if not rs:
                continue
            ms = lambda key, rs=rs: [r[key] * 1e3 if r.get(key) is not None else None for r in rs]  # noqa: E731
            series = {"ours (seed op)": ms("ours_s"), "Megatron unpermute bwd": ms("megatron_bwd_s"),
                      "ours fwd+bwd": ms("ours_fwdbwd_s"), "Megatron fwd+bwd": ms("megatron_fwdbwd_s")}
            panels.append({
                "title": f"{dt}, {w} window (T={rs[0]['T']}, K={rs[0]['K']}, R≈{rs[0]['R']})",
                "x": [r["H"] for r in rs], "xticklabels": [str(r["H"]) for r in rs],
                "series": {k: v for k, v in series.items() if any(y is not None for y in v)},
                "floor": ms("floor_s"), "floor_label": "memory floor b·H·(T+2R)/copy BW",
            })
    C.plot_panels(path, panels, title=f"{OP} on CPU", xlabel="hidden size H")


def run(quick: bool = False, smoke: bool = False, out: Path | str | None = None, peers: bool = True,
        plot: bool = True) -> dict:
    """Run the benchmark; returns ``{"env", "floors", "gate", "peers", "rows"}`` and appends it to
    ``<out>/moe.json`` (and draws ``<out>/moe.png``); ``out`` defaults to ./sparseops-results/. Each step is
    announced on stderr as it starts."""
    t0 = time.perf_counter()
    out = Path(out) if out is not None else C.DEFAULT_OUT
    env = C.environment()
    cfgs = _configs(quick, smoke)
    use_peer = peers and not smoke
    st = C.steps("moe", 2 + use_peer + len(cfgs))
    try:
        with st.step("correctness gate: ours against the float64 reference"):
            gate = gate_reference()
        with st.step("floors: copy bandwidth and matmul rates"):
            floors = C.op_floors(quick=quick, smoke=smoke)
        unpermute, why = (None, "skipped (--smoke / --no-peers)")
        if use_peer:
            with st.step("peer: import megatron-core's unpermute"):
                unpermute, why = C.load_peer("megatron.core.transformer.moe.moe_utils", "unpermute")
        rows = []
        for i, cfg in enumerate(cfgs):
            label = f"shape {i + 1}/{len(cfgs)}: T={cfg['T']} K={cfg['K']} H={cfg['H']} {cfg['dtype']} {cfg['window']} window"
            with st.step(label + (", Megatron too" if unpermute is not None else "")):
                case = build_case(cfg)
                rows.append(bench_case(case, floors, unpermute, quick=quick, smoke=smoke))
                del case
    finally:
        st.close()
    peer_info = {"megatron_core": {"version": C.peer_version("megatron-core"), "function":
                 "megatron.core.transformer.moe.moe_utils.unpermute", "available": unpermute is not None,
                 "why_not": why}}
    return C.save_run("moe", OP, quick=quick, smoke=smoke, env=env, out=out, rows=rows, plot=_plot if plot else None,
                      floors=floors, gate=gate, peers=peer_info, duration_s=time.perf_counter() - t0)


def markdown_table(record: dict) -> str:
    """The run as Markdown: the floors, then one table row per configuration."""
    lines = C.table_preamble(record)
    hdr = ("H", "dtype", "window", "R", "ours kernel", "ours ms", "floor ms", "ours / floor", "Megatron bwd ms", "speedup",
           "ours fwd+bwd ms", "Megatron fwd+bwd ms", "ours peak", "Megatron bwd peak", "goals (2x, 2.5x floor)")
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in record["rows"]:
        def ms(key, r=r):
            return f"{r[key] * 1e3:.1f}" if r.get(key) is not None else "-"

        sp = f"{r['speedup_vs_megatron_bwd']:.2f}x" if r.get("speedup_vs_megatron_bwd") else "-"
        goals = C.goal_cell(r, "goal_speedup_met") + ", " + C.goal_cell(r, "goal_floor_met")
        cells = [str(r["H"]), r["dtype"], f"{r['window']} [{r['s']}, {r['e']})", str(r["R"]),
                 r.get("ours_kernel", "-"), ms("ours_s"),
                 ms("floor_s"), f"{r['ours_over_floor']:.2f}", ms("megatron_bwd_s"), sp, ms("ours_fwdbwd_s"),
                 ms("megatron_fwdbwd_s"), C.fmt_bytes(r.get("ours_peak_bytes")),
                 C.fmt_bytes(r.get("megatron_bwd_peak_bytes")), goals]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = C.make_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if C.answer_report(args, "moe", markdown_table, ("H", "dtype", "window"), ("ours_s", "megatron_bwd_s", "floor_s")):
        return 0
    if args.profile:
        case = build_case(_configs(args.quick, args.smoke)[0])
        print(C.profile_table(lambda: ours_grad(case)))
        return 0
    record = run(quick=args.quick, smoke=args.smoke, out=C.out_dir(args), peers=not args.no_peers,
                 plot=not args.no_plot)
    print(markdown_table(record))
    print(C.gate_line(record["gate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
