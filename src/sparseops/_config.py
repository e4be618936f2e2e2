"""Process-wide switches (the NSA-grad determinism flag)."""

from __future__ import annotations

import torch

_deterministic = False


def set_deterministic(flag: bool) -> None:
    """Make ``nsa_selected_attention_grad(deterministic=None)`` bitwise reproducible (or not)."""
    global _deterministic
    if not isinstance(flag, bool):
        raise TypeError(f"flag: expected a bool, got {type(flag).__name__} ({flag!r})")
    _deterministic = flag


def is_deterministic() -> bool:
    """The flag set by :func:`set_deterministic` (``torch.use_deterministic_algorithms`` is read separately)."""
    return _deterministic


def resolve_deterministic(deterministic) -> bool:
    if deterministic is None:
        return _deterministic or torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool or None, got {type(deterministic).__name__}")
    return deterministic
