"""Process-wide switches (the NSA-grad determinism flag)."""

from __future__ import annotations

import torch

_deterministic = False


def set_deterministic(flag: bool) -> None:
    """Make ``nsa_selected_attention_grad(deterministic=None)`` bitwise reproducible (or not).

    The same switch as CANN's ``aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1|0)`` in :mod:`sparseops.aclnn`.
    The MoE ops are always deterministic and ignore it.

    Args:
        flag: ``True``: repeated NSA-grad calls give bitwise-identical ``dq, dk, dv`` (on the GPU a fixed-order
            reduction instead of atomics); ``False``: the fastest path.

    Returns:
        None.
    """
    global _deterministic
    if not isinstance(flag, bool):
        raise TypeError(f"flag: expected a bool, got {type(flag).__name__} ({flag!r})")
    _deterministic = flag


def is_deterministic() -> bool:
    """The flag set by :func:`set_deterministic`.

    ``torch.use_deterministic_algorithms(True)`` also turns determinism on for ``deterministic=None`` calls; it
    is read separately and does not change this flag.

    Returns:
        ``bool``: the current flag (default ``False``, as CANN).
    """
    return _deterministic


def resolve_deterministic(deterministic) -> bool:
    if deterministic is None:
        return _deterministic or torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool or None, got {type(deterministic).__name__}")
    return deterministic
