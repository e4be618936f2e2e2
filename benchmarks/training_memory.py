"""Per-rank parameter + optimizer memory of the NSA + MoE LM under ``parallelize``, against one process.

For each layout (W = 1, 2, 4 spawned gloo processes; FSDP / HSDP / DDP; ep = 1, 2, 4) the script builds the
LM of ``sparseops.models`` in fp32, parallelizes it, takes one AdamW step on zero gradients (so that the
optimizer allocates its moments) and counts, on every rank, the bytes of the tensors it holds at rest (between
steps): the parameters' local storage (a DTensor's ``to_local()``) and the optimizer state's (``exp_avg``,
``exp_avg_sq``, ``step``). Gradients are freed by ``zero_grad`` and activations are not counted. Prints one
Markdown table (the largest rank of each layout) and writes ``training_memory.json`` where ``--out`` says.

    python benchmarks/training_memory.py            # W = 1, 2, 4
    python benchmarks/training_memory.py --smoke    # a tiny model, W = 1 and 2 (the test)
"""

from __future__ import annotations

import sys

import torch

if __package__:
    from . import _common as C
else:
    import _common as C


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _model_config(smoke: bool):
    from sparseops.models.lm import LMConfig

    if smoke:
        return LMConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn_size=32,
                        num_experts=4, top_k=2, expert_ffn_size=16, window_size=16, select_count=3)
    return LMConfig(vocab_size=8192, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=1, head_dim=64,
                    dense_layers=1, ffn_size=768, num_experts=16, top_k=2, expert_ffn_size=256, window_size=128)


def measure(rank: int, world: int, layout: tuple | None, smoke: bool) -> dict:
    """One rank's bytes of parameters and optimizer state after one step (``layout`` None: no parallelize).

    The step runs on zero gradients: the optimizer allocates its moments at the parameters' (local) shapes,
    which is all that is counted, without the cost of a forward and backward."""
    from sparseops.distributed import ParallelDims, parallelize
    from sparseops.models.lm import CausalLM

    cfg = _model_config(smoke)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    if layout is not None:
        dp_replicate, ep, data_parallel = layout
        model = parallelize(model, ParallelDims(dp_replicate=dp_replicate, ep=ep), data_parallel=data_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = sum(_bytes(p) for p in model.parameters())
    experts = sum(_bytes(p) for n, p in model.named_parameters() if ".experts." in f".{n}")
    optim = sum(_bytes(v) for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "experts": experts, "optim": optim}


def _worker(rank: int, world: int, layout: tuple, smoke: bool) -> dict:
    return measure(rank, world, layout, smoke)


LAYOUTS = [  # (W, dp_replicate, ep, data_parallel)
    (2, 1, 2, "fsdp"), (2, 1, 2, "ddp"), (2, 1, 1, "fsdp"),
    (4, 1, 2, "fsdp"), (4, 1, 4, "fsdp"), (4, 2, 2, "fsdp"), (4, 1, 4, "ddp"),
]


def main(argv: list[str] | None = None) -> int:
    from sparseops.distributed import spawn

    parser = C.make_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    env = C.environment()
    base = measure(0, 1, None, args.smoke)
    layouts = [lay for lay in LAYOUTS if lay[0] == 2][:2] if args.smoke else LAYOUTS
    rows = [{"world": 1, "layout": "one process", **base, "total": base["params"] + base["optim"]}]
    for W, dp_replicate, ep, data_parallel in layouts:
        ranks = spawn(_worker, W, (dp_replicate, ep, data_parallel), args.smoke, timeout=600.0)
        worst = max(ranks, key=lambda r: r["params"] + r["optim"])
        name = f"{data_parallel}{' hsdp' if dp_replicate > 1 else ''} {dp_replicate}x{W // dp_replicate} ep={ep}"
        rows.append({"world": W, "layout": name, **worst, "total": worst["params"] + worst["optim"]})
    total1 = rows[0]["total"]
    print("| W | layout | params / rank | of which experts | optimizer / rank | total / rank | vs one process |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["total"] / total1
        print(f"| {r['world']} | {r['layout']} | {C.fmt_bytes(r['params'])} | {C.fmt_bytes(r['experts'])} | "
              f"{C.fmt_bytes(r['optim'])} | {C.fmt_bytes(r['total'])} | {r['ratio']:.3f} |")
    C.save_run("training_memory", "parallelize", quick=args.quick, smoke=args.smoke, env=env,
               out=C.out_dir(args), rows=rows, plot=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
