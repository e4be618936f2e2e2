"""Public NSA selected-attention ops (spec/nsa.md): argument checks, defaults, backend choice and autograd.

The forward and the seed backward are ``torch.library`` custom ops (``sparseops::nsa_selected_attention_fwd``,
``sparseops::nsa_selected_attention_bwd``) with fake (meta) implementations and a registered autograd formula,
so ``torch.compile(fullgraph=True)`` traces a call without a graph break. Cumulative lengths reach the ops as
``list[int]`` with the leading 0; the data-dependent block-id check is skipped while compiling.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from collections.abc import Sequence

import torch

from .. import _autograd, _checks, _triton
from .._config import resolve_deterministic
from .._varlen import normalize_cu_seqlens, token_seq_positions

#: input dtypes: CANN's fp16/bf16, fp32 for testing, float64 for gradcheck (stats then are float64 too)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
STAT_LANES = 8

#: CANN cumulative sequence lengths, without the leading 0
SeqLens = Sequence[int] | torch.Tensor


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of ``softmax_max`` / ``softmax_sum`` for inputs of ``dtype``: fp32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: what ``_resolve_backend`` returns when ``auto`` chose Triton: like ``"triton"``, but a shape whose kernel does
#: not fit the device (``_triton.DoesNotFit``, e.g. fp32 inputs with wide heads) runs on the torch path instead
AUTO_TRITON = "auto:triton"


def _backend_module(backend: str):
    """The backend module; ``triton_impl`` is imported lazily and may be absent (a clear error then)."""
    if backend in ("triton", AUTO_TRITON):
        try:
            return importlib.import_module(".triton_impl", __package__)
        except ImportError as e:
            raise ValueError(
                f"backend: 'triton' was asked for but sparseops.nsa.triton_impl could not be imported ({e})"
            ) from e
    return importlib.import_module(f".{'reference' if backend == 'reference' else 'torch_impl'}", __package__)


def _resolve_backend(backend, device: torch.device, dtype: torch.dtype) -> str:
    name = _checks.resolve_backend(backend, device)
    if name == "triton" and backend == "auto" and (
        dtype == torch.float64 or importlib.util.find_spec(f"{__package__}.triton_impl") is None
    ):
        # the Triton kernels take fp32/fp16/bf16; auto sends float64 (a testing dtype) to the torch path
        return "torch"
    if name == "triton":
        _backend_module("triton")
    return AUTO_TRITON if name == "triton" and backend == "auto" else name


#: ``auto`` calls whose Triton kernels did not fit: ``(fn, device, arch, dtype, N1, N2, Dqk, Dv, K, bs, ...)``
_AUTO_TORCH: set = set()


def _shape_key(fn: str, args, kwargs) -> tuple:
    """What decides whether the Triton kernels of ``forward`` / ``backward`` fit: device, dtype and sizes."""
    q, k, v = args[:3]
    topk, bs = (args[3], args[5]) if fn == "forward" else (args[7], args[9])
    return (fn, str(q.device), _triton.arch(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], topk.shape[2], bs,
            tuple(sorted(kwargs.items())), getattr(_backend_module(AUTO_TRITON), "DQ_ATOMIC", None))


def _run(backend: str, fn: str, *args, **kwargs):
    """``<backend module>.<fn>(*args, **kwargs)``; under ``auto``, the torch path where a kernel does not fit
    (remembered per shape, so that later calls do not launch the kernels that did fit again for nothing)."""
    with _autocast_off(args[0].device.type):
        return _run_backend(backend, fn, *args, **kwargs)


def _autocast_off(device_type: str):
    """The ops compute in their inputs' dtypes with fp32 accumulation: an enclosing ``torch.autocast`` must not
    re-type the matmuls inside them (on the CPU it made ``bmm(..., out=fp32)`` fail)."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _run_backend(backend: str, fn: str, *args, **kwargs):
    if backend != AUTO_TRITON:
        return getattr(_backend_module(backend), fn)(*args, **kwargs)
    key = _shape_key(fn, args, kwargs)
    if key not in _AUTO_TORCH:
        try:
            return getattr(_backend_module(backend), fn)(*args, **kwargs)
        except _triton.DoesNotFit as e:
            _AUTO_TORCH.add(key)
            warnings.warn(f"sparseops: {e}; backend='auto' runs this shape on the torch path", RuntimeWarning,
                          stacklevel=2)
    return getattr(_backend_module("torch"), fn)(*args, **kwargs)


