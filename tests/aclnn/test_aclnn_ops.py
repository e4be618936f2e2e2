"""The CANN two-phase API (docs/aclnn.md): results equal the Python ops bit for bit, every
status code is reached by a real bad call (data errors included: phase 1 validates everything), executors
run once, nothing is written when a call fails."""

from __future__ import annotations

import re

import pytest
import torch

import sparseops
from sparseops import aclnn
from sparseops.aclnn import (
    ACL_OPT_DETERMINISTIC,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_SUCCESS,
    aclGetRecentErrMsg,
)
from sparseops.testing import make_moe_inputs, make_nsa_inputs, poison_

# helpers


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0 != +0), the comparison for "nothing written" and "equals the Python op"."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout != torch.strided:  # a sparse out tensor (refused): its values
        return same_bits(a.to_dense(), b.to_dense())
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_pair(name: str, *args) -> None:
    """Phase 1 then phase 2 of ``aclnn<name>``, with a workspace of exactly the size asked for."""
    status, ws, ex = getattr(aclnn, f"aclnn{name}GetWorkspaceSize")(*args)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    assert isinstance(ws, int) and ws >= 0
    workspace = torch.empty(ws, dtype=torch.uint8) if ws else None
    status = getattr(aclnn, f"aclnn{name}")(workspace, ws, ex, None)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    assert aclGetRecentErrMsg() is None


def phase1(name: str, *args):
    return getattr(aclnn, f"aclnn{name}GetWorkspaceSize")(*args)


def empty_like_poisoned(shape, dtype) -> torch.Tensor:
    return poison_(torch.empty(shape, dtype=dtype))


# MoE inputs: T=5 tokens, K=2, H=3 (N=10 slots); window [2, 8) = R=6 rows (a middle EP rank)

T, K, H = 5, 2, 3
N = T * K
RANGE = [2, 8]
R = 6


def moe(dtype=torch.float32, probs_dtype=None, seed=0):
    d = make_moe_inputs(T, K, H, dtype=dtype, probs_dtype=probs_dtype, seed=seed)
    _, si, _ = sparseops.moe_token_permute_with_ep(d["tokens"], d["indices"])
    d["sorted_indices"] = si
    g = torch.Generator().manual_seed(seed + 7)
    d["grad"] = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    d["ptokens_full"] = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)  # [N, H] as CANN documents
    return d


def unpermute_grad_args(d, *, probs=True, out=None, pg_out=None, rng=RANGE, topk=K):
    """Arguments of aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize, in CANN's order."""
    p = d["probs"] if probs else None
    if out is None:
        out = empty_like_poisoned((N, H), d["grad"].dtype)
    if pg_out is None and probs:
        pg_out = empty_like_poisoned((T, K), p.dtype)
    return [d["grad"], d["sorted_indices"], d["ptokens_full"], p, False, None, rng, topk, out, pg_out]


# success paths equal the Python ops, bit for bit


@pytest.mark.parametrize(
    "dtype,probs_dtype,rng",
    [
        (torch.float32, torch.float32, RANGE),
        (torch.float16, torch.bfloat16, RANGE),  # mixed token / probs dtypes
        (torch.bfloat16, torch.float32, None),  # no range: the rows of permutedTokensOptional ([N, H]) = full window
        (torch.float32, torch.float32, [3, 3]),  # empty window: every row of the out is zero
    ],
    ids=["fp32-range", "fp16-bf16probs", "bf16-norange", "empty-window"],
)
def test_unpermute_grad_matches_python(dtype, probs_dtype, rng):
    d = moe(dtype, probs_dtype)
    args = unpermute_grad_args(d, rng=rng)
    run_pair("MoeTokenUnpermuteWithEpGrad", *args)
    s, e = (0, N) if rng is None else rng
    ptg, pg = sparseops.moe_token_unpermute_with_ep_grad(
        d["grad"], d["sorted_indices"], d["ptokens_full"][: e - s], d["probs"], range=rng, topk_num=K
    )
    out, pg_out = args[8], args[9]
    assert same_bits(out[: e - s], ptg)
    assert same_bits(out[e - s :], torch.zeros(N - (e - s), H, dtype=dtype))  # zeros after R, not garbage
    assert same_bits(pg_out, pg)


