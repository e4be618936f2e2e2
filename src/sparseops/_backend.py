"""The one dispatcher: an op family's backend name -> the module that implements it.

Every op family (``moe``, ``nsa``) has three implementations of one contract (docs/internals.md):
``reference`` (slow and obvious: the oracle), ``torch`` (vectorized PyTorch: the CPU path and the fallback on
every device) and ``triton`` (the GPU kernels). A family describes itself with a :class:`Family` in its own
``api`` module (``sparseops.moe.api.FAMILY``, ``sparseops.nsa.api.FAMILY``), so this module knows no family:
the first two backends are the family's modules, the Triton module is named by its path and imported on first
use, so that ``import sparseops`` works without Triton.

A public op resolves the user's ``backend=`` once (:func:`resolve`), before its custom op runs; the custom op
then calls :func:`call` with the backend's name and its arguments by keyword. ``backend="auto"`` that chose
Triton is passed on as a *fallback key* (what decides whether the kernels fit: device, dtype, head sizes...):
a kernel that does not fit the device (:class:`sparseops._triton.DoesNotFit`) then reruns on the torch path
with a ``RuntimeWarning``, and later calls with the same key go to torch straight away.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from . import _checks, _triton


@dataclass(frozen=True, eq=False)
class Family:
    """One op family's backends.

    Attributes:
        name: ``"moe"`` or ``"nsa"`` (in messages and fallback keys).
        functions: the functions every backend module provides, called by keyword (one signature each).
        reference: the float64-exact oracle module.
        torch: the vectorized PyTorch module.
        triton: the import path of the Triton module (imported on first use).
        triton_dtypes: the dtypes the Triton kernels take (``auto`` sends others to torch); None: every dtype.
    """

    name: str
    functions: tuple[str, ...]
    reference: ModuleType
    torch: ModuleType
    triton: str
    triton_dtypes: tuple[torch.dtype, ...] | None = None


#: ``(family name, fn, fallback key, triton knobs)`` of ``auto`` calls whose Triton kernels did not fit
_DOES_NOT_FIT: set = set()


def _check_family(family) -> None:
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a sparseops._backend.Family (e.g. sparseops.moe.api.FAMILY), got "
                        f"{type(family).__name__}")


def _triton_module(family: Family):
    """The family's Triton module, imported now (a ``ValueError`` naming the backend when it cannot be)."""
    try:
        mod = importlib.import_module(family.triton)
    except ImportError as exc:
        raise ValueError(
            f"backend: 'triton' was asked for but {family.triton} could not be imported "
            f"({type(exc).__name__}: {exc}); use backend='torch' or 'auto'"
        ) from exc
    missing = [f for f in family.functions if not hasattr(mod, f)]
    if missing:
        raise ValueError(f"backend: 'triton' {family.name} backend lacks {missing}; use backend='torch' or 'auto'")
    return mod


def module(family: Family, name: str):
    """The module implementing ``family`` on backend ``name`` (``"reference"``, ``"torch"`` or ``"triton"``)."""
    _check_family(family)
    if name == "triton":
        return _triton_module(family)
    if name == "reference":
        return family.reference
    if name == "torch":
        return family.torch
    raise ValueError(f"backend: expected 'reference', 'torch' or 'triton', got {name!r}")


def resolve(family: Family, backend, device: torch.device, dtype: torch.dtype | None = None) -> tuple[str, bool]:
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
    if auto and dtype is not None and family.triton_dtypes is not None and dtype not in family.triton_dtypes:
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


def call(family: Family, name: str, fn: str, *, fallback_key: tuple | None = None, **kwargs):
    """``module(family, name).<fn>(**kwargs)``.

    Args:
        family: the op family (its ``api.FAMILY``).
        name: a resolved backend (:func:`resolve`): ``"reference"``, ``"torch"`` or ``"triton"``.
        fn: one of the family's functions (:attr:`Family.functions`).
        fallback_key: None, or (``auto`` chose Triton) a hashable key of what decides whether the kernels fit;
            a :class:`~sparseops._triton.DoesNotFit` then reruns the call on torch with a ``RuntimeWarning``,
            and calls with the same key (and the same Triton knobs) run on torch without trying Triton.
        kwargs: the backend function's arguments, by name.

    Returns:
        What the backend function returns.
    """
    _check_family(family)
    if fn not in family.functions:
        raise ValueError(f"fn: expected one of {family.functions} for {family.name!r}, got {fn!r}")
    mod = module(family, name)
    if fallback_key is None:
        return getattr(mod, fn)(**kwargs)
    key = (family.name, fn, fallback_key, _knobs(mod))
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
