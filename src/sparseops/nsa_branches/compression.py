"""Key/value compression into overlapping block summaries, the input of the compressed branch
(docs/nsa-module.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _checks
from .checks import DTYPES, check_blocks, check_head_dims, check_same_dtype, cmp_cu_seqlens, cu_seqlens_list

Compressor = Callable[[torch.Tensor], torch.Tensor]


def block_starts(cu: list[int], cu_cmp: list[int], d: int, device) -> torch.Tensor:
    """Packed row of the first token of every compressed block, ``[sum C]`` int64."""
    counts = torch.tensor([cu_cmp[b + 1] - cu_cmp[b] for b in range(len(cu) - 1)], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts, output_size=cu_cmp[-1])
    local = torch.arange(cu_cmp[-1], dtype=torch.int64) - torch.tensor(cu_cmp[:-1], dtype=torch.int64)[seq]
    return (torch.tensor(cu[:-1], dtype=torch.int64)[seq] + local * d).to(device)


def compress_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens=None,
    block_size: int = 32,
    stride: int = 16,
    compressor: Compressor | tuple[Compressor, Compressor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress keys and values into one summary per (overlapping) block, per sequence.

    A sequence of length L has ``C(L) = 0`` blocks if ``L < l``, else ``floor((L - l) / d) + 1``; block j covers
    positions ``[j*d, j*d + l)``. ``k_cmp[j] = phi_k(k[j*d : j*d + l])`` and likewise v; the default phi is the
    mean over the block's l rows. Example: ``L = 64, l = 32, d = 16``: blocks [0, 32), [16, 48), [32, 64).

    Args:
        k: ``[T, N2, Dqk]`` float16, bfloat16, float32 or float64 (packed sequences).
        v: ``[T, N2, Dv]``, the dtype of k.
        cu_seqlens: cumulative lengths with the leading 0 (int tensor ``[B+1]`` or list; None: one sequence).
        block_size, stride: ``l >= 1`` and ``d >= 1`` with ``d | l``.
        compressor: None (mean pooling), a callable ``phi(blocks [M, l, N2, D]) -> [M, N2, D]`` used for both
            keys and values, or a pair ``(phi_k, phi_v)``.

    Returns:
        ``(k_cmp [sum C, N2, Dqk], v_cmp [sum C, N2, Dv], cu_seqlens_cmp [B+1] int32)``, packed like the inputs,
        differentiable in k and v (and phi's parameters).
    """
    k = _checks.check_tensor("k", k, ndim=3, dtypes=DTYPES)
    v = _checks.check_tensor("v", v, ndim=3)
    check_same_dtype("k", k, v=v)
    T, N2, _ = k.shape
    _checks.check_shape("v", v, [("T", T), ("N2", N2), ("Dv", -1)])
    _checks.check_same_device(k=k, v=v)
    check_head_dims(k=k, v=v)
    l, d = check_blocks(block_size, stride)
    if compressor is None or callable(compressor):
        phi_k = phi_v = compressor
    elif isinstance(compressor, tuple) and len(compressor) == 2 and all(callable(c) for c in compressor):
        phi_k, phi_v = compressor
    else:
        raise TypeError(f"compressor: expected None, a callable or a pair of callables, got {type(compressor).__name__}")
    cu = cu_seqlens_list("cu_seqlens", cu_seqlens, T)
    cu_cmp = cmp_cu_seqlens(cu, l, d)
    rows = block_starts(cu, cu_cmp, d, k.device)[:, None] + torch.arange(l, device=k.device)
    out = []
    for name, x, phi in (("k", k, phi_k), ("v", v, phi_v)):
        blocks = x[rows]
        y = blocks.mean(1) if phi is None else phi(blocks)
        want = (rows.shape[0], N2, x.shape[2])
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"compressor: expected phi({name} blocks) of shape {list(want)}, got {got}")
        out.append(y)
    return out[0], out[1], torch.tensor(cu_cmp, dtype=torch.int32, device=k.device)
