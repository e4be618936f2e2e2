"""Train a tiny NSA + MoE language model on associative recall, next to a window-only ablation and an
expert-parallel rerun (docs/demo.md).

The NSA model must recall values stored further back than its sliding window; the ablation (the same model with
the compressed and selected gates forced to 0) cannot see them and stays near chance. With --ep N the NSA training
runs again in N processes over gloo with the experts split across them, and its per-step losses are compared with
the one-process run. Prints a table, writes the loss curves as PNG (with matplotlib) and everything as JSON.

Exits 1 when the expert-parallel losses differ from the one-process losses by more than the dtype allows: at
every step in the exact configuration (--ep-mode replicated --dispatcher alltoall, the default: bitwise in
float64, <= 1e-5 relative in fp32), over the first EP_CHECK_STEPS steps otherwise (data parallelism or the
allgather dispatcher add in another order, and the training amplifies the rounding; docs/demo.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "train a tiny NSA + MoE LM on associative recall (NSA vs window-only, 1 vs N expert-parallel ranks)"

#: where a run's results go by default, relative to the working directory (in .gitignore)
DEFAULT_OUT = "sparseops-results/demo"

#: the largest relative per-step loss difference between the EP run and the one-process run, per dtype, in the
#: exact configuration (every rank runs the whole batch, each token's expert outputs summed on its own rank)
EP_RTOL = {"float32": 1e-5, "float64": 0.0}

#: the same in the other configurations, which add in another order: equal up to rounding
EP_RTOL_ROUNDING = {"float32": 1e-5, "float64": 1e-12}

#: the steps checked in the other configurations: before the recall transition amplifies rounding differences
EP_CHECK_STEPS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a smaller task (64-token sequences, 200 steps): the same point in about a quarter of the "
                             "time; no EP rerun unless --ep is given")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="training steps of each model")
    parser.add_argument("--ep", type=int, default=None, metavar="N",
                        help="expert-parallel ranks of the rerun (default 2; 0 under --quick; 0 or 1: no rerun)")
    parser.add_argument("--ep-mode", choices=("replicated", "data"), default="replicated",
                        help="replicated: every rank runs the whole batch, the MoE layers split its tokens (every "
                             "number equals the one-process run's); data: each rank trains on its own sequences "
                             "(data parallelism, equal up to rounding)")
    parser.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                        help="the MoE layers' token dispatcher under EP (alltoall keeps the one-process arithmetic)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch threads of every training process, the one-process runs and each EP rank "
                             "alike (MKL rounds some small GEMMs differently at another thread count)")
    parser.add_argument("--compile", action="store_true", help="run the models under torch.compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="DIR", default=None,
                        help=f"directory for demo.json and demo.png (default: ./{DEFAULT_OUT}/)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the JSON here (default: DIR/demo.json)")


def _progress(name: str, total: int):
    """A ``(on_step, close)`` pair drawing a progress bar with the loss and tokens/s (tqdm when installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, desc=f"{name:<12}", unit="step", file=sys.stderr, dynamic_ncols=True)

        def on_step(step: int, loss: float, tps: float) -> None:
            bar.set_postfix_str(f"loss {loss:.3f}, {tps:,.0f} tok/s", refresh=False)
            bar.update(1)

        return on_step, bar.close
    every = max(1, total // 10)

    def on_step(step: int, loss: float, tps: float) -> None:
        if (step + 1) % every == 0 or step + 1 == total:
            print(f"{name:<12} step {step + 1}/{total} loss {loss:.3f} {tps:,.0f} tok/s", file=sys.stderr, flush=True)

    return on_step, lambda: None


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("nsa", "NSA"), ("window_only", "window only")):
        ax.plot(result[key]["loss"], label=f"{label} (recall {100 * result[key]['recall']:.1f} %)")
    if result["ep"] is not None and "loss" in result["ep"]:
        ax.plot(result["ep"]["loss"], "--", label=f"NSA, EP = {result['ep']['world_size']}")
    ax.axhline(-__import__("math").log(result["config"]["chance"]), color="gray", lw=0.8, ls=":",
               label="uniform guess over the values")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"sparseops demo: associative recall ({result['config']['dtype']}, {result['config']['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _table(result: dict) -> str:
    chance = result["config"]["chance"]
    rows = [f"{'model':<14}{'final loss':>12}{'recall':>10}{'seconds':>10}{'tokens/s':>11}"]
    for key in ("nsa", "window_only"):
        r = result[key]
        rows.append(f"{key:<14}{r['loss'][-1]:>12.4f}{100 * r['recall']:>9.1f}%{r['seconds']:>10.1f}"
                    f"{r['tokens_per_second']:>11,.0f}")
    rows.append(f"chance (uniform guess over the values): {100 * chance:.1f} %")
    ep = result["ep"]
    if ep is not None:
        n = len(ep["loss"])
        checked = "" if ep["check_steps"] == n else (f"{ep['max_rel_loss_diff_checked']:.3g} over the first "
                                                     f"{ep['check_steps']} steps, ")
        rows.append(f"EP = {ep['world_size']} ({ep['mode']}, {ep['dispatcher']}) vs 1 process: max relative loss diff "
                    f"{checked}{ep['max_rel_loss_diff']:.3g} over all {n} steps (max |diff| "
                    f"{ep['max_abs_loss_diff']:.3g}, {ep['bitwise_steps']} of {n} steps bitwise equal); "
                    f"EP recall {100 * ep['recall']:.1f} % ({ep['seconds']:.1f} s)")
    rows.append(f"wall time {result['seconds']:.1f} s")
    return "\n".join(rows)


