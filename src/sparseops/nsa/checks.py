"""Argument checks of the NSA selected-attention ops, shared by the Python API (:mod:`.api`) and the CANN layer.

Messages name the argument, the expected and the actual value; nothing is computed before they pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _checks
from .._numerics import acc_dtype
from .._varlen import normalize_cu_seqlens, token_seq_positions

#: input dtypes: CANN's fp16/bf16, fp32 for testing, float64 for gradcheck (stats then are float64 too)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
STAT_LANES = 8

#: CANN cumulative sequence lengths, without the leading 0
SeqLens = Sequence[int] | torch.Tensor


#: block sizes of the token-granularity path (docs/nsa.md, "Token granularity"), besides multiples of 16 in [16, 128]
TOKEN_BLOCK_SIZES = (1, 2, 4, 8)


def check_block_size(selected_block_size) -> int:
    """``selected_block_size`` in ``(1, 2, 4, 8)`` or a multiple of 16 in ``[16, 128]``."""
    bs = _checks.check_int("selected_block_size", selected_block_size)
    if bs not in TOKEN_BLOCK_SIZES and not (16 <= bs <= 128 and bs % 16 == 0):
        raise ValueError(f"selected_block_size: expected 1, 2, 4, 8 or a multiple of 16 in [16, 128], got {bs}")
    return bs


def max_block_count(bs: int) -> int:
    """The largest ``selected_block_count`` for block size ``bs``: 2048 at token granularity, else 128."""
    return 2048 if bs in TOKEN_BLOCK_SIZES else 128


def max_group(bs: int) -> int:
    """The largest ``G = N1 / N2`` for block size ``bs``: 128 at token granularity (DSA's MQA), else 32."""
    return 128 if bs in TOKEN_BLOCK_SIZES else 32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


#: dtype of ``softmax_max`` / ``softmax_sum`` for inputs of a dtype: fp32, float64 for float64
stats_dtype = acc_dtype


def check_args(
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
    """Every argument check of ``nsa_selected_attention`` (``grad=False``) and ``nsa_selected_attention_grad``
    (``grad=True``, with the four backward tensors), before anything runs (docs/nsa.md).

    Returns:
        ``(scale, bs, cu_q, cu_kv, causal, device)``: ``scale_value`` as a float, ``selected_block_size``,
        the cumulative lengths with the leading 0 as ``list[int]``, ``sparse_mode == 2`` and the tensors' device.
    """
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
    bs = check_block_size(selected_block_size)
    K = _checks.check_int("selected_block_count", selected_block_count, lo=1, hi=max_block_count(bs))
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
    if not 1 <= G <= max_group(bs):
        raise ValueError(
            f"query: expected 1 <= G = N1 / N2 <= {max_group(bs)} (selected_block_size = {bs}), got N1 = {N1}, "
            f"N2 = {N2}, G = {G}"
        )
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
        check_block_ids(topk_indices, bs, cu_q, cu_kv)
    return scale, bs, cu_q, cu_kv, sparse_mode == 2, device


def check_block_ids(topk: torch.Tensor, bs: int, cu_q: list[int], cu_kv: list[int]) -> None:
    """Every id of ``topk [T1, N2, K]`` in ``[-1, ceil(S2(b) / bs))`` of its token's sequence ``b`` (one
    vectorized pass); ``cu_q``, ``cu_kv``: cumulative lengths with the leading 0."""
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
