"""What ``sparseops train`` prints when it starts and writes in ``--json`` when it ends (docs/training.md,
"``--json PATH`` (rank 0)")."""

from __future__ import annotations


def result_json(args, spec, world: int, result: dict, error: str | None) -> dict:
    """The ``--json`` record of the run ``spec`` on ``world`` ranks: ``result`` (``train_run``'s, as far as it got)
    and ``error`` (None: the run ended well)."""
    return {"steps": result.get("steps", []), "loss": result.get("loss", []),
            "resumed_from": result.get("resumed_from"), "world_size": world,
            "dims": spec.layout.dims(), "data_parallel": spec.layout.data_parallel,
            "dtype": args.dtype, "autocast": args.autocast, "attention": spec.model.attention,
            "dsa_dense_steps": spec.dsa_dense_steps, "micro_batches": spec.micro_batches,
            "activation_checkpointing": spec.activation_checkpointing,
            "data": args.data or "recall", "recall": result.get("recall"),
            "checkpoints": result.get("checkpoints", []), "seconds": result.get("seconds"), "error": error}


def header(args, spec, world: int, device_type: str) -> str:
    """Rank 0's first line: the layout, the steps, the dtype and what the run resumes from."""
    return (f"sparseops train: {world} rank(s), {spec.layout.dims()} {spec.layout.data_parallel}, "
            f"{spec.optim.steps} steps x {spec.optim.batch_size} sequences"
            + (f" in {spec.micro_batches} micro-batches" if spec.micro_batches > 1 else "") + f", {args.dtype}"
            + (f" under autocast {args.autocast}" if args.autocast else "") + f" on {device_type}"
            + (f", DSA dense warm-up for {spec.dsa_dense_steps} steps" if spec.dsa_dense_steps else "")
            + (f", resuming from {spec.resume}" if spec.resume else ""))