def test_unpermute_grad_without_probs_and_doc_vector():
    d = moe()
    args = unpermute_grad_args(d, probs=False)
    args[2] = None  # permutedTokensOptional is only needed with probs
    run_pair("MoeTokenUnpermuteWithEpGrad", *args)
    ptg, pg = sparseops.moe_token_unpermute_with_ep_grad(d["grad"], d["sorted_indices"], range=RANGE, topk_num=K)
    assert pg is None
    assert same_bits(args[8][:R], ptg)
    # the doc test vector of docs/moe.md (unpermute grad)
    out, pg_out = empty_like_poisoned((3, 2), torch.float32), empty_like_poisoned((1, 3), torch.float32)
    run_pair(
        "MoeTokenUnpermuteWithEpGrad", torch.ones(1, 2), torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.ones(3, 2), torch.ones(1, 3), False, None, None, 1, out, pg_out,
    )
    assert torch.equal(out, torch.ones(3, 2)) and torch.equal(pg_out, torch.full((1, 3), 2.0))


@pytest.mark.parametrize("rng,num_out", [(RANGE, 0), (None, 0), (None, 7), (None, -3)], ids=["range", "all", "cap7", "drop3"])
def test_permute_matches_python(rng, num_out):
    d = moe(torch.bfloat16, torch.float16)
    pt, si, pp = sparseops.moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], range=rng, num_out_tokens=num_out)
    outs = [empty_like_poisoned(pt.shape, pt.dtype), empty_like_poisoned((N,), torch.int32), empty_like_poisoned(pp.shape, pp.dtype)]
    run_pair("MoeTokenPermuteWithEp", d["tokens"], d["indices"], d["probs"], rng, num_out, False, *outs)
    assert same_bits(outs[0], pt) and same_bits(outs[1], si) and same_bits(outs[2], pp)


def test_permute_doc_vector_without_probs():
    tokens = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    indices = torch.tensor([[1, 2], [3, 1], [2, 3]], dtype=torch.int64)  # CANN takes int64 expert ids here
    pt, si = empty_like_poisoned((4, 4), torch.float32), empty_like_poisoned((6,), torch.int32)
    run_pair("MoeTokenPermuteWithEp", tokens, indices, None, [1, 5], 0, False, pt, si, None)
    assert si.tolist() == [0, 2, 4, 1, 3, 5]
    assert torch.equal(pt, tokens[[1, 0, 2, 1]])


def test_unpermute_matches_python():
    d = moe()
    out = empty_like_poisoned((T, H), torch.float32)
    # permutedTokens may have more rows than R: the first R are read
    run_pair("MoeTokenUnpermuteWithEp", d["ptokens_full"], d["sorted_indices"], d["probs"], K, RANGE, False, None, out)
    ref = sparseops.moe_token_unpermute_with_ep(d["ptokens_full"][:R], d["sorted_indices"], d["probs"], K, range=RANGE)
    assert same_bits(out, ref)
    out2 = empty_like_poisoned((T, H), torch.float32)
    run_pair("MoeTokenUnpermuteWithEp", d["ptokens_full"], d["sorted_indices"], None, K, None, False, [T, H], out2)
    assert same_bits(out2, sparseops.moe_token_unpermute_with_ep(d["ptokens_full"], d["sorted_indices"], topk_num=K))


