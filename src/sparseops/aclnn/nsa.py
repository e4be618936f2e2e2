"""NSA selected attention (forward and grad) in CANN's two-phase API (docs/aclnn.md, docs/nsa.md): CANN's
names and parameter order over ``sparseops.nsa``'s ops and shared checks."""

from __future__ import annotations

import torch

from ..nsa import api as nsa_api
from ..nsa.checks import check_args
from .args import index32, int_array, integer, layout, nbytes, out_tensor, same_device, tensor
from .runtime import ACLNN_ERR_INNER_TILING_ERROR, Fail, Plan, phase1, phase2, validate

_NSA_NAMES = {
    "query": "query", "key": "key", "value": "value", "topk_indices": "topkIndices",
    "atten_mask": "attenMaskOptional", "actual_seq_qlen": "actualSeqQLenOptional",
    "actual_seq_kvlen": "actualSeqKvLenOptional", "scale_value": "scaleValue", "head_num": "headNum",
    "sparse_mode": "sparseMode", "selected_block_size": "selectedBlockSize",
    "selected_block_count": "selectedBlockCount", "input_layout": "inputLayout",
    "attention_out": "attentionOut", "attention_out_grad": "attentionOutGrad", "softmax_max": "softmaxMax",
    "softmax_sum": "softmaxSum",
}


def _sparse_mode(v) -> int:
    v = integer("sparseMode", v)
    if v not in (0, 2):
        raise Fail(ACLNN_ERR_INNER_TILING_ERROR, f"sparseMode: expected 0 (no mask) or 2 (causal), got {v}")
    return v


def _mask(t):
    return tensor("attenMaskOptional", t, required=False, dtypes=(torch.bool, torch.uint8), dtype_names="BOOL, UINT8")


@phase1("aclnnNsaSelectedAttention")
def aclnnNsaSelectedAttentionGetWorkspaceSize(  # noqa: N802
    query, key, value, topkIndices, attenMaskOptional, actualSeqQLenOptional, actualSeqKvLenOptional,  # noqa: N803
    scaleValue, headNum, inputLayout, sparseMode, selectedBlockSize, selectedBlockCount,  # noqa: N803
    softmaxMaxOut, softmaxSumOut, attentionOut,  # noqa: N803
):
    """Phase 1 of ``nsa_selected_attention``. Returns ``(status, workspace_size, executor)``.

    As CANN documents for this op, ``sparseMode=2`` applies the causal mask only when an
    ``attenMaskOptional`` tensor is passed (its values are not read); without one the call is unmasked.

    Args:
        query: `[T1, N1, Dqk]`; key: `[T2, N2, Dqk]`; value: `[T2, N2, Dv]` fp16/bf16/fp32.
        topkIndices: `[T1, N2, K]` int32.
        attenMaskOptional: 2-D bool/uint8 or None.
        actualSeqQLenOptional, actualSeqKvLenOptional: cumulative lengths (no leading 0) or None.
        scaleValue: float; headNum: int (= N1); inputLayout: "TND"; sparseMode: 0 or 2;
        selectedBlockSize, selectedBlockCount: ints.
        softmaxMaxOut, softmaxSumOut: out `[T1, N1, 8]` fp32.
        attentionOut: out `[T1, N1, Dv]` query.dtype.
    """
    q, k, v = tensor("query", query), tensor("key", key), tensor("value", value)
    topk = index32("topkIndices", topkIndices)
    mask = _mask(attenMaskOptional)
    cq = int_array("actualSeqQLenOptional", actualSeqQLenOptional)
    ckv = int_array("actualSeqKvLenOptional", actualSeqKvLenOptional)
    layout(inputLayout)
    mode = 2 if _sparse_mode(sparseMode) == 2 and mask is not None else 0  # CANN's forward rule
    device = same_device(query=q, key=k, value=v, topkIndices=topk, attenMaskOptional=mask)
    validate(_NSA_NAMES, check_args, q, k, v, topk, scaleValue, headNum, selectedBlockSize, selectedBlockCount,
             mask, cq, ckv, mode, "TND", True)
    T1, N1, Dv = q.shape[0], q.shape[1], v.shape[2]
    # in the order of the op's results: (attention_out, softmax_max, softmax_sum)
    outs = {
        "attentionOut": out_tensor("attentionOut", attentionOut, (T1, N1, Dv), q.dtype),
        "softmaxMaxOut": out_tensor("softmaxMaxOut", softmaxMaxOut, (T1, N1, 8), torch.float32),
        "softmaxSumOut": out_tensor("softmaxSumOut", softmaxSumOut, (T1, N1, 8), torch.float32),
    }
    same_device(query=q, **outs)
    ws = 2 * nbytes((T1, N1, 8), torch.float32) + nbytes((T1, N1, Dv), q.dtype)
    return Plan(lambda: nsa_api.nsa_selected_attention(
        q, k, v, topk, scaleValue, headNum, selectedBlockSize, selectedBlockCount, atten_mask=mask,
        actual_seq_qlen=cq, actual_seq_kvlen=ckv, sparse_mode=mode, backend="auto", validate=False,
    ), outs, _NSA_NAMES, ws, device)


