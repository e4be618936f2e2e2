"""Differentiable collectives, the expert-parallel token dispatchers and a spawn helper (docs/moe-layer.md)."""

from .collectives import all_gather, all_to_all, reduce_scatter
from .launch import SpawnError, free_port, spawn

__all__ = ["SpawnError", "all_gather", "all_to_all", "free_port", "reduce_scatter", "spawn"]