def test_permute_grad_matches_python_and_doc_vector():
    d = moe(torch.float16)
    ppg = torch.randn(N, dtype=torch.float64).to(torch.float16)
    tg, pg = empty_like_poisoned((T, H), torch.float16), empty_like_poisoned((T, K), torch.float16)
    run_pair("MoeTokenPermuteWithEpGrad", d["ptokens_full"], d["sorted_indices"], ppg, K, RANGE, False, tg, pg)
    ref_tg, ref_pg = sparseops.moe_token_permute_with_ep_grad(
        d["ptokens_full"][:R], d["sorted_indices"], ppg[:R], K, range=RANGE
    )
    assert same_bits(tg, ref_tg) and same_bits(pg, ref_pg)
    # the doc test vector of docs/moe.md (permute grad)
    tg, pg = empty_like_poisoned((3, 2), torch.float32), empty_like_poisoned((3, 2), torch.float32)
    run_pair(
        "MoeTokenPermuteWithEpGrad", torch.tensor([[2.0, 2], [1, 1], [3, 3], [2, 2]]),
        torch.tensor([2, 0, 4, 1, 5, 3], dtype=torch.int32), torch.tensor([0.2, 0.5, 0.4, 0.4]), 2, [1, 5], False, tg, pg,
    )
    assert torch.equal(tg, torch.tensor([[1.0, 1], [4, 4], [3, 3]]))
    assert torch.equal(pg, torch.tensor([[0.5, 0], [0.4, 0.2], [0, 0.4]]))


# NSA: two sequences (20 and 13 tokens: a partial last block), N1=4, N2=2 (G=2), bs=16, K=2


def nsa(dtype=torch.float32, causal=True):
    d = make_nsa_inputs([20, 13], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, dtype=dtype, causal=causal, seed=3)
    g = torch.Generator().manual_seed(11)
    d["dout"] = torch.randn(33, 4, 16, generator=g, dtype=torch.float64).to(dtype)
    return d


def nsa_fwd_args(d, *, mask=None, sparse_mode=2, layout="TND", outs=None):
    T1, N1 = d["query"].shape[:2]
    if outs is None:
        outs = [
            empty_like_poisoned((T1, N1, 8), torch.float32),
            empty_like_poisoned((T1, N1, 8), torch.float32),
            empty_like_poisoned((T1, N1, d["value"].shape[2]), d["query"].dtype),
        ]
    return [
        d["query"], d["key"], d["value"], d["topk_indices"], mask, d["actual_seq_qlen"], d["actual_seq_kvlen"],
        d["scale_value"], d["head_num"], layout, sparse_mode, d["selected_block_size"], d["selected_block_count"], *outs,
    ]


def nsa_python_fwd(d, sparse_mode):
    return sparseops.nsa_selected_attention(
        d["query"], d["key"], d["value"], d["topk_indices"], d["scale_value"], d["head_num"],
        d["selected_block_size"], d["selected_block_count"], actual_seq_qlen=d["actual_seq_qlen"],
        actual_seq_kvlen=d["actual_seq_kvlen"], sparse_mode=sparse_mode,
    )


