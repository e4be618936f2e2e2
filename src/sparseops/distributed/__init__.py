"""Differentiable collectives, the expert-parallel token dispatchers and a spawn helper (docs/moe-layer.md)."""

from .collectives import all_gather, all_to_all, even_sizes, gather_rows, reduce_scatter, split_rows
from .launch import SpawnError, free_port, spawn

__all__ = ["SpawnError", "all_gather", "all_to_all", "even_sizes", "free_port", "gather_rows", "reduce_scatter",
           "spawn", "split_rows"]
