"""Attention over compressed key blocks, the first NSA branch (docs/nsa-module.md)."""

from __future__ import annotations

import torch

from .. import _checks
from .._autograd import check_no_forward_ad
from . import chunked_attention as _ca
from .checks import (
    DTYPES,
    check_blocks,
    check_head_dims,
    check_heads,
    check_same_dtype,
    check_scale,
    cmp_cu_seqlens,
    cu_seqlens_list,
)


def check_cmp_args(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block_size, stride, scale, v_needed=True):
    """Checks shared with :func:`~sparseops.nsa_branches.select_blocks`; returns ``(cu, cu_cmp, l, d, scale)``."""
    q = _checks.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    k_cmp = _checks.check_tensor("k_cmp", k_cmp, ndim=3)
    check_same_dtype("q", q, k_cmp=k_cmp)
    T, _, Dqk = q.shape
    _checks.check_shape("k_cmp", k_cmp, [("C", -1), ("N2", -1), ("Dqk", Dqk)])
    if v_needed:
        v_cmp = _checks.check_tensor("v_cmp", v_cmp, ndim=3)
        check_same_dtype("q", q, v_cmp=v_cmp)
        _checks.check_shape("v_cmp", v_cmp, [("C", k_cmp.shape[0]), ("N2", k_cmp.shape[1]), ("Dv", -1)])
        _checks.check_same_device(q=q, k_cmp=k_cmp, v_cmp=v_cmp)
        check_head_dims(v_cmp=v_cmp)
    else:
        _checks.check_same_device(q=q, k_cmp=k_cmp)
    check_heads("q", q, "k_cmp", k_cmp)
    check_head_dims(q=q)
    l, d = check_blocks(block_size, stride)
    cu = cu_seqlens_list("cu_seqlens", cu_seqlens, T)
    cu_cmp = cu_seqlens_list("cu_seqlens_cmp", cu_seqlens_cmp, k_cmp.shape[0])
    want = cmp_cu_seqlens(cu, l, d)
    if cu_cmp != want:
        raise ValueError(f"cu_seqlens_cmp: expected {want} (C(L) = floor((L - l) / d) + 1 blocks per sequence, "
                         f"l = {l}, d = {d}), got {cu_cmp}")
    return cu, cu_cmp, l, d, check_scale(scale, Dqk)


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cu_seqlens,
    cu_seqlens_cmp,
    block_size: int = 32,
    stride: int = 16,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every query over the compressed blocks of its sequence, differentiable in q, k, v.

    The query at in-sequence position ``t`` sees compressed block ``j`` (positions ``[j*d, j*d + l)``) iff the
    block is complete: ``j*d + l - 1 <= t``. ``o[t, h] = sum_j softmax_j(scale * q[t, h] . k_cmp[j, n2])
    v_cmp[j, n2]`` and ``lse[t, h] = log sum_j exp(scale * q[t, h] . k_cmp[j, n2])`` over the visible j.
    Example: ``l = 32, d = 16``: positions 0..30 see nothing (``o = 0``, ``lse = -inf``, zero gradients),
    31..46 see block 0, 47..62 blocks 0 and 1.

    Args:
        q: ``[T, N1, Dqk]`` float16, bfloat16, float32 or float64.
        k_cmp: ``[C, N2, Dqk]`` (from :func:`~sparseops.nsa_branches.compress_kv`), the dtype of q, ``N1 = G * N2``,
            ``G <= 32``.
        v_cmp: ``[C, N2, Dv]``.
        cu_seqlens: cumulative lengths of q with the leading 0 (tensor ``[B+1]``, list, or None: one sequence).
        cu_seqlens_cmp: cumulative compressed-block counts with the leading 0 (as returned by ``compress_kv``).
        block_size, stride: ``l`` and ``d`` of the compression, ``d | l``.
        scale: multiplies ``q . k``; default ``Dqk ** -0.5``.

    Returns:
        ``(o [T, N1, Dv]`` in q's dtype, ``lse [T, N1]`` fp32, float64 for float64 inputs; not differentiable).
    """
    cu, cu_cmp, l, d, scale = check_cmp_args(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block_size, stride, scale)
    check_no_forward_ad("compressed_attention", q, k_cmp, v_cmp)
    return _ca.chunked_attention(q, k_cmp, v_cmp, cu, cu_cmp, l, d, 0, scale)