def nsa_grad_args(d, fwd, *, sparse_mode=2, layout="TND", outs=None, mask=None):
    out, m, l = fwd
    if outs is None:
        outs = [empty_like_poisoned(d[k].shape, d[k].dtype) for k in ("query", "key", "value")]
    return [
        d["query"], d["key"], d["value"], out, d["dout"], m, l, d["topk_indices"], d["actual_seq_qlen"],
        d["actual_seq_kvlen"], mask, d["scale_value"], d["selected_block_size"], d["selected_block_count"],
        d["head_num"], layout, sparse_mode, *outs,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nsa_forward_matches_python_and_cann_mask_rule(dtype):
    d = nsa(dtype)
    mask = torch.ones(33, 33, dtype=torch.bool)
    # sparseMode=2 with a mask tensor: causal (values not read)
    args = nsa_fwd_args(d, mask=mask)
    run_pair("NsaSelectedAttention", *args)
    for got, ref in zip(args[13:16], (lambda o, m, l: (m, l, o))(*nsa_python_fwd(d, 2))):
        assert same_bits(got, ref)
    # sparseMode=2 without a mask tensor: CANN's forward does not mask
    args = nsa_fwd_args(d, mask=None)
    run_pair("NsaSelectedAttention", *args)
    out0, m0, l0 = nsa_python_fwd(d, 0)
    assert same_bits(args[15], out0) and same_bits(args[13], m0) and same_bits(args[14], l0)
    assert not same_bits(out0, nsa_python_fwd(d, 2)[0])  # the rule is visible on this input


@pytest.mark.parametrize("sparse_mode", [2, 0])
def test_nsa_grad_matches_python(sparse_mode):
    d = nsa(torch.float16, causal=sparse_mode == 2)
    fwd = nsa_python_fwd(d, sparse_mode)
    args = nsa_grad_args(d, fwd, sparse_mode=sparse_mode)  # no mask tensor: the grad masks on sparseMode alone
    run_pair("NsaSelectedAttentionGrad", *args)
    ref = sparseops.nsa_selected_attention_grad(
        d["query"], d["key"], d["value"], fwd[0], d["dout"], fwd[1], fwd[2], d["topk_indices"],
        scale_value=d["scale_value"], selected_block_size=16, selected_block_count=2, head_num=4,
        actual_seq_qlen=d["actual_seq_qlen"], actual_seq_kvlen=d["actual_seq_kvlen"], sparse_mode=sparse_mode,
    )
    for got, want in zip(args[17:20], ref):
        assert same_bits(got, want)


def test_determinism_switch():
    d = nsa(torch.bfloat16)
    fwd = nsa_python_fwd(d, 2)
    before = sparseops.is_deterministic()
    try:
        assert aclnn.aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1) == 0
        assert sparseops.is_deterministic() and aclnn.aclrtCtxGetSysParamOpt(ACL_OPT_DETERMINISTIC) == (0, 1)
        results = []
        for _ in range(2):
            args = nsa_grad_args(d, fwd)
            run_pair("NsaSelectedAttentionGrad", *args)
            results.append(args[17:20])
        for a, b in zip(*results):
            assert same_bits(a, b)
        assert aclnn.aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 0) == 0
        assert not sparseops.is_deterministic()
        assert aclnn.aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 2) == aclnn.ACL_ERROR_INVALID_PARAM
        assert aclnn.aclrtCtxSetSysParamOpt(1, 1) == aclnn.ACL_ERROR_INVALID_PARAM
        assert "ACL_OPT_DETERMINISTIC" in aclGetRecentErrMsg()
    finally:
        sparseops.set_deterministic(before)


def test_context_option_success_clears_the_error_text():
    """A successful Get or Set after a failed one leaves aclGetRecentErrMsg() None (docs/aclnn.md)."""
    before = sparseops.is_deterministic()
    try:
        for ok in (lambda: aclnn.aclrtCtxGetSysParamOpt(ACL_OPT_DETERMINISTIC)[0],
                   lambda: aclnn.aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, int(before))):
            assert aclnn.aclrtCtxSetSysParamOpt(99, 1) == aclnn.ACL_ERROR_INVALID_PARAM
            assert "opt" in aclGetRecentErrMsg()
            assert ok() == 0
            assert aclGetRecentErrMsg() is None
        assert aclnn.aclrtCtxGetSysParamOpt(99) == (aclnn.ACL_ERROR_INVALID_PARAM, 0)
        assert aclGetRecentErrMsg().startswith("aclrtCtxGetSysParamOpt: opt")
    finally:
        sparseops.set_deterministic(before)


# every status code from a real bad call; the message names the parameter; nothing is written


def _moe_bad(edit):
    def make():
        d = moe()
        args = unpermute_grad_args(d)
        edit(d, args)
        return "MoeTokenUnpermuteWithEpGrad", args, (8, 9)

    return make


