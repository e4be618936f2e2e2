"""Numeric helpers shared by the torch paths of the ops (docs/internals.md)."""

from __future__ import annotations

import contextlib
import functools

import torch


def acc_dtype(*xs) -> torch.dtype:
    """The arithmetic dtype for inputs ``xs`` (tensors or dtypes; None is skipped): float64 when any is float64,
    else fp32 (fp16 / bf16 inputs are computed in fp32). Also the dtype of the ops' softmax statistics."""
    for x in xs:
        if x is not None and (x if isinstance(x, torch.dtype) else x.dtype) == torch.float64:
            return torch.float64
    return torch.float32


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype an enclosing ``torch.autocast`` on ``t``'s device gives matmuls of ``t``, or None: autocast
    off there, or ``t`` not eligible (float64 and integers stay as they are, as under autocast's own casts)."""
    dev = t.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    if not t.is_floating_point() or t.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(dev)


def autocast_cast(ref: torch.Tensor, *ts):
    """``ts`` as an enclosing ``torch.autocast`` gives them to a matmul in ``ref``'s dtype
    (:func:`autocast_dtype`): each floating tensor but float64 cast to autocast's dtype, differentiably; None
    and the rest unchanged, everything unchanged without autocast."""
    cdt = autocast_dtype(ref)
    if cdt is None:
        return ts
    return tuple(t.to(cdt) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in ts)


def autocast_off(device_type: str):
    """A context without the enclosing ``torch.autocast`` of ``device_type`` (a null context where none is on):
    for code that picks its own dtypes, which autocast must not re-type."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(fn):
    """``fn`` with any enclosing ``torch.autocast`` (CPU, CUDA) turned off while it runs: for the ops' own code,
    which picks its dtypes (fp32 accumulation, fp32 scores that decide a selection) and which autocast would
    re-type to its lower dtype, silently."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with autocast_off("cpu"), autocast_off("cuda"):
            return fn(*args, **kwargs)

    return inner


def exp_floor(acc: torch.dtype) -> float:
    """The lowest exponent worth computing in ``acc`` (fp32 or float64): ``exp()`` below about -87.3 is an fp32
    denormal or 0 (a slow path on x86), and ``e^-80`` is negligible next to a row's max term."""
    return -700.0 if acc == torch.float64 else -80.0


def row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, rows: int = 512) -> torch.Tensor:
    """``(a * b).sum(-1)`` in ``dtype`` for ``[T, ...]`` tensors, by slices of ``rows`` tokens: the same sums
    (each row is reduced whole, in the same order) without a full-size product tensor, whose fresh pages cost
    more than the product (docs/perf.md)."""
    if torch.compiler.is_compiling():
        # traced, the loop would specialise the graph on T; Inductor fuses the product into the sum instead
        return (a.to(dtype) * b.to(dtype)).sum(-1)
    out = torch.empty(a.shape[:-1], dtype=dtype, device=a.device)
    for i in range(0, a.shape[0], rows):
        torch.sum(a[i:i + rows].to(dtype) * b[i:i + rows].to(dtype), dim=-1, out=out[i:i + rows])
    return out