aclnnNsaSelectedAttention = phase2("aclnnNsaSelectedAttention", "nsa_selected_attention")


@phase1("aclnnNsaSelectedAttentionGrad")
def aclnnNsaSelectedAttentionGradGetWorkspaceSize(  # noqa: N802
    query, key, value, attentionOut, attentionOutGrad, softmaxMax, softmaxSum, topkIndices,  # noqa: N803
    actualSeqQLenOptional, actualSeqKvLenOptional, attenMaskOptional, scaleValue, selectedBlockSize,  # noqa: N803
    selectedBlockCount, headNum, inputLayout, sparseMode, dqOut, dkOut, dvOut,  # noqa: N803
):
    """Phase 1 of ``nsa_selected_attention_grad`` (the seed op). Returns ``(status, workspace_size, executor)``.

    ``sparseMode=2`` masks causally whether or not a mask tensor is passed (CANN's grad rule). Determinism
    follows :func:`aclrtCtxSetSysParamOpt` (``ACL_OPT_DETERMINISTIC``), the same switch as
    :func:`sparseops.set_deterministic`, read when phase 2 runs.

    Args:
        query, key, value: as the forward; attentionOut, attentionOutGrad: `[T1, N1, Dv]`.
        softmaxMax, softmaxSum: `[T1, N1, 8]` fp32.
        topkIndices: `[T1, N2, K]` int32.
        dqOut, dkOut, dvOut: outs shaped and typed like query, key, value.
    """
    q, k, v = tensor("query", query), tensor("key", key), tensor("value", value)
    o, do = tensor("attentionOut", attentionOut), tensor("attentionOutGrad", attentionOutGrad)
    m = tensor("softmaxMax", softmaxMax, dtypes=(torch.float32,), dtype_names="FLOAT")
    l = tensor("softmaxSum", softmaxSum, dtypes=(torch.float32,), dtype_names="FLOAT")
    topk = index32("topkIndices", topkIndices)
    cq = int_array("actualSeqQLenOptional", actualSeqQLenOptional)
    ckv = int_array("actualSeqKvLenOptional", actualSeqKvLenOptional)
    mask = _mask(attenMaskOptional)
    layout(inputLayout)
    mode = _sparse_mode(sparseMode)
    device = same_device(query=q, key=k, value=v, attentionOut=o, attentionOutGrad=do, softmaxMax=m,
                         softmaxSum=l, topkIndices=topk, attenMaskOptional=mask)
    validate(_NSA_NAMES, check_args, q, k, v, topk, scaleValue, headNum, selectedBlockSize, selectedBlockCount,
             mask, cq, ckv, mode, "TND", True, o, do, m, l, grad=True)
    outs = {
        "dqOut": out_tensor("dqOut", dqOut, tuple(q.shape), q.dtype),
        "dkOut": out_tensor("dkOut", dkOut, tuple(k.shape), k.dtype),
        "dvOut": out_tensor("dvOut", dvOut, tuple(v.shape), v.dtype),
    }
    same_device(query=q, **outs)
    ws = sum(nbytes(t.shape, t.dtype) for t in (q, k, v))
    return Plan(lambda: nsa_api.nsa_selected_attention_grad(
        q, k, v, o, do, m, l, topk, scale_value=scaleValue, selected_block_size=selectedBlockSize,
        selected_block_count=selectedBlockCount, head_num=headNum, actual_seq_qlen=cq, actual_seq_kvlen=ckv,
        atten_mask=mask, sparse_mode=mode, input_layout="TND", deterministic=None, backend="auto", validate=False,
    ), outs, _NSA_NAMES, ws, device)


aclnnNsaSelectedAttentionGrad = phase2("aclnnNsaSelectedAttentionGrad", "nsa_selected_attention_grad")
