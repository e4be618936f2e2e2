"""Public NSA selected-attention ops (docs/nsa.md): defaults, backend choice and autograd.

Arguments are checked by :mod:`.checks`; the backend is chosen by :func:`sparseops._backend.resolve` and called
through :func:`sparseops._backend.call` with its arguments by keyword.

The forward and the seed backward are ``torch.library`` custom ops (``sparseops::nsa_selected_attention_fwd``,
``sparseops::nsa_selected_attention_bwd``) with fake (meta) implementations and a registered autograd formula,
so ``torch.compile(fullgraph=True)`` traces a call without a graph break. Cumulative lengths reach the ops as
``list[int]`` with the leading 0; the data-dependent block-id check is skipped while compiling.
"""

from __future__ import annotations

import torch

from .. import _autograd, _backend, _triton
from .._config import resolve_deterministic
from .._numerics import autocast_off
from . import reference, torch_impl
from .checks import STAT_LANES, SeqLens, check_args, stats_dtype

#: the family's backends for the dispatcher (:mod:`sparseops._backend`); float64 is a testing dtype: torch
FAMILY = _backend.Family("nsa", ("forward", "backward"), reference, torch_impl, "sparseops.nsa.triton_impl",
                         triton_dtypes=(torch.float16, torch.bfloat16, torch.float32))


def _fallback_key(auto: bool, query, key, value, topk, bs, deterministic=None) -> tuple | None:
    """Under ``auto``: what decides whether the Triton kernels fit (device, arch, dtype, head counts and sizes,
    K, block size, the determinism switch); else None."""
    if not auto:
        return None
    return (str(query.device), _triton.arch(query.device), query.dtype, query.shape[1], key.shape[1],
            query.shape[2], value.shape[2], topk.shape[2], bs, deterministic)


# custom ops


# Kept out of CUDA graphs (torch.compile(mode="reduce-overhead") runs them between the captured partitions): they
# copy the host-side sequence lengths to the device through short-lived pinned buffers (``_varlen.device_tensor``),
# which a graph replay would read again after they were freed, and the torch path reads sizes on the host.
_GRAPH_UNSAFE = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("sparseops::nsa_selected_attention_fwd", mutates_args=(), **_GRAPH_UNSAFE)
def _fwd_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk: torch.Tensor,
    scale: float,
    bs: int,
    cu_q: list[int],
    cu_kv: list[int],
    causal: bool,
    backend: str,
    auto: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the ops compute in their inputs' dtypes with fp32 accumulation: autocast must not re-type the matmuls
    # inside them (on the CPU, bmm(..., out=fp32) of re-typed inputs fails)
    with autocast_off(query.device.type):
        return _backend.call(
            FAMILY, backend, "forward", fallback_key=_fallback_key(auto, query, key, value, topk, bs),
            q=query, k=key, v=value, topk=topk, scale=scale, bs=bs, cu_q=cu_q, cu_kv=cu_kv, causal=causal,
        )


@_fwd_op.register_fake
def _(query, key, value, topk, scale, bs, cu_q, cu_kv, causal, backend, auto):
    T1, N1, _ = query.shape
    sdt = stats_dtype(query.dtype)
    return (
        query.new_empty((T1, N1, value.shape[2])),
        query.new_empty((T1, N1), dtype=sdt),
        query.new_empty((T1, N1), dtype=sdt),
    )


@torch.library.custom_op("sparseops::nsa_selected_attention_bwd", mutates_args=(), **_GRAPH_UNSAFE)
def _bwd_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    topk: torch.Tensor,
    scale: float,
    bs: int,
    cu_q: list[int],
    cu_kv: list[int],
    causal: bool,
    deterministic: bool | None,
    backend: str,
    auto: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # None is resolved here, when the op runs, not when a graph is traced: a compiled backward follows
    # set_deterministic() calls made after it was compiled
    deterministic = resolve_deterministic(deterministic)
    with autocast_off(query.device.type):
        return _backend.call(
            FAMILY, backend, "backward",
            fallback_key=_fallback_key(auto, query, key, value, topk, bs, deterministic),
            q=query, k=key, v=value, out=out, dout=dout, m=m, l=l, topk=topk, scale=scale, bs=bs, cu_q=cu_q,
            cu_kv=cu_kv, causal=causal, deterministic=deterministic,
        )


