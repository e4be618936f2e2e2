"""Rotary position embedding (RoPE) at explicit positions, for packed sequences (docs/nsa-module.md)."""

from __future__ import annotations

import torch

from .._numerics import acc_dtype


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + D/2])`` by the angle ``positions * theta ** (-2i / D)``.

    Args:
        x: ``[T, N, D]`` with D even, any float dtype.
        positions: ``[T]`` integer positions (inside each token's sequence).
        theta: the RoPE base.

    Returns:
        ``[T, N, D]`` in x's dtype (angles in fp32, float64 for float64 inputs).
    """
    D = x.shape[-1]
    cdt = acc_dtype(x)
    inv = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=cdt) * 2.0 / D)
    ang = positions.to(cdt)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.to(cdt).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