def _train_torchrun(args, task, model_cfg, train_cfg, ep: int) -> dict:
    """The EP rerun: ``sparseops train`` on ``ep`` ranks under torchrun, the demo's settings spelled out as flags.
    ``replicated``: ``--replicated-tokens`` (every rank runs the whole batch); ``data``: parallelize's FSDP layout
    with the experts split over the same ranks (``--dp-shard ep --ep ep``)."""
    from ..training.torchrun import run_torchrun
    from .train import config_argv

    layout = ["--ep", str(ep), "--replicated-tokens"] if args.ep_mode == "replicated" else [
        "--dp-shard", str(ep), "--ep", str(ep)]
    argv = [*config_argv(task, model_cfg, train_cfg), *layout, "--dispatcher", args.dispatcher, "--dtype",
            args.dtype, "--device", "cpu", *(["--compile"] if args.compile else [])]
    on_step, close = _progress(f"EP = {ep}", train_cfg.steps)
    tokens = train_cfg.batch_size * task.seq_len
    try:
        return run_torchrun(ep, argv, threads=args.threads,
                            on_step=lambda s, loss, sec: on_step(s, loss, (s + 1) * tokens / sec))
    finally:
        close()


def _train_all(args, task, model_cfg, train_cfg, ep: int, exact: bool, dtype, device) -> tuple[dict, dict | None]:
    """The NSA and window-only runs, then the EP rerun compared with the NSA run: ``(runs, ep_result)``."""
    import torch

    from ..models.train import train

    runs = {}
    for key, cfg in (("nsa", model_cfg), ("window_only", model_cfg.replace(window_only=True))):
        on_step, close = _progress(key, train_cfg.steps)
        try:
            runs[key] = train(cfg, task, train_cfg, dtype=dtype, device=device, compile=args.compile,
                              on_step=on_step)
        finally:
            close()
    if ep < 2:
        return runs, None
    reference = runs["nsa"]
    if device != "cpu":  # the EP run is on the CPU: compare it with a CPU run
        reference = train(model_cfg, task, train_cfg, dtype=dtype, compile=args.compile)
    t0 = time.perf_counter()
    r = _train_torchrun(args, task, model_cfg, train_cfg, ep)
    a, b = torch.tensor(reference["loss"], dtype=torch.float64), torch.tensor(r["loss"], dtype=torch.float64)
    rel = (a - b).abs() / a.abs()
    check = len(rel) if exact else min(EP_CHECK_STEPS, len(rel))
    return runs, {"world_size": ep, "mode": args.ep_mode, "dispatcher": args.dispatcher,
                  "max_abs_loss_diff": float((a - b).abs().max()), "max_rel_loss_diff": float(rel.max()),
                  "bitwise_steps": int((a == b).sum()), "check_steps": check,
                  "max_rel_loss_diff_checked": float(rel[:check].max()), "loss": r["loss"],
                  "recall": r["recall"], "seconds": time.perf_counter() - t0}


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from ..models.train import demo_setup
    from ._flags import check_out_dir, check_out_file, check_seed

    for name, lo in (("steps", 1), ("ep", 0), ("threads", 1)):
        v = getattr(args, name)
        if v is not None and v < lo:
            raise SystemExit(f"sparseops demo: --{name}: expected an int >= {lo}, got {v}")
    check_seed("sparseops demo", args.seed)
    task, model_cfg, train_cfg = demo_setup(quick=args.quick, steps=args.steps, seed=args.seed)
    ep = args.ep if args.ep is not None else (0 if args.quick else 2)
    if ep >= 2 and model_cfg.num_experts % ep:
        raise SystemExit(f"sparseops demo: --ep: expected a divisor of num_experts = {model_cfg.num_experts}, got {ep}")
    if ep >= 2 and args.ep_mode == "data" and train_cfg.batch_size % ep:
        raise SystemExit(f"sparseops demo: --ep: expected a divisor of batch_size = {train_cfg.batch_size} under "
                         f"--ep-mode data, got {ep}")
    exact = args.ep_mode == "replicated" and args.dispatcher == "alltoall"
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out) if args.out else Path.cwd() / DEFAULT_OUT
    json_path = Path(args.json) if args.json else out / "demo.json"
    # before training, not after it: the results are written at the end
    check_out_dir("sparseops demo", "--out", out)
    if args.json:
        check_out_file("sparseops demo", "--json", json_path)
    print(f"sparseops demo: {train_cfg.steps} steps x {train_cfg.batch_size} sequences of {task.seq_len} tokens, "
          f"{args.dtype} on {device}" + (", torch.compile" if args.compile else "")
          + (f"; then EP = {ep} over gloo ({args.ep_mode}, {args.dispatcher})" if ep >= 2 else ""), flush=True)
    start = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        runs, ep_result = _train_all(args, task, model_cfg, train_cfg, ep, exact, dtype, device)
    finally:
        torch.set_num_threads(previous)
    result = {
        "nsa": runs["nsa"], "window_only": runs["window_only"], "ep": ep_result,
        "seconds": time.perf_counter() - start,
        "config": {"chance": task.chance, "dtype": args.dtype, "device": device, "compile": args.compile,
                   "quick": args.quick, "threads": args.threads, "torch": torch.__version__,
                   "task": dataclasses.asdict(task), "model": dataclasses.asdict(model_cfg),
                   "train": dataclasses.asdict(train_cfg)},
    }
    print(_table(result))
    out.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png = out / "demo.png"
    print(f"results: {json_path}" + (f", {png}" if _plot(result, png) else " (no matplotlib: no PNG)"))
    rtol = (EP_RTOL if exact else EP_RTOL_ROUNDING)[args.dtype]
    if ep_result is not None and not ep_result["max_rel_loss_diff_checked"] <= rtol:
        print(f"EP = {ep} losses differ from the one-process losses by more than {rtol:g} relative in the first "
              f"{ep_result['check_steps']} steps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="sparseops demo", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
