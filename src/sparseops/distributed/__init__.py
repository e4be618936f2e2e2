"""Differentiable collectives, the expert-parallel token dispatchers, a spawn helper (docs/moe-layer.md) and
data × expert parallel training on torch's parts: ParallelDims, parallelize (docs/training.md); the
expert-parallel layer's own side (expert_parallel.ExpertParallelModule) is what parallelize works with."""

from .clip import clip_grad_norm_
from .collectives import all_gather, all_to_all, even_sizes, gather_rows, reduce_scatter, split_rows
from .launch import SpawnError, free_port, spawn
from .parallel import ParallelDims, materialize, parallelize

__all__ = ["ParallelDims", "SpawnError", "all_gather", "all_to_all", "clip_grad_norm_", "even_sizes", "free_port",
           "gather_rows", "materialize", "parallelize", "reduce_scatter", "spawn", "split_rows"]