def _set(i, v):
    return lambda d, a: a.__setitem__(i, v(d, a) if callable(v) else v)


BIG_K = 513


def _k_too_big():
    g = torch.ones(1, 2)
    si = torch.arange(BIG_K, dtype=torch.int32)
    out = empty_like_poisoned((BIG_K, 2), torch.float32)
    return "MoeTokenUnpermuteWithEpGrad", [g, si, None, None, False, None, None, BIG_K, out, None], (8,)


def _nsa_bad(edit, grad=False):
    def make():
        d = nsa()
        if grad:
            args = nsa_grad_args(d, nsa_python_fwd(d, 2))
            outs = (17, 18, 19)
        else:
            args = nsa_fwd_args(d, mask=torch.ones(33, 33, dtype=torch.bool))
            outs = (13, 14, 15)
        edit(d, args)
        return ("NsaSelectedAttentionGrad" if grad else "NsaSelectedAttention"), args, outs

    return make


BAD_CALLS = [
    # (id, builder, status, words the message must contain)
    ("null-grad", _moe_bad(_set(0, None)), ACLNN_ERR_PARAM_NULLPTR, ["unpermutedTokensGrad"]),
    ("null-out", _moe_bad(_set(8, None)), ACLNN_ERR_PARAM_NULLPTR, ["permutedTokensGradOut"]),
    ("null-probs-grad-out", _moe_bad(_set(9, None)), ACLNN_ERR_PARAM_NULLPTR, ["probsGradOut"]),
    ("probs-without-permuted", _moe_bad(_set(2, None)), ACLNN_ERR_PARAM_NULLPTR, ["permutedTokensOptional"]),
    ("float64-grad", _moe_bad(_set(0, lambda d, a: a[0].double())), ACLNN_ERR_PARAM_INVALID, ["unpermutedTokensGrad", "float64"]),
    ("float64-probs", _moe_bad(_set(3, lambda d, a: a[3].double())), ACLNN_ERR_PARAM_INVALID, ["probsOptional", "float64"]),
    ("int64-sorted-indices", _moe_bad(_set(1, lambda d, a: a[1].long())), ACLNN_ERR_PARAM_INVALID, ["sortedIndices", "int64"]),
    ("float64-out", _moe_bad(_set(8, lambda d, a: torch.zeros(N, H, dtype=torch.float64))), ACLNN_ERR_PARAM_INVALID, ["permutedTokensGradOut"]),
    ("padded-mode", _moe_bad(_set(4, True)), ACLNN_ERR_INNER_TILING_ERROR, ["paddedMode"]),
    ("range-end-before-start", _moe_bad(_set(6, [6, 2])), ACLNN_ERR_INNER_TILING_ERROR, ["rangeOptional"]),
    ("range-three-values", _moe_bad(_set(6, [0, 2, 4])), ACLNN_ERR_INNER_TILING_ERROR, ["rangeOptional"]),
    ("sorted-indices-repeated-row", _moe_bad(_set(1, lambda d, a: torch.cat([a[1][:1], a[1][:-1]]))), ACLNN_ERR_INNER_TILING_ERROR, ["sortedIndices", "permutation"]),
    ("sorted-indices-out-of-range", _moe_bad(_set(1, lambda d, a: a[1] + 1)), ACLNN_ERR_INNER_TILING_ERROR, ["sortedIndices"]),
    ("k-over-512", _k_too_big, ACLNN_ERR_INNER_TILING_ERROR, ["topkNum"]),
    ("sorted-indices-wrong-length", _moe_bad(_set(1, lambda d, a: a[1][:-1])), ACLNN_ERR_INNER_TILING_ERROR, ["sortedIndices"]),
    ("permuted-too-few-rows", _moe_bad(_set(2, lambda d, a: a[2][:3])), ACLNN_ERR_INNER_TILING_ERROR, ["permutedTokensOptional"]),
    ("out-wrong-shape", _moe_bad(_set(8, lambda d, a: empty_like_poisoned((R, H), torch.float32))), ACLNN_ERR_INNER_TILING_ERROR, ["permutedTokensGradOut", f"[{N}, {H}]"]),
    ("out-broadcast-view", _moe_bad(_set(8, lambda d, a: torch.zeros(1, H).expand(N, H))), ACLNN_ERR_PARAM_INVALID, ["permutedTokensGradOut", "overlap"]),
    ("out-sparse", _moe_bad(_set(8, lambda d, a: torch.zeros(N, H).to_sparse())), ACLNN_ERR_PARAM_INVALID, ["permutedTokensGradOut", "dense", "sparse_coo"]),  # was "a broadcast view with strides (0, 0)"
    ("grad-sparse", _moe_bad(_set(0, lambda d, a: a[0].to_sparse())), ACLNN_ERR_PARAM_INVALID, ["unpermutedTokensGrad", "dense", "sparse_coo"]),
    ("out-wrong-dtype", _moe_bad(_set(9, lambda d, a: empty_like_poisoned((T, K), torch.float16))), ACLNN_ERR_INNER_TILING_ERROR, ["probsGradOut", "float16"]),
    ("outs-overlap", _moe_bad(_set(9, lambda d, a: a[8].view(-1)[: T * K].view(T, K))), ACLNN_ERR_PARAM_INVALID, ["probsGradOut", "overlaps", "permutedTokensGradOut"]),
    ("nsa-stats-outs-same-tensor", _nsa_bad(_set(14, lambda d, a: a[13])), ACLNN_ERR_PARAM_INVALID, ["softmaxSumOut", "overlaps"]),
    ("nsa-null-query", _nsa_bad(_set(0, None)), ACLNN_ERR_PARAM_NULLPTR, ["query"]),
    ("nsa-null-out", _nsa_bad(_set(15, None)), ACLNN_ERR_PARAM_NULLPTR, ["attentionOut"]),
    ("nsa-float64-key", _nsa_bad(_set(1, lambda d, a: a[1].double())), ACLNN_ERR_PARAM_INVALID, ["key", "float64"]),
    ("nsa-key-dtype-differs", _nsa_bad(_set(1, lambda d, a: a[1].half())), ACLNN_ERR_PARAM_INVALID, ["key", "float16"]),
    ("nsa-int64-topk", _nsa_bad(_set(3, lambda d, a: a[3].long())), ACLNN_ERR_PARAM_INVALID, ["topkIndices", "int64"]),
    ("nsa-bad-layout", _nsa_bad(_set(9, "BSND")), ACLNN_ERR_PARAM_INVALID, ["inputLayout", "BSND"]),
    ("nsa-block-id-out-of-range", _nsa_bad(_set(3, lambda d, a: a[3].clone().fill_(5))), ACLNN_ERR_INNER_TILING_ERROR, ["topkIndices"]),
    ("nsa-bad-sparse-mode", _nsa_bad(_set(10, 1)), ACLNN_ERR_INNER_TILING_ERROR, ["sparseMode"]),
    ("nsa-bad-block-size", _nsa_bad(_set(11, 24)), ACLNN_ERR_INNER_TILING_ERROR, ["selectedBlockSize"]),
    ("nsa-bad-head-num", _nsa_bad(_set(8, 3)), ACLNN_ERR_INNER_TILING_ERROR, ["headNum"]),
    ("nsa-stats-out-wrong-shape", _nsa_bad(_set(13, lambda d, a: empty_like_poisoned((33, 4, 1), torch.float32))), ACLNN_ERR_INNER_TILING_ERROR, ["softmaxMaxOut"]),
    ("nsa-grad-null-dout", _nsa_bad(_set(4, None), grad=True), ACLNN_ERR_PARAM_NULLPTR, ["attentionOutGrad"]),
    ("nsa-grad-bad-layout", _nsa_bad(_set(15, "BNSD"), grad=True), ACLNN_ERR_PARAM_INVALID, ["inputLayout"]),
    ("nsa-grad-fp16-stats", _nsa_bad(_set(5, lambda d, a: a[5].half()), grad=True), ACLNN_ERR_PARAM_INVALID, ["softmaxMax"]),
    ("nsa-grad-bad-sparse-mode", _nsa_bad(_set(16, 3), grad=True), ACLNN_ERR_INNER_TILING_ERROR, ["sparseMode"]),
    ("nsa-grad-bad-block-size", _nsa_bad(_set(12, 12), grad=True), ACLNN_ERR_INNER_TILING_ERROR, ["selectedBlockSize"]),
    ("nsa-grad-dk-wrong-shape", _nsa_bad(_set(18, lambda d, a: empty_like_poisoned((33, 4, 32), torch.float32)), grad=True), ACLNN_ERR_INNER_TILING_ERROR, ["dkOut"]),
]


