"""Sliding-window attention, the third NSA branch (docs/nsa-module.md)."""

from __future__ import annotations

import torch

from .. import _checks
from .._autograd import check_no_forward_ad
from . import chunked_attention as _ca
from .checks import DTYPES, check_head_dims, check_heads, check_same_dtype, check_scale, cu_seqlens_list


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens=None,
    window: int = 512,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention over packed sequences, differentiable in q, k and v.

    The query at in-sequence position ``t`` (head ``h = n2*G + g``) sees the keys at positions
    ``max(0, t - w + 1) .. t`` of its own sequence (``w`` keys, itself included):
    ``o[t, h] = softmax_j(scale * q[t, h] . k[j, n2]) v[j, n2]``. Example: ``w = 3``, position 5 sees 3, 4, 5;
    position 1 sees 0, 1. Computed by chunks of queries against the band of keys they can see, forward and
    backward, never a ``[T, T]`` tensor.

    Args:
        q: ``[T, N1, Dqk]`` float16, bfloat16, float32 or float64 (packed sequences).
        k: ``[T, N2, Dqk]``, ``N1 = G * N2`` with ``1 <= G <= 32``, the dtype of q.
        v: ``[T, N2, Dv]``, the dtype of q.
        cu_seqlens: flash-attention cumulative lengths with the leading 0 (int tensor ``[B+1]`` or list of ints;
            lists under ``torch.compile``), or None for one sequence.
        window: ``w >= 1``.
        scale: multiplies ``q . k``; default ``Dqk ** -0.5``.

    Returns:
        ``o [T, N1, Dv]`` in q's dtype (fp32 arithmetic, float64 for float64 inputs).
    """
    q = _checks.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    k = _checks.check_tensor("k", k, ndim=3)
    v = _checks.check_tensor("v", v, ndim=3)
    check_same_dtype("q", q, k=k, v=v)
    T, N1, Dqk = q.shape
    _checks.check_shape("k", k, [("T", T), ("N2", -1), ("Dqk", Dqk)])
    _checks.check_shape("v", v, [("T", T), ("N2", k.shape[1]), ("Dv", -1)])
    check_heads("q", q, "k", k)
    check_head_dims(q=q, v=v)
    _checks.check_same_device(q=q, k=k, v=v)
    w = _checks.check_int("window", window, lo=1)
    scale = check_scale(scale, Dqk)
    cu = cu_seqlens_list("cu_seqlens", cu_seqlens, T)
    check_no_forward_ad("sliding_window_attention", q, k, v)
    return _ca.chunked_attention(q, k, v, cu, cu, 1, 1, w, scale)[0]
