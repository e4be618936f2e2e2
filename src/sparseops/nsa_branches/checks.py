"""Argument checks shared by the NSA module's functional pieces (docs/nsa-module.md).

The pieces take flash-attention's ``cu_seqlens`` (a leading 0, ``[0, c1, ..., T]``), unlike the selected-attention
op, which takes CANN's cumulative lengths without the 0.
"""

from __future__ import annotations

import torch

from .. import _checks
from .._numerics import acc_dtype
from .._varlen import cu_seqlens_list  # noqa: F401  shared with sparseops.dsa

#: input dtypes of the pieces: fp16/bf16/fp32 for models, float64 for the oracles and gradcheck
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


#: the dtype of softmax statistics and of the arithmetic for inputs of a dtype: fp32, float64 for float64
stats_dtype = acc_dtype


def check_blocks(block_size, stride, select_block_size=None) -> tuple[int, int]:
    """``l >= 1``, ``1 <= d``, ``d | l`` and (when given) ``d | l'``."""
    l = _checks.check_int("block_size", block_size, lo=1)
    d = _checks.check_int("stride", stride, lo=1)
    if l % d:
        raise ValueError(f"stride: expected a divisor of block_size = {l}, got {d}")
    if select_block_size is not None and select_block_size % d:
        raise ValueError(f"stride: expected a divisor of select_block_size = {select_block_size}, got {d}")
    return l, d


def check_heads(q_name: str, q: torch.Tensor, k_name: str, k: torch.Tensor) -> int:
    """``N2 >= 1`` divides ``N1`` with ``G = N1 / N2 <= 32``; returns G."""
    N1, N2 = q.shape[1], k.shape[1]
    if N2 < 1 or N1 % N2:
        raise ValueError(f"{k_name}: expected N2 = {k_name}.shape[1] >= 1 dividing N1 = {q_name}.shape[1] = {N1}, "
                         f"got N2 = {N2}")
    G = N1 // N2
    if G > 32:
        raise ValueError(f"{q_name}: expected G = N1 / N2 <= 32, got N1 = {N1}, N2 = {N2}, G = {G}")
    return G


def check_head_dims(**tensors) -> None:
    """The last dimension (Dqk or Dv) of each ``[rows, heads, D]`` tensor is at least 1 (a 0 divides by 0)."""
    for nm, t in tensors.items():
        if t.shape[2] < 1:
            raise ValueError(f"{nm}: expected a head dimension {nm}.shape[2] >= 1, got shape {_checks.fmt_shape(t.shape)}")


def check_same_dtype(ref_name: str, ref: torch.Tensor, **others) -> None:
    for nm, t in others.items():
        if t.dtype != ref.dtype:
            raise TypeError(f"{nm}: expected dtype {dtype_name(ref.dtype)} (the dtype of {ref_name}), "
                            f"got {dtype_name(t.dtype)}")


def check_scale(scale, dqk: int) -> float:
    return dqk ** -0.5 if scale is None else _checks.check_float("scale", scale)


def num_compressed(L: int, l: int, d: int) -> int:
    """``C(L)``: 0 when ``L < l``, else ``floor((L - l) / d) + 1`` blocks ``[j*d, j*d + l)``."""
    return 0 if L < l else (L - l) // d + 1


def cmp_cu_seqlens(cu: list[int], l: int, d: int) -> list[int]:
    out = [0]
    for b in range(len(cu) - 1):
        out.append(out[-1] + num_compressed(cu[b + 1] - cu[b], l, d))
    return out
