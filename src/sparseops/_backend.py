"""The one dispatcher: a backend name -> the module that implements it, for both op families.

Every op family (``"moe"``, ``"nsa"``) has three implementations of one contract (docs/internals.md):
``reference`` (slow and obvious: the oracle), ``torch`` (vectorized PyTorch: the CPU path and the fallback on
every device) and ``triton`` (the GPU kernels). The first two are bound here by static import; the Triton
modules are imported on first use, so that ``import sparseops`` works without Triton.

A public op resolves the user's ``backend=`` once (:func:`resolve`), before its custom op runs; the custom op
then calls :func:`call` with the backend's name and its arguments by keyword. ``backend="auto"`` that chose
Triton is passed on as a *fallback key* (what decides whether the kernels fit: device, dtype, head sizes...):
a kernel that does not fit the device (:class:`sparseops._triton.DoesNotFit`) then reruns on the torch path
with a ``RuntimeWarning``, and later calls with the same key go to torch straight away.
"""

from __future__ import annotations

import warnings

import torch

from . import _checks, _triton
from .moe import reference as moe_reference
from .moe import torch_impl as moe_torch
from .nsa import reference as nsa_reference
from .nsa import torch_impl as nsa_torch

#: the op families and the functions each backend module provides
FUNCTIONS = {
    "moe": ("permute", "unpermute", "unpermute_grad", "permute_grad"),
    "nsa": ("forward", "backward"),
}

_STATIC = {
    ("moe", "reference"): moe_reference,
    ("moe", "torch"): moe_torch,
    ("nsa", "reference"): nsa_reference,
    ("nsa", "torch"): nsa_torch,
}

#: dtypes the Triton kernels of a family take; ``auto`` sends the others (float64, a testing dtype) to torch
_TRITON_DTYPES = {"nsa": (torch.float16, torch.bfloat16, torch.float32)}

#: ``(family, fn, fallback key, triton knobs)`` of ``auto`` calls whose Triton kernels did not fit
_DOES_NOT_FIT: set = set()


def _check_family(family: str) -> None:
    if family not in FUNCTIONS:
        raise ValueError(f"family: expected one of {tuple(FUNCTIONS)}, got {family!r}")


def _triton_module(family: str):
    """``sparseops.<family>.triton_impl``, imported now (a ``ValueError`` naming the backend when it cannot be)."""
    try:
        if family == "moe":
            from .moe import triton_impl as mod
        else:
            from .nsa import triton_impl as mod
    except ImportError as exc:
        raise ValueError(
            f"backend: 'triton' was asked for but sparseops.{family}.triton_impl could not be imported "
            f"({type(exc).__name__}: {exc}); use backend='torch' or 'auto'"
        ) from exc
    missing = [f for f in FUNCTIONS[family] if not hasattr(mod, f)]
    if missing:
        raise ValueError(f"backend: 'triton' {family} backend lacks {missing}; use backend='torch' or 'auto'")
    return mod


def module(family: str, name: str):
    """The module implementing ``family`` on backend ``name`` (``"reference"``, ``"torch"`` or ``"triton"``)."""
    _check_family(family)
    if name == "triton":
        return _triton_module(family)
    try:
        return _STATIC[(family, name)]
    except KeyError:
        raise ValueError(f"backend: expected 'reference', 'torch' or 'triton', got {name!r}") from None


def resolve(family: str, backend, device: torch.device, dtype: torch.dtype | None = None) -> tuple[str, bool]:
    """The user's ``backend=`` -> ``(name, auto)``: the backend that runs and whether ``auto`` chose Triton.

    ``auto`` means Triton for CUDA tensors when Triton and the family's Triton module import (and the kernels
    take ``dtype``), else torch. An explicit ``"triton"`` whose module does not import is a ``ValueError``.
    Under ``torch.compile`` the module is not imported here (the custom op imports it when it runs).
    """
    _check_family(family)
    name = _checks.resolve_backend(backend, device)
    if name != "triton":
        return name, False
    auto = backend == "auto"
    if auto and dtype is not None and family in _TRITON_DTYPES and dtype not in _TRITON_DTYPES[family]:
        return "torch", False
    if not torch.compiler.is_compiling():
        try:
            module(family, "triton")  # a clear error now rather than an ImportError inside the op
        except ValueError:
            if not auto:
                raise
            return "torch", False  # auto never fails for want of the Triton module
    return name, auto


def _knobs(mod) -> tuple:
    """The Triton module's tuning knobs in force: they change which kernels run, so they are part of a key."""
    settings = getattr(mod, "SETTINGS", None)
    return settings.get() if settings is not None else None


def call(family: str, name: str, fn: str, *, fallback_key: tuple | None = None, **kwargs):
    """``module(family, name).<fn>(**kwargs)``.

    Args:
        family: ``"moe"`` or ``"nsa"``.
        name: a resolved backend (:func:`resolve`): ``"reference"``, ``"torch"`` or ``"triton"``.
        fn: the function of the backend module (:data:`FUNCTIONS`).
        fallback_key: None, or (``auto`` chose Triton) a hashable key of what decides whether the kernels fit;
            a :class:`~sparseops._triton.DoesNotFit` then reruns the call on torch with a ``RuntimeWarning``,
            and calls with the same key (and the same Triton knobs) run on torch without trying Triton.
        kwargs: the backend function's arguments, by name.

    Returns:
        What the backend function returns.
    """
    if fn not in FUNCTIONS.get(family, ()):
        raise ValueError(f"fn: expected one of {FUNCTIONS.get(family)} for {family!r}, got {fn!r}")
    mod = module(family, name)
    if fallback_key is None:
        return getattr(mod, fn)(**kwargs)
    key = (family, fn, fallback_key, _knobs(mod))
    if key not in _DOES_NOT_FIT:
        try:
            return getattr(mod, fn)(**kwargs)
        except _triton.DoesNotFit as e:
            _DOES_NOT_FIT.add(key)
            warnings.warn(f"sparseops: {e}; backend='auto' runs this shape on the torch path", RuntimeWarning,
                          stacklevel=2)
    return getattr(module(family, "torch"), fn)(**kwargs)


def forget_fits() -> None:
    """Forget which ``auto`` shapes did not fit (the next call tries Triton again)."""
    _DOES_NOT_FIT.clear()