@pytest.mark.parametrize("make,status,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_call_status_message_and_no_write(make, status, words):
    name, args, out_pos = make()
    before = {i: args[i].clone() for i in out_pos if isinstance(args[i], torch.Tensor)}
    got, ws, ex = phase1(name, *args)
    msg = aclGetRecentErrMsg()
    assert got == status, msg
    assert ex is None and ws == 0
    assert msg is not None and f"aclnn{name}" in msg
    for w in words:
        assert w in msg, msg
    assert not re.search(r"\b(\w+): \1:", msg), msg  # the argument is named once (never "key: key: ...")
    for i, t in before.items():
        assert same_bits(args[i], t), f"out argument {i} was written by a failed call"


def test_runtime_failure_is_a_status(monkeypatch):
    # a failure while computing (simulated: the op raises RuntimeError) is 361001, nothing written
    def failing(*args, **kwargs):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(sparseops.moe.api, "moe_token_unpermute_with_ep_grad", failing)
    args = unpermute_grad_args(moe())
    before = args[8].clone()
    status, ws, ex = phase1("MoeTokenUnpermuteWithEpGrad", *args)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(torch.empty(ws, dtype=torch.uint8), ws, ex, None) == aclnn.ACLNN_ERR_RUNTIME_ERROR
    assert "out of memory" in aclGetRecentErrMsg()
    assert same_bits(args[8], before)


# executor and workspace semantics


def test_executor_runs_once_and_rejects_foreign_objects():
    d = moe()
    status, ws, ex = phase1("MoeTokenUnpermuteWithEpGrad", *unpermute_grad_args(d))
    assert status == ACLNN_SUCCESS and ws > 0
    wsp = torch.empty(ws, dtype=torch.uint8)
    # foreign objects and the wrong API are refused without using the executor up
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(wsp, ws, object(), None) == ACLNN_ERR_PARAM_INVALID
    assert "executor" in aclGetRecentErrMsg()
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(wsp, ws, None, None) == ACLNN_ERR_PARAM_NULLPTR
    assert aclnn.aclnnMoeTokenPermuteWithEpGrad(wsp, ws, ex, None) == ACLNN_ERR_PARAM_INVALID
    assert "aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize" in aclGetRecentErrMsg()
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(wsp, ws, ex, None) == ACLNN_SUCCESS
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(wsp, ws, ex, None) == ACLNN_ERR_PARAM_INVALID
    assert "already run" in aclGetRecentErrMsg()


def test_out_changed_between_the_phases_writes_nothing():
    # an out tensor resized after phase 1: phase 2 refuses before computing, so no out is half-written
    d = nsa(torch.float16)
    args = nsa_fwd_args(d, mask=None)
    status, ws, ex = phase1("NsaSelectedAttention", *args)
    assert status == ACLNN_SUCCESS
    snap = [t.clone() for t in args[13:16]]
    args[14].resize_(3)  # softmaxSumOut
    assert aclnn.aclnnNsaSelectedAttention(torch.empty(ws, dtype=torch.uint8), ws, ex, None) == ACLNN_ERR_INNER_TILING_ERROR
    assert "softmaxSumOut" in aclGetRecentErrMsg() and "phase 1" in aclGetRecentErrMsg()
    assert same_bits(args[13], snap[0]) and same_bits(args[15], snap[2])


def test_workspace_too_small():
    d = moe()
    args = unpermute_grad_args(d)
    before = [args[8].clone(), args[9].clone()]
    status, ws, ex = phase1("MoeTokenUnpermuteWithEpGrad", *args)
    assert status == ACLNN_SUCCESS
    assert ws == R * H * 4 + T * K * 4  # the two temporary results, fp32
    run = aclnn.aclnnMoeTokenUnpermuteWithEpGrad
    assert run(torch.empty(ws - 1, dtype=torch.uint8), ws, ex, None) == ACLNN_ERR_PARAM_INVALID
    assert "workspace" in aclGetRecentErrMsg()
    assert run(torch.empty(ws, dtype=torch.uint8), ws - 1, ex, None) == ACLNN_ERR_PARAM_INVALID
    assert "workspaceSize" in aclGetRecentErrMsg()
    assert run(None, ws, ex, None) == ACLNN_ERR_PARAM_NULLPTR
    assert run(torch.empty(ws, dtype=torch.float32), ws, ex, None) == ACLNN_ERR_PARAM_INVALID
    assert same_bits(args[8], before[0]) and same_bits(args[9], before[1])
    # a refused workspace does not use the executor up
    assert run(torch.empty(ws, dtype=torch.uint8), ws, ex, None) == ACLNN_SUCCESS


def test_zero_workspace_accepts_none():
    # an empty EP window on a rank with no probs: nothing temporary is non-empty
    d = moe()
    out = empty_like_poisoned((N, H), torch.float32)
    status, ws, ex = phase1("MoeTokenUnpermuteWithEpGrad", d["grad"], d["sorted_indices"], None, None, False, None, [4, 4], K, out, None)
    assert status == ACLNN_SUCCESS and ws == 0
    assert aclnn.aclnnMoeTokenUnpermuteWithEpGrad(None, 0, ex, None) == ACLNN_SUCCESS
    assert torch.equal(out, torch.zeros(N, H))


def test_never_raises_on_garbage():
    assert phase1("MoeTokenUnpermuteWithEpGrad", *(["x"] * 10))[0] == ACLNN_ERR_PARAM_INVALID
    assert phase1("NsaSelectedAttentionGrad", *([None] * 20))[0] == ACLNN_ERR_PARAM_NULLPTR
    assert aclnn.aclnnNsaSelectedAttention("x", "y", "z", None) == ACLNN_ERR_PARAM_INVALID


def test_each_operator_keeps_cann_names_and_parameter_order():
    """The generic phase-1 / phase-2 wrappers keep CANN's function names and parameter names, in order."""
    import inspect

    for name in [n for n in aclnn.__all__ if n.startswith("aclnn") and not n.endswith("GetWorkspaceSize")]:
        run = getattr(aclnn, name)
        assert run.__name__ == name and run.__doc__.startswith("Phase 2 of")
        assert list(inspect.signature(run).parameters) == ["workspace", "workspaceSize", "executor", "stream"]
        first = getattr(aclnn, name + "GetWorkspaceSize")
        assert first.__name__ == name + "GetWorkspaceSize" and first.__doc__.startswith("Phase 1 of")
    params = list(inspect.signature(aclnn.aclnnMoeTokenUnpermuteWithEpGetWorkspaceSize).parameters)
    assert params == ["permutedTokens", "sortedIndices", "probsOptional", "numTopk", "rangeOptional", "paddedMode",
                      "restoreShapeOptional", "out"]
