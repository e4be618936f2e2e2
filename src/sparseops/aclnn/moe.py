"""The MoE token permute/unpermute operators (and their grads) of CANN's two-phase API (docs/aclnn.md,
docs/moe.md): CANN's names and parameter order over ``sparseops.moe``'s ops and shared checks."""

from __future__ import annotations

import torch

from ..moe import api as moe_api
from ..moe.checks import (
    check_permute_args,
    check_permute_grad_args,
    check_unpermute_args,
    check_unpermute_grad_args,
    normalize_range,
)
from .args import index32, int_array, integer, nbytes, out_tensor, padded_mode, same_device, tensor
from .runtime import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_NULLPTR,
    Fail,
    Plan,
    fmt_shape,
    phase1,
    phase2,
    validate,
)


def _window_rows(names: dict[str, str], rng, sorted_indices, t: torch.Tensor, cann: str):
    """The window ``(s, e)`` of docs/moe.md for a permuted-side input ``t`` that may be taller than it (CANN
    documents ``[N, H]``): its first ``R = e - s`` rows are read. Returns ``(s, e, t[:R])``; when the shapes are
    too broken to tell, ``t`` is returned whole and the op's validator reports them."""
    if t.dim() < 1 or sorted_indices.dim() != 1:
        return None, None, t
    N = sorted_indices.shape[0]
    s, e = validate(names, normalize_range, rng, N, min(t.shape[0], N))
    if t.shape[0] < e - s:
        raise Fail(
            ACLNN_ERR_INNER_TILING_ERROR,
            f"{cann}: expected at least R={e - s} rows for the window [{s}, {e}), got shape {fmt_shape(t.shape)}",
        )
    return s, e, t[: e - s]


_PERMUTE_NAMES = {
    "tokens": "tokens", "indices": "indices", "probs": "probsOptional", "range": "rangeOptional",
    "num_out_tokens": "numOutTokens", "padded_mode": "paddedMode",
}