def _check_args(
    query,
    key,
    value,
    topk_indices,
    scale_value,
    head_num,
    selected_block_size,
    selected_block_count,
    atten_mask,
    actual_seq_qlen,
    actual_seq_kvlen,
    sparse_mode,
    input_layout,
    validate,
    attention_out=None,
    attention_out_grad=None,
    softmax_max=None,
    softmax_sum=None,
    grad=False,
):
    """Every check of spec/nsa.md §5/§6, shared by the forward and the seed backward, before anything runs.

    Returns ``(scale, bs, cu_q, cu_kv, causal, device)``."""
    query = _checks.check_tensor("query", query, ndim=3, dtypes=DTYPES)
    dt = query.dtype
    key = _checks.check_tensor("key", key, ndim=3)
    value = _checks.check_tensor("value", value, ndim=3)
    named = {"key": key, "value": value}
    if grad:
        named["attention_out"] = _checks.check_tensor("attention_out", attention_out, ndim=3)
        named["attention_out_grad"] = _checks.check_tensor("attention_out_grad", attention_out_grad, ndim=3)
    for nm, t in named.items():
        if t.dtype != dt:
            raise TypeError(f"{nm}: expected dtype {_name(dt)} (the dtype of query), got {_name(t.dtype)}")
    topk_indices = _checks.check_tensor("topk_indices", topk_indices, ndim=3, dtypes=_checks.INDEX_DTYPES)
    sdt = stats_dtype(dt)
    if grad:
        for nm, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            _checks.check_tensor(nm, t, ndim=3)
            if t.dtype != sdt:
                raise TypeError(f"{nm}: expected dtype {_name(sdt)} for {_name(dt)} inputs, got {_name(t.dtype)}")
    if atten_mask is not None:
        _checks.check_tensor("atten_mask", atten_mask, ndim=2, dtypes=(torch.bool, torch.uint8))
    if not isinstance(input_layout, str) or input_layout != "TND":
        raise ValueError(f"input_layout: expected 'TND' (the only layout supported), got {input_layout!r}")
    validate = _checks.check_bool("validate", validate)
    scale = _checks.check_float("scale_value", scale_value)
    bs = _checks.check_int("selected_block_size", selected_block_size, lo=16, hi=128, multiple_of=16)
    K = _checks.check_int("selected_block_count", selected_block_count, lo=1, hi=128)
    if K * bs > 8192:
        raise ValueError(
            f"selected_block_count: expected selected_block_count * selected_block_size <= 8192, got {K} * {bs} = {K * bs}"
        )
    sparse_mode = _checks.check_int("sparse_mode", sparse_mode)
    if sparse_mode not in (0, 2):
        raise ValueError(f"sparse_mode: expected 0 (no mask) or 2 (causal), got {sparse_mode}")
    head_num = _checks.check_int("head_num", head_num)

    T1, N1, Dqk = query.shape
    T2, N2 = key.shape[0], key.shape[1]
    _checks.check_shape("key", key, [("T2", -1), ("N2", -1), ("Dqk", Dqk)])
    _checks.check_shape("value", value, [("T2", T2), ("N2", N2), ("Dv", -1)])
    Dv = value.shape[2]
    if head_num != N1:
        raise ValueError(f"head_num: expected N1 = query.shape[1] = {N1}, got {head_num}")
    if N2 < 1 or N1 % N2:
        raise ValueError(f"key: expected N2 = key.shape[1] >= 1 dividing N1 = {N1}, got N2 = {N2}")
    G = N1 // N2
    if not 1 <= G <= 32:
        raise ValueError(f"query: expected 1 <= G = N1 / N2 <= 32, got N1 = {N1}, N2 = {N2}, G = {G}")
    if not 1 <= Dqk <= MAX_HEAD_DIM:
        raise ValueError(f"query: expected head dim 1 <= Dqk <= {MAX_HEAD_DIM}, got Dqk = {Dqk}")
    if not 1 <= Dv <= Dqk:
        raise ValueError(f"value: expected head dim 1 <= Dv <= Dqk = {Dqk}, got Dv = {Dv}")
    _checks.check_shape("topk_indices", topk_indices, [("T1", T1), ("N2", N2), ("K", -1)])
    if topk_indices.shape[2] != K:
        raise ValueError(
            f"selected_block_count: expected topk_indices.shape[2] = {topk_indices.shape[2]}, got {K}"
        )
    if grad:
        _checks.check_shape("attention_out", attention_out, [("T1", T1), ("N1", N1), ("Dv", Dv)])
        _checks.check_shape("attention_out_grad", attention_out_grad, [("T1", T1), ("N1", N1), ("Dv", Dv)])
        _checks.check_shape("softmax_max", softmax_max, [("T1", T1), ("N1", N1), ("lanes", STAT_LANES)])
        _checks.check_shape("softmax_sum", softmax_sum, [("T1", T1), ("N1", N1), ("lanes", STAT_LANES)])
    device = _checks.check_same_device(
        query=query, key=key, value=value, topk_indices=topk_indices, attention_out=attention_out,
        attention_out_grad=attention_out_grad, softmax_max=softmax_max, softmax_sum=softmax_sum,
    )

    cu_q = normalize_cu_seqlens("actual_seq_qlen", actual_seq_qlen, T1)
    cu_kv = normalize_cu_seqlens("actual_seq_kvlen", actual_seq_kvlen, T2)
    if len(cu_q) != len(cu_kv):
        raise ValueError(
            f"actual_seq_kvlen: expected as many sequences as actual_seq_qlen ({len(cu_q) - 1}), got {len(cu_kv) - 1}"
        )
    if _checks.data_checks(validate, topk_indices):
        _check_block_ids(topk_indices, bs, cu_q, cu_kv)
    return scale, bs, cu_q, cu_kv, sparse_mode == 2, device


