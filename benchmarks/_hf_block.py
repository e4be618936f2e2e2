"""The transformers block rows of ``benchmarks/moe_layer.py``: transformers' Qwen3-MoE sparse block with
``experts_implementation`` ``sparseops``, ``grouped_mm`` and ``eager``, forward + backward, in turn run after
run. sparseops' output is checked against grouped_mm's first: the same block, the same router, so the same
routing; within the tolerance of the dtype the experts compute in (the autocast dtype under autocast)."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from sparseops.testing import TOLERANCES, rel_rms_error

IMPLS = ("sparseops", "grouped_mm", "eager")


def build_block(s: dict, dtype: torch.dtype, seed: int = 0):
    """transformers' Qwen3-MoE sparse block, random weights, or ``(None, why)``."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        import sparseops.integrations.transformers  # noqa: F401  (registers "sparseops")
    except Exception as exc:  # missing or broken install: reported, never fatal
        return None, f"transformers not importable ({type(exc).__name__}: {exc})"
    cfg = Qwen3MoeConfig(hidden_size=s["H"], moe_intermediate_size=s["F"], num_experts=s["E"],
                         num_experts_per_tok=s["K"], norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, s["H"] ** -0.5)
    return block.to(dtype), None


def _step(block, impl: str, x: torch.Tensor, gy: torch.Tensor, autocast: torch.dtype | None):
    def step():
        block.experts.config._experts_implementation = impl
        for p in block.parameters():
            p.grad = None
        xx = x.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = block(xx[None])[0]
        y.backward(gy.to(y.dtype))
        return y
    return step


def _check(block, x: torch.Tensor, compute_dtype: torch.dtype, autocast: torch.dtype | None) -> dict:
    ys = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        for impl in ("sparseops", "grouped_mm"):
            block.experts.config._experts_implementation = impl
            ys[impl] = block(x[None])[0].float()
    err = rel_rms_error(ys["sparseops"], ys["grouped_mm"])
    return {"rel_rms_err_vs_grouped_mm": err, "ok": err <= TOLERANCES[compute_dtype]}


def bench(s: dict, runs_spec: dict, warmup: int, runs: int, speedup_goal: float, log) -> list[dict]:
    """One row per entry of ``runs_spec`` (name -> (parameter dtype, autocast dtype or None)) at shape ``s``."""
    rows = []
    for name, (dtype, autocast) in runs_spec.items():
        block, why = build_block(s, dtype)
        row = {**s, "dtype": name, "impl": {}}
        if block is None:
            row["why_not"] = why
            log(f"transformers block skipped: {why}")
            rows.append(row)
            continue
        g = torch.Generator().manual_seed(1)
        x = torch.randn(s["T"], s["H"], generator=g).to(dtype)
        gy = torch.randn(s["T"], s["H"], generator=g).to(dtype)
        row["check"] = _check(block, x, autocast or dtype, autocast)
        if not row["check"]["ok"]:
            log(f"{name}: sparseops differs from grouped_mm: {row['check']}; not timed")
            rows.append(row)
            continue
        steps = {impl: _step(block, impl, x, gy, autocast) for impl in IMPLS}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for fn in steps.values():
            for _ in range(warmup):
                fn()
        gc.collect()
        for _ in range(runs):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        for k, v in times.items():
            row["impl"][k] = {"time_s": statistics.median(v), "min_s": min(v)}
            log(f"{name}: transformers block, experts_implementation={k}: {row['impl'][k]['time_s'] * 1e3:.0f} ms")
        row["speedup_vs_grouped_mm"] = row["impl"]["grouped_mm"]["time_s"] / row["impl"]["sparseops"]["time_s"]
        row["goal_speedup_met"] = row["speedup_vs_grouped_mm"] >= speedup_goal
        rows.append(row)
        del block, steps
        gc.collect()
    return rows


def markdown(rows: list[dict], speedup_goal: float) -> list[str]:
    hdr = ("dtype", "T, H, F, E, K", "sparseops ms", "grouped_mm ms", "eager ms", "sparseops vs grouped_mm",
           f"goal {speedup_goal}x")
    lines = ["", "transformers Qwen3-MoE block, experts_implementation (forward + backward):", "",
             "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in rows:
        if "speedup_vs_grouped_mm" not in r:
            lines.append(f"| {r['dtype']} | - | {r.get('why_not') or r.get('check')} | | | | |")
            continue
        ms = [f"{r['impl'][k]['time_s'] * 1e3:.0f}" for k in IMPLS]
        lines.append("| " + " | ".join([r["dtype"], f"{r['T']}, {r['H']}, {r['F']}, {r['E']}, {r['K']}", *ms,
                                         f"{r['speedup_vs_grouped_mm']:.2f}x",
                                         "met" if r["goal_speedup_met"] else "missed"]) + " |")
    return lines