@phase1("aclnnMoeTokenPermuteWithEp")
def aclnnMoeTokenPermuteWithEpGetWorkspaceSize(  # noqa: N802
    tokens, indices, probsOptional, rangeOptional, numOutTokens, paddedMode,  # noqa: N803
    permuteTokensOut, sortedIndicesOut, permuteProbsOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_permute_with_ep``. Returns ``(status, workspace_size, executor)``.

    Args:
        tokens: `[T, H]` fp32/fp16/bf16.
        indices: `[T, K]` or `[T]` int32/int64 expert ids.
        probsOptional: `[T, K]` fp32/fp16/bf16 or None.
        rangeOptional: `[start, end]` (list of ints, or None for the whole window).
        numOutTokens: int, applies when ``rangeOptional`` is None.
        paddedMode: bool, only False.
        permuteTokensOut: out `[R, H]` tokens.dtype.
        sortedIndicesOut: out `[N]` int32.
        permuteProbsOut: out `[R]` probs.dtype; required when probsOptional is given, else ignored.
    """
    tensor("tokens", tokens)
    tensor("indices", indices, dtypes=(torch.int32, torch.int64), dtype_names="INT32, INT64")
    probs = tensor("probsOptional", probsOptional, required=False)
    rng = int_array("rangeOptional", rangeOptional)
    n_out = integer("numOutTokens", numOutTokens)
    padded_mode(paddedMode)
    device = same_device(tokens=tokens, indices=indices, probsOptional=probs)
    _, _, _, K, s, e = validate(_PERMUTE_NAMES, check_permute_args, tokens, indices, probs, rng, n_out, False,
                                validate=True)
    N, H, R = indices.numel(), tokens.shape[1], e - s
    outs = {"permuteTokensOut": out_tensor("permuteTokensOut", permuteTokensOut, (R, H), tokens.dtype),
            "sortedIndicesOut": out_tensor("sortedIndicesOut", sortedIndicesOut, (N,), torch.int32),
            "permuteProbsOut": None}
    ws = nbytes((R, H), tokens.dtype) + nbytes((N,), torch.int32)
    if probs is not None:
        outs["permuteProbsOut"] = out_tensor("permuteProbsOut", permuteProbsOut, (R,), probs.dtype)
        ws += nbytes((R,), probs.dtype)
    same_device(tokens=tokens, **outs)
    return Plan(lambda: moe_api.moe_token_permute_with_ep(tokens, indices, probs, rng, n_out, False,
                                                          backend="auto", validate=False),
                outs, _PERMUTE_NAMES, ws, device)


aclnnMoeTokenPermuteWithEp = phase2("aclnnMoeTokenPermuteWithEp", "moe_token_permute_with_ep")


_UNPERMUTE_NAMES = {
    "permuted_tokens": "permutedTokens", "sorted_indices": "sortedIndices", "probs": "probsOptional",
    "topk_num": "numTopk", "range": "rangeOptional", "padded_mode": "paddedMode",
    "restore_shape": "restoreShapeOptional",
}


@phase1("aclnnMoeTokenUnpermuteWithEp")
def aclnnMoeTokenUnpermuteWithEpGetWorkspaceSize(  # noqa: N802
    permutedTokens, sortedIndices, probsOptional, numTopk, rangeOptional, paddedMode,  # noqa: N803
    restoreShapeOptional, out,  # noqa: N803
):
    """Phase 1 of ``moe_token_unpermute_with_ep``. Returns ``(status, workspace_size, executor)``.

    Args:
        permutedTokens: `[>= R, H]`; the first R rows are read (R = window length).
        sortedIndices: `[N]` int32.
        probsOptional: `[T, K]` or None.
        numTopk: int, K when probsOptional is None.
        rangeOptional: `[start, end]` or None (None: the rows of permutedTokens).
        paddedMode: bool, only False.
        restoreShapeOptional: None or `[T, H]`.
        out: out `[T, H]` permutedTokens.dtype.
    """
    tensor("permutedTokens", permutedTokens)
    index32("sortedIndices", sortedIndices)
    probs = tensor("probsOptional", probsOptional, required=False)
    topk = integer("numTopk", numTopk)
    rng = int_array("rangeOptional", rangeOptional)
    padded_mode(paddedMode)
    restore = int_array("restoreShapeOptional", restoreShapeOptional)
    device = same_device(permutedTokens=permutedTokens, sortedIndices=sortedIndices, probsOptional=probs)
    _, _, pt = _window_rows(_UNPERMUTE_NAMES, rng, sortedIndices, permutedTokens, "permutedTokens")
    _, _, _, K, s, e = validate(_UNPERMUTE_NAMES, check_unpermute_args, pt, sortedIndices, probs, topk, rng, False,
                                restore, validate=True)
    T, H = sortedIndices.shape[0] // K, pt.shape[1]
    outs = {"out": out_tensor("out", out, (T, H), pt.dtype)}
    same_device(permutedTokens=pt, **outs)
    return Plan(lambda: moe_api.moe_token_unpermute_with_ep(pt, sortedIndices, probs, topk, rng, False, restore,
                                                            backend="auto", validate=False),
                outs, _UNPERMUTE_NAMES, nbytes((T, H), pt.dtype), device)


aclnnMoeTokenUnpermuteWithEp = phase2("aclnnMoeTokenUnpermuteWithEp", "moe_token_unpermute_with_ep")


_UNPERMUTE_GRAD_NAMES = {
    "unpermuted_tokens_grad": "unpermutedTokensGrad", "sorted_indices": "sortedIndices",
    "permuted_tokens": "permutedTokensOptional", "probs": "probsOptional", "padded_mode": "paddedMode",
    "restore_shape": "restoreShapeOptional", "range": "rangeOptional", "topk_num": "topkNum",
}


@phase1("aclnnMoeTokenUnpermuteWithEpGrad")
def aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize(  # noqa: N802
    unpermutedTokensGrad, sortedIndices, permutedTokensOptional, probsOptional, paddedMode,  # noqa: N803
    restoreShapeOptional, rangeOptional, topkNum, permutedTokensGradOut, probsGradOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_unpermute_with_ep_grad``. Returns ``(status, workspace_size, executor)``.

    Args:
        unpermutedTokensGrad: `[T, H]` fp32/fp16/bf16.
        sortedIndices: `[N]` int32, N = T*K.
        permutedTokensOptional: `[>= R, H]` (CANN documents `[N, H]`); the first R rows are read. Required
            when probsOptional is given.
        probsOptional: `[T, K]` or None.
        paddedMode: bool, only False.
        restoreShapeOptional: None or `[T, H]`.
        rangeOptional: `[start, end]` or None.
        topkNum: int, K when probsOptional is None.
        permutedTokensGradOut: out `[N, H]` grad dtype: rows `[0, R)` get the result, the rest zeros.
        probsGradOut: out `[T, K]` probs dtype; required when probsOptional is given, else ignored.
    """
    g = tensor("unpermutedTokensGrad", unpermutedTokensGrad)
    index32("sortedIndices", sortedIndices)
    pt = tensor("permutedTokensOptional", permutedTokensOptional, required=False)
    probs = tensor("probsOptional", probsOptional, required=False)
    padded_mode(paddedMode)
    restore = int_array("restoreShapeOptional", restoreShapeOptional)
    rng = int_array("rangeOptional", rangeOptional)
    topk = integer("topkNum", topkNum)
    if probs is not None and pt is None:
        raise Fail(ACLNN_ERR_PARAM_NULLPTR, "permutedTokensOptional: is None but probsOptional is given (needed for probsGradOut)")
    device = same_device(unpermutedTokensGrad=g, sortedIndices=sortedIndices, permutedTokensOptional=pt,
                         probsOptional=probs)
    if pt is not None:
        _, _, pt = _window_rows(_UNPERMUTE_GRAD_NAMES, rng, sortedIndices, pt, "permutedTokensOptional")
    _, _, _, _, K, s, e = validate(_UNPERMUTE_GRAD_NAMES, check_unpermute_grad_args, g, sortedIndices, pt, probs,
                                   False, restore, rng, topk, validate=True)
    (T, H), N, R = g.shape, sortedIndices.shape[0], e - s
    outs = {"permutedTokensGradOut": out_tensor("permutedTokensGradOut", permutedTokensGradOut, (N, H), g.dtype),
            "probsGradOut": None}
    ws = nbytes((R, H), g.dtype)
    if probs is not None:
        outs["probsGradOut"] = out_tensor("probsGradOut", probsGradOut, (T, K), probs.dtype)
        ws += nbytes((T, K), probs.dtype)
    same_device(unpermutedTokensGrad=g, **outs)
    return Plan(lambda: moe_api.moe_token_unpermute_with_ep_grad(g, sortedIndices, pt, probs, False, restore, rng,
                                                                 topk, backend="auto", validate=False),
                outs, _UNPERMUTE_GRAD_NAMES, ws, device)


aclnnMoeTokenUnpermuteWithEpGrad = phase2("aclnnMoeTokenUnpermuteWithEpGrad", "moe_token_unpermute_with_ep_grad")


_PERMUTE_GRAD_NAMES = {
    "permuted_tokens_grad": "permutedTokensOutputGrad", "sorted_indices": "sortedIndices",
    "permuted_probs_grad": "permutedProbsOutputGradOptional", "topk_num": "numTopk", "range": "rangeOptional",
    "padded_mode": "paddedMode",
}


@phase1("aclnnMoeTokenPermuteWithEpGrad")
def aclnnMoeTokenPermuteWithEpGradGetWorkspaceSize(  # noqa: N802
    permutedTokensOutputGrad, sortedIndices, permutedProbsOutputGradOptional, numTopk, rangeOptional,  # noqa: N803
    paddedMode, tokenGradOut, probsGradOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_permute_with_ep_grad``. Returns ``(status, workspace_size, executor)``.

    Args:
        permutedTokensOutputGrad: `[>= R, H]`; the first R rows are read.
        sortedIndices: `[N]` int32.
        permutedProbsOutputGradOptional: `[>= R]` or None; the first R entries are read.
        numTopk: int K.
        rangeOptional: `[start, end]` or None (None: the rows of permutedTokensOutputGrad).
        paddedMode: bool, only False.
        tokenGradOut: out `[T, H]` grad dtype.
        probsGradOut: out `[T, K]` permuted-probs-grad dtype; required when that input is given, else ignored.
    """
    g = tensor("permutedTokensOutputGrad", permutedTokensOutputGrad)
    index32("sortedIndices", sortedIndices)
    ppg = tensor("permutedProbsOutputGradOptional", permutedProbsOutputGradOptional, required=False)
    topk = integer("numTopk", numTopk)
    rng = int_array("rangeOptional", rangeOptional)
    padded_mode(paddedMode)
    device = same_device(permutedTokensOutputGrad=g, sortedIndices=sortedIndices, permutedProbsOutputGradOptional=ppg)
    s, e, g = _window_rows(_PERMUTE_GRAD_NAMES, rng, sortedIndices, g, "permutedTokensOutputGrad")
    if ppg is not None and s is not None:
        if ppg.dim() != 1 or ppg.shape[0] < e - s:
            raise Fail(
                ACLNN_ERR_INNER_TILING_ERROR,
                f"permutedProbsOutputGradOptional: expected a 1-D tensor of at least R={e - s} entries, got shape "
                f"{fmt_shape(ppg.shape)}",
            )
        ppg = ppg[: e - s]
    _, _, _, K, s, e = validate(_PERMUTE_GRAD_NAMES, check_permute_grad_args, g, sortedIndices, ppg, topk, rng, False,
                                validate=True)
    T, H = sortedIndices.shape[0] // K, g.shape[1]
    outs = {"tokenGradOut": out_tensor("tokenGradOut", tokenGradOut, (T, H), g.dtype), "probsGradOut": None}
    ws = nbytes((T, H), g.dtype)
    if ppg is not None:
        outs["probsGradOut"] = out_tensor("probsGradOut", probsGradOut, (T, K), ppg.dtype)
        ws += nbytes((T, K), ppg.dtype)
    same_device(permutedTokensOutputGrad=g, **outs)
    return Plan(lambda: moe_api.moe_token_permute_with_ep_grad(g, sortedIndices, ppg, topk, rng, False,
                                                               backend="auto", validate=False),
                outs, _PERMUTE_GRAD_NAMES, ws, device)


aclnnMoeTokenPermuteWithEpGrad = phase2("aclnnMoeTokenPermuteWithEpGrad", "moe_token_permute_with_ep_grad")
