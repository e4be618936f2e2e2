"""Shared argument checks and backend choice.

Every public op validates here, before any output is touched. Messages name the argument, what was
expected and what came, e.g. ``topk_indices: expected shape [T1=64, N2=2, K=4], got [64, 2, 3]``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "torch", "triton", "reference")


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "{" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + "}"


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (empty when it has none): what a one-line report quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def fmt_exc(exc: BaseException) -> str:
    """``exc`` on one line: ``TypeName: the message's first line``."""
    return f"{type(exc).__name__}: {first_line(exc)}"


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | tuple[int, ...] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Type, rank and dtype of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (torch.strided) tensor, got layout {t.layout}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got {t.dim()}-D with shape {fmt_shape(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[tuple[str, int]]) -> None:
    """``expected`` is ``[(label, size), ...]``; ``size < 0`` means "any"."""
    ok = t.dim() == len(expected) and all(s < 0 or t.shape[i] == s for i, (_, s) in enumerate(expected))
    if not ok:
        want = "[" + ", ".join(lab if s < 0 else f"{lab}={s}" for lab, s in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {fmt_shape(t.shape)}")


def check_int(
    name: str,
    v,
    *,
    lo: int | None = None,
    hi: int | None = None,
    multiple_of: int | None = None,
) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not (v.dtype.is_floating_point or v.dtype == torch.bool):
            v = int(v)
        else:
            raise TypeError(f"{name}: expected an int, got {type(v).__name__} ({v!r})")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {v}")
    if multiple_of is not None and v % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {v}")
    return v


def check_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__} ({v!r})")
    try:
        v = float(v)
    except OverflowError:
        raise ValueError(f"{name}: expected a finite float, got an int of {v.bit_length()} bits") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite float, got {v}")
    return v


def check_param_dtype(dtype, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES + (torch.float64,)):
    """A module constructor's ``dtype`` keyword: None (torch's default) or a floating dtype of ``dtypes``."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected None or a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    if dtype not in dtypes:
        raise TypeError(f"dtype: expected None or one of {_dtype_names(dtypes)}, got {str(dtype).replace('torch.', '')}")
    return dtype


def check_has_data(name: str, t: torch.Tensor, module: bool = False) -> None:
    """Data-dependent work (a top-k, a count) cannot run on a ``meta`` tensor: say so instead of torch's error.
    ``module``: the tensor is a module's input, so hint at materializing the module."""
    if t.device.type == "meta":
        hint = " (materialize the module first: to_empty(device=...), then reset_parameters())" if module else ""
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device{hint}")


def check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__} ({v!r})")
    return v


def data_checks(validate: bool, t: torch.Tensor) -> bool:
    """Whether to run the data-dependent checks that read ``t``: asked for, something to read, and not while
    ``torch.compile`` traces (a graph break) or on meta tensors (no data)."""
    return validate and t.numel() > 0 and t.device.type != "meta" and not torch.compiler.is_compiling()


def check_same_device(**tensors) -> torch.device:
    devs = {k: t.device for k, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devs.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return next(iter(devs.values())) if devs else torch.device("cpu")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` works (imported lazily, on first ask)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


#: the values Triton (3.6, ``getenv_bool``) reads as on; anything else, "false" and "0" included, is off
_TRUE = ("1", "true", "yes", "on", "y")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` read with Triton's own rule, so that we and Triton agree on whether kernels run in
    the interpreter (the one place it is read)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def resolve_backend(backend, device: torch.device) -> str:
    """``auto`` means triton for CUDA tensors when triton imports, else torch."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend: 'triton' was asked for but triton does not import; install sparseops[triton]")
        if device.type != "cuda" and not triton_interpret():
            raise ValueError(
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported), "
                f"got tensors on {device}"
            )
    return backend


def check_hidden_states(x, hidden_size: int, param_dtype: torch.dtype, dtypes,
                        param_device: torch.device | None = None) -> torch.Tensor:
    """An attention layer's input: a tensor ``[T, hidden_size]`` of one of ``dtypes``, in the parameters' dtype
    and on their device."""
    x = check_tensor("x", x, ndim=2, dtypes=dtypes)
    if x.shape[1] != hidden_size:
        raise ValueError(f"x: expected shape [T, hidden_size={hidden_size}], got {list(x.shape)}")
    if x.dtype != param_dtype:
        raise TypeError(f"x: expected dtype {str(param_dtype).replace('torch.', '')} (the parameters' dtype), "
                        f"got {str(x.dtype).replace('torch.', '')}")
    if param_device is not None and x.device != param_device:
        raise ValueError(f"x: expected device {param_device} (the parameters' device), got {x.device}")
    return x
