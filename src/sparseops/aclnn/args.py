"""The CANN layer's own argument checks, with CANN's status codes: null pointers (161001), CANN's dtypes and
int arrays (161002), out tensors (161002 / 561002). Everything the Python ops check is left to their shared
checks (:func:`~sparseops.aclnn.runtime.validate` turns those into statuses)."""

from __future__ import annotations

import torch

from .. import _checks
from .runtime import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    FLOAT_NAMES,
    FLOATS,
    Fail,
    dtype_name,
    fmt_shape,
    validate,
)


def tensor(name: str, t, *, required: bool = True, dtypes=FLOATS, dtype_names: str = FLOAT_NAMES):
    """An input tensor (None allowed when not ``required``) of one of CANN's ``dtypes``."""
    if t is None:
        if required:
            raise Fail(ACLNN_ERR_PARAM_NULLPTR, f"{name}: a required tensor is None (nullptr)")
        return None
    if not isinstance(t, torch.Tensor):
        raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise Fail(ACLNN_ERR_PARAM_INVALID,
                   f"{name}: dtype {dtype_name(t.dtype)} is not supported, expected one of {{{dtype_names}}}")
    return t


def index32(name: str, t, *, required: bool = True):
    return tensor(name, t, required=required, dtypes=(torch.int32,), dtype_names="INT32 (CANN takes INT32 only)")


def boolean(name: str, v) -> bool:
    return validate({}, _checks.check_bool, name, v)


def integer(name: str, v) -> int:
    return validate({}, _checks.check_int, name, v)


def same_device(**tensors) -> torch.device:
    return validate({}, _checks.check_same_device, **tensors)


def padded_mode(v) -> None:
    if boolean("paddedMode", v):
        raise Fail(ACLNN_ERR_INNER_TILING_ERROR, "paddedMode: only false is supported (CANN documents false only), got true")


def int_array(name: str, v):
    """An ``aclIntArray``: None, a list/tuple of ints or a 1-D integer tensor -> list of ints (or None)."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise Fail(
                ACLNN_ERR_PARAM_INVALID,
                f"{name}: expected an int array (list of ints or 1-D integer tensor), got a {v.dim()}-D "
                f"{dtype_name(v.dtype)} tensor",
            )
        return [int(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int):
                raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected an int array, got an element {x!r}")
        return [int(x) for x in v]
    raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected an int array (list of ints) or None, got {type(v).__name__}")


def layout(v) -> None:
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    if v != "TND":
        raise Fail(ACLNN_ERR_PARAM_INVALID, f"inputLayout: only \"TND\" is supported, got {v!r}")


def out_tensor(name: str, t, shape, dtype: torch.dtype) -> torch.Tensor:
    """An out tensor: present, of a supported dtype (else 161002), of exactly ``shape`` and ``dtype`` (else 561002)."""
    if t is None:
        raise Fail(ACLNN_ERR_PARAM_NULLPTR, f"{name}: a required out tensor is None (nullptr)")
    if not isinstance(t, torch.Tensor):
        raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOATS + (torch.int32,):
        raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: dtype {dtype_name(t.dtype)} is not supported")
    if t.layout != torch.strided:  # before the strides, which a sparse tensor reports as zeros
        raise Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a dense (torch.strided) tensor, got layout {t.layout}")
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise Fail(
            ACLNN_ERR_PARAM_INVALID,
            f"{name}: an out tensor must not overlap itself (got a broadcast view with strides {tuple(t.stride())})",
        )
    if tuple(t.shape) != tuple(shape):
        raise Fail(ACLNN_ERR_INNER_TILING_ERROR, f"{name}: expected shape {fmt_shape(shape)}, got {fmt_shape(t.shape)}")
    if t.dtype != dtype:
        raise Fail(ACLNN_ERR_INNER_TILING_ERROR, f"{name}: expected dtype {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    return t


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
