"""DSA's attention with its loss target from the same pass (docs/dsa.md, "The attention and its target").

:func:`sparse_attention` is :func:`sparseops.nsa_selected_attention` at token granularity over the indexer's
``indices [T, topk]`` (every KV head attends the same keys), causal, returning the output and, when asked, the
indexer loss's target ``p [T, topk]`` for :func:`sparseops.dsa.indexer_kl_loss`'s ``target=``. On the CPU's C++
path (``csrc/attention.cpp``) the target comes out of the attention's own forward, from the probabilities it
computes anyway; elsewhere it is computed as :func:`indexer_kl_loss` would (one more pass over the keys).
"""

from __future__ import annotations

import torch

from .. import _autograd, _backend, _checks
from .._varlen import token_seq_positions
from ..nsa import cpu_gather, torch_impl
from ..nsa.api import FAMILY as NSA
from ..nsa.api import nsa_selected_attention
from ..nsa.checks import check_args, max_block_count
from .checks import DTYPES, cu_seqlens_list
from .loss import _target

#: the most keys per query: the op's ``selected_block_count`` limit at token granularity
MAX_TOPK = max_block_count(1)


class _AttentionWithTarget(torch.autograd.Function):
    """The C++ CPU path's forward with the target, and its backward (the op's own, ``cpu_gather.backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, topk, scale, cu, causal):
        out, m, l, p = cpu_gather.forward(q, k, v, topk, scale, 1, cu, cu, causal, target=True)
        ctx.save_for_backward(q, k, v, out, m, l, topk)
        ctx.args = (scale, cu, causal)
        ctx.mark_non_differentiable(p)
        return out, p

    @staticmethod
    @_autograd.once_differentiable("sparse_attention")
    def backward(ctx, dout, _dp):
        q, k, v, out, m, l, topk = ctx.saved_tensors
        scale, cu, causal = ctx.args
        dq, dk, dv = cpu_gather.backward(q, k, v, out, dout.contiguous(), m, l, topk, scale, 1, cu, cu, causal)
        return dq, dk, dv, None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *, scale: float,
                     cu_seqlens=None, return_target: bool = False, backend: str = "auto", validate: bool = True):
    """Causal attention of each query token over its selected keys (DSA), differentiable in q, k, v.

    Args:
        q: ``[T, N1, Dqk]``; k: ``[T, N2, Dqk]``; v: ``[T, N2, Dv]`` (one dtype; packed sequences).
        indices: ``[T, topk]`` int32/int64 in-sequence key positions, -1 unused (``indexer_topk``'s), the same
            for every KV head.
        scale: the softmax scale. cu_seqlens: flash-attention cumulative lengths with the leading 0, or None.
        return_target: also return the indexer loss's target ``p [T, topk]`` (fp32, float64 for float64; no
            gradient): ``p[t, i] = (1 / N1) sum_h softmax_h(scale * q[t, h] . k[indices[t, i]])`` over the keys
            the token sees, 0 at -1.
        backend, validate: as in :func:`sparseops.nsa_selected_attention`.

    Returns:
        ``out [T, N1, Dv]`` in q's dtype, or ``(out, p)``.
    """
    q = _checks.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    k = _checks.check_tensor("k", k, ndim=3)
    indices = _checks.check_tensor("indices", indices, ndim=2, dtypes=_checks.INDEX_DTYPES)
    return_target = _checks.check_bool("return_target", return_target)
    T, topk = indices.shape
    # the arguments the op below has under other names (scale_value, selected_block_count)
    scale = _checks.check_float("scale", scale)
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"indices: expected 1 to {MAX_TOPK} keys per query (indices.shape[1], the op's "
                         f"selected_block_count limit), got {topk}")
    # the rows first, under this function's names (the op's checks below would name its lengths)
    for name, t in (("k", k), ("v", _checks.check_tensor("v", v, ndim=3)), ("indices", indices)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: expected {q.shape[0]} rows (the tokens of q), got shape {_checks.fmt_shape(t.shape)}")
    cu = cu_seqlens_list(cu_seqlens, q.shape[0])
    blocks = indices[:, None, :].expand(T, k.shape[1], topk)
    # the op's own checks (shapes, dtypes, positions in each sequence), under its argument names
    scale, _, cu, _, causal, device = check_args(q, k, v, blocks, scale, q.shape[1], 1, topk, None, cu[1:], cu[1:],
                                                 2, "TND", validate)
    name, _ = _backend.resolve(NSA, backend, device, q.dtype)
    if return_target and name == "torch" and torch_impl.uses_cpu_kernels(q, k, 1):
        return _AttentionWithTarget.apply(q, k, v, blocks.contiguous(), scale, cu, causal)
    out = nsa_selected_attention(q, k, v, blocks, scale, q.shape[1], 1, topk, actual_seq_qlen=cu[1:],
                                 actual_seq_kvlen=cu[1:], sparse_mode=2, backend=backend, validate=False)[0]
    if not return_target:
        return out
    # the keys the attention sees: a slot after its token (causal) holds no probability
    _, pos = token_seq_positions(cu, device=indices.device)
    idx = indices.to(torch.int64)
    seen = torch.where(idx > pos[:, None], -1, idx)
    return out, _target(q.detach(), k.detach(), seen, scale, cu)