@_bwd_op.register_fake
def _(query, key, value, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic, backend, auto):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_autograd.register(_bwd_op, "nsa_selected_attention_grad")


def _setup_context(ctx, inputs, output):
    query, key, value, topk, scale, bs, cu_q, cu_kv, causal, backend, auto = inputs
    out, m, l = output
    ctx.save_for_backward(query, key, value, topk, out, m, l)
    ctx.args = (scale, bs, cu_q, cu_kv, causal, backend, auto)
    ctx.mark_non_differentiable(m, l)


def _backward(ctx, dout, dm, dl):
    query, key, value, topk, out, m, l = ctx.saved_tensors
    scale, bs, cu_q, cu_kv, causal, backend, auto = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _bwd_op(
        query, key, value, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, None, backend, auto,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# public functions


def nsa_selected_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    scale_value: float,
    head_num: int,
    selected_block_size: int,
    selected_block_count: int,
    *,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: SeqLens | None = None,
    actual_seq_kvlen: SeqLens | None = None,
    sparse_mode: int = 0,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NSA selected-block attention forward (docs/nsa.md), differentiable in query, key and value.

    Query token ``t`` (sequence ``b``, in-sequence position ``s1``) and query head ``h = n2*G + g`` attend the
    ``K*bs`` keys of the blocks ``topk_indices[t, n2, :]`` of their sequence; a gathered key at in-sequence
    position ``p = idx*bs + r`` is visible iff ``idx != -1``, ``p < S2(b)`` and, when ``sparse_mode == 2``,
    ``p <= s1``. Over the visible keys: ``x = scale_value * q.k``, ``m = max x``, ``l = sum exp(x - m)``,
    ``out = sum exp(x - m) / l * v``. A row with no visible key gives ``out = 0``, ``m = 0``, ``l = 0``.

    Example: ``bs = 16``, ``topk_indices[t, 0] = [2, -1]`` gathers keys ``kv_start(b) + 32 .. 47`` (slot 0) and
    nothing (slot 1).

    Args:
        query: ``[T1, N1, Dqk]`` float16, bfloat16, float32 or float64 (packed TND).
        key: ``[T2, N2, Dqk]``, the dtype of query.
        value: ``[T2, N2, Dv]``, ``Dv <= Dqk <= 256``, the dtype of query.
        topk_indices: ``[T1, N2, K]`` int32 or int64, block ids local to each token's sequence, ``-1`` = empty.
        scale_value: float multiplying ``q.k``.
        head_num: ``N1``.
        selected_block_size: ``bs``, a multiple of 16 in ``[16, 128]``, or 1, 2, 4, 8 (token granularity: ``K <= 2048``, ``G <= 128``).
        selected_block_count: ``K`` in ``[1, 128]`` with ``K * bs <= 8192``, equal to ``topk_indices.shape[2]``.
        atten_mask: optional 2-D bool/uint8 tensor, accepted for CANN compatibility and never read.
        actual_seq_qlen, actual_seq_kvlen: cumulative lengths without the leading 0 (list of ints or an integer
            tensor; pass lists under ``torch.compile``), or None for one sequence. Same count on both sides.
        sparse_mode: 0 (no mask) or 2 (causal, top-left aligned).
        backend: ``"auto"`` (triton for CUDA tensors when available, else torch; a shape whose kernel needs more
            shared memory than the GPU has runs on torch, with a ``RuntimeWarning``), ``"torch"``, ``"triton"``
            (raises ``ValueError`` for such a shape), ``"reference"``.
        validate: check block ids against each sequence (one pass over ``topk_indices``); skipped while compiling.

    Returns:
        ``(attention_out [T1, N1, Dv]`` in query's dtype, ``softmax_max [T1, N1, 8]``,
        ``softmax_sum [T1, N1, 8])``, the stats fp32 (float64 for float64 inputs), 8 equal lanes, not
        differentiable.
    """
    scale, bs, cu_q, cu_kv, causal, device = check_args(
        query, key, value, topk_indices, scale_value, head_num, selected_block_size, selected_block_count,
        atten_mask, actual_seq_qlen, actual_seq_kvlen, sparse_mode, "TND", validate,
    )
    _autograd.check_no_forward_ad("nsa_selected_attention", query, key, value)
    name, auto = _backend.resolve(FAMILY, backend, device, query.dtype)
    out, m, l = _fwd_op(query, key, value, topk_indices, scale, bs, cu_q, cu_kv, causal, name, auto)
    shape = (*m.shape, STAT_LANES)
    return out, m.unsqueeze(-1).expand(shape).contiguous(), l.unsqueeze(-1).expand(shape).contiguous()


def nsa_selected_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_out: torch.Tensor,
    attention_out_grad: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    scale_value: float,
    selected_block_size: int,
    selected_block_count: int,
    head_num: int,
    actual_seq_qlen: SeqLens | None = None,
    actual_seq_kvlen: SeqLens | None = None,
    atten_mask: torch.Tensor | None = None,
    sparse_mode: int = 0,
    input_layout: str = "TND",
    deterministic: bool | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NSA selected attention backward, the CANN ``NsaSelectedAttentionGrad`` op (docs/nsa.md).

    With ``P = exp(x - m) / l`` recomputed on the visible keys from lane 0 of the given stats and
    ``dY = attention_out_grad``: ``dV_sel = P^T dY``, ``dP = dY V_sel^T``, ``D = rowsum(dY * attention_out)``,
    ``dS = P * (dP - D)``, ``dq = scale * dS K_sel``, ``dK_sel = scale * dS^T Q``; ``dK_sel`` / ``dV_sel`` rows
    are added into ``dk`` / ``dv`` at their source key rows (keys never selected get 0).

    Args:
        query, key, value, topk_indices, scale_value, selected_block_size, selected_block_count, head_num,
            actual_seq_qlen, actual_seq_kvlen, atten_mask, sparse_mode, backend, validate: as in
            :func:`nsa_selected_attention`.
        attention_out: ``[T1, N1, Dv]`` the forward output, the dtype of query.
        attention_out_grad: ``[T1, N1, Dv]`` the gradient of the output, the dtype of query.
        softmax_max, softmax_sum: ``[T1, N1, 8]`` fp32 (float64 for float64 inputs); lane 0 is read.
        input_layout: ``"TND"`` (the only layout).
        deterministic: bool, or None to follow :func:`sparseops.set_deterministic` /
            ``torch.are_deterministic_algorithms_enabled()``. On: repeated calls are bitwise identical.

    Returns:
        ``(dq [T1, N1, Dqk], dk [T2, N2, Dqk], dv [T2, N2, Dv])`` in the dtypes of query, key, value.
    """
    scale, bs, cu_q, cu_kv, causal, device = check_args(
        query, key, value, topk_indices, scale_value, head_num, selected_block_size, selected_block_count,
        atten_mask, actual_seq_qlen, actual_seq_kvlen, sparse_mode, input_layout, validate,
        attention_out, attention_out_grad, softmax_max, softmax_sum, grad=True,
    )
    _autograd.check_no_forward_ad("nsa_selected_attention_grad", query, key, value, attention_out, attention_out_grad)
    resolve_deterministic(deterministic)  # its type, now; None is resolved when the op runs
    name, auto = _backend.resolve(FAMILY, backend, device, query.dtype)
    return _bwd_op(
        query, key, value, attention_out, attention_out_grad, softmax_max[..., 0].contiguous(),
        softmax_sum[..., 0].contiguous(), topk_indices, scale, bs, cu_q, cu_kv, causal, deterministic, name, auto,
    )
