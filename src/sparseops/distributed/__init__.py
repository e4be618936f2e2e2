"""Differentiable collectives, the expert-parallel token dispatchers, a spawn helper (docs/moe-layer.md) and
data × expert parallel training on torch's parts: ParallelDims, parallelize (docs/training.md)."""

from .collectives import all_gather, all_to_all, even_sizes, gather_rows, reduce_scatter, split_rows
from .launch import SpawnError, free_port, spawn

__all__ = ["ParallelDims", "SpawnError", "all_gather", "all_to_all", "clip_grad_norm_", "even_sizes", "free_port",
           "gather_rows", "materialize", "parallelize", "reduce_scatter", "spawn", "split_rows"]


def __getattr__(name: str):
    # parallel.py imports sparseops.nn, which imports this package's collectives: loaded on first use
    if name in ("ParallelDims", "clip_grad_norm_", "materialize", "parallelize"):
        from . import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