def _check_block_ids(topk: torch.Tensor, bs: int, cu_q: list[int], cu_kv: list[int]) -> None:
    """Every id in ``[-1, ceil(S2(b) / bs))`` of its token's sequence (one vectorized pass)."""
    seq, _ = token_seq_positions(cu_q, device=topk.device)
    nblk = torch.tensor(
        [-(-(cu_kv[b + 1] - cu_kv[b]) // bs) for b in range(len(cu_kv) - 1)], dtype=torch.int64, device=topk.device
    )
    hi = nblk[seq][:, None, None]
    bad = (topk < -1) | (topk >= hi)
    if bool(bad.any()):
        t, n2, j = (int(i) for i in torch.nonzero(bad)[0])
        b = int(seq[t])
        raise ValueError(
            f"topk_indices: expected block ids in [-1, ceil(S2/bs)) of the token's sequence, got "
            f"{int(topk[t, n2, j])} at [{t}, {n2}, {j}] (sequence {b}: S2 = {cu_kv[b + 1] - cu_kv[b]}, "
            f"bs = {bs}, allowed [-1, {int(nblk[b])}))"
        )


# ----------------------------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run(backend, "forward", query, key, value, topk, scale, bs, cu_q, cu_kv, causal)


@_fwd_op.register_fake
def _(query, key, value, topk, scale, bs, cu_q, cu_kv, causal, backend):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # None is resolved here, when the op runs, not when a graph is traced: a compiled backward follows
    # set_deterministic() calls made after it was compiled
    deterministic = resolve_deterministic(deterministic)
    return _run(
        backend, "backward", query, key, value, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal,
        deterministic=deterministic,
    )


@_bwd_op.register_fake
def _(query, key, value, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic, backend):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_autograd.register(_bwd_op, "nsa_selected_attention_grad")


def _setup_context(ctx, inputs, output):
    query, key, value, topk, scale, bs, cu_q, cu_kv, causal, backend = inputs
    out, m, l = output
    ctx.save_for_backward(query, key, value, topk, out, m, l)
    ctx.args = (scale, bs, cu_q, cu_kv, causal, backend)
    ctx.mark_non_differentiable(m, l)


def _backward(ctx, dout, dm, dl):
    query, key, value, topk, out, m, l = ctx.saved_tensors
    scale, bs, cu_q, cu_kv, causal, backend = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _bwd_op(
        query, key, value, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, None, backend,
    )
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------------------------


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
    """NSA selected-block attention forward (spec/nsa.md §3), differentiable in query, key and value.

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
        selected_block_size: ``bs``, a multiple of 16 in ``[16, 128]``.
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
    scale, bs, cu_q, cu_kv, causal, device = _check_args(
        query, key, value, topk_indices, scale_value, head_num, selected_block_size, selected_block_count,
        atten_mask, actual_seq_qlen, actual_seq_kvlen, sparse_mode, "TND", validate,
    )
    name = _resolve_backend(backend, device, query.dtype)
    out, m, l = _fwd_op(query, key, value, topk_indices, scale, bs, cu_q, cu_kv, causal, name)
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
    """NSA selected attention backward, the CANN ``NsaSelectedAttentionGrad`` op (spec/nsa.md §4).

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
    scale, bs, cu_q, cu_kv, causal, device = _check_args(
        query, key, value, topk_indices, scale_value, head_num, selected_block_size, selected_block_count,
        atten_mask, actual_seq_qlen, actual_seq_kvlen, sparse_mode, input_layout, validate,
        attention_out, attention_out_grad, softmax_max, softmax_sum, grad=True,
    )
    resolve_deterministic(deterministic)  # its type, now; None is resolved when the op runs
    name = _resolve_backend(backend, device, query.dtype)
    return _bwd_op(
        query, key, value, attention_out, attention_out_grad, softmax_max[..., 0].contiguous(),
        softmax_sum[..., 0].contiguous(), topk_indices, scale, bs, cu_q, cu_kv, causal, deterministic, name,
    )
