"""The token-granularity torch path (``selected_block_size`` 1, 2, 4, 8; docs/nsa.md "Token granularity") against
the float64 reference: output, stats and every gradient, every dtype, varlen, -1 slots, duplicates, G up to 128,
K up to 2048; bitwise-repeatable backward; bounded chunks; the widened limits and what stays an error."""

import pytest
import torch

import sparseops
from sparseops._varlen import normalize_cu_seqlens
from sparseops.nsa import reference, torch_gather, torch_plan
from sparseops.testing import assert_close, make_nsa_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

CASES = [
    # id; seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, bs, K, causal, empty_frac, duplicates
    ("bs1-varlen-len0", [9, 0, 23], [11, 2, 23], 4, 2, 16, 8, 1, 7, True, 0.2, True),
    ("bs2-noncausal", [13, 6], [20, 6], 2, 1, 24, 24, 2, 5, False, 0.3, True),
    ("bs4-S2-not-multiple", [19], [19], 6, 3, 16, 12, 4, 3, True, 0.0, False),
    ("bs8-kv-longer", [5, 7], [30, 17], 3, 1, 8, 8, 8, 2, True, 0.1, True),
    ("mqa-G128", [6], None, 128, 1, 8, 8, 1, 4, True, 0.0, False),
]


@pytest.fixture(autouse=True)
def _torch_ops(override):
    """These tests check the torch ops; the C++ CPU kernels have their own (test_cpu_gather.py)."""
    override(torch_plan.SETTINGS, cpu_kernels=False)


def _inputs(case, dtype, seed=0):
    _, sq, skv, N1, N2, Dqk, Dv, bs, K, causal, ef, dup = case
    return make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=dtype, causal=causal,
                           empty_frac=ef, duplicates=dup, seed=seed)


def _split(a):
    a = dict(a)
    return a.pop("query"), a.pop("key"), a.pop("value"), a


def _ref(a, dout):
    q, k, v = (a[n].double() for n in ("query", "key", "value"))
    cu_q = normalize_cu_seqlens("q", a["actual_seq_qlen"], q.shape[0])
    cu_kv = normalize_cu_seqlens("kv", a["actual_seq_kvlen"], k.shape[0])
    args = (a["topk_indices"], a["scale_value"], a["selected_block_size"], cu_q, cu_kv, a["sparse_mode"] == 2)
    out, m, l = reference.forward(q, k, v, *args)
    return (out, m, l, *reference.backward(q, k, v, out, dout.double(), m, l, *args))


def _run(a, dtype, backend="torch"):
    q, k, v, kw = _split(a)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend=backend, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    out.backward(dout)
    return out, m, l, q.grad, k.grad, v.grad, dout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gather_matches_reference(case, dtype):
    a = _inputs(case, dtype)
    out, m, l, dq, dk, dv, dout = _run(a, dtype)
    expected = _ref(a, dout)
    for name, got, exp in zip(("out", "m", "l", "dq", "dk", "dv"), (out, m[..., 0], l[..., 0], dq, dk, dv), expected):
        assert_close(got, exp, dtype, name=name)


def test_k2048_one_query_sees_every_key_once():
    """K = 2048 single-token slots, the largest count: a causal query at position 2047 sees the whole prefix."""
    T, K = 2048, 2048
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(T, 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(T, 1, 4, generator=g, dtype=torch.float64)
    perm = torch.stack([torch.randperm(K, generator=g) for _ in range(4)])
    topk = torch.full((T, 1, K), -1, dtype=torch.int32)
    rows = torch.tensor([0, 700, 1500, 2047])
    topk[rows, 0] = perm.to(torch.int32)
    out, _, _ = sparseops.nsa_selected_attention(q, k, v, topk, 0.3, 2, 1, K, sparse_mode=2, backend="torch")
    for t in rows.tolist():
        w = torch.softmax(0.3 * q[t] @ k[: t + 1, 0].T, dim=-1)
        assert_close(out[t], w @ v[: t + 1, 0], torch.float64)
    assert out[1].abs().max() == 0  # no slot: zero output


def test_small_chunks_same_result(monkeypatch):
    """Many chunks (one token each, each dropping its own dead tail of gathered keys) give the result of one."""
    a = _inputs(CASES[0], torch.float64)
    one = _run(a, torch.float64)
    monkeypatch.setattr(torch_gather, "CHUNK_BYTES", 1)
    many = _run(a, torch.float64)
    for x, y in zip(one[:6], many[:6]):
        assert_close(y, x, torch.float64)


def test_backward_bitwise_repeatable():
    a = _inputs(CASES[3], torch.float32, seed=3)
    r1, r2 = _run(a, torch.float32), _run(a, torch.float32)
    for x, y in zip(r1[3:6], r2[3:6]):
        assert torch.equal(x, y)


def test_grad_op_matches_autograd():
    a = _inputs(CASES[1], torch.float32)
    out, m, l, dq, dk, dv, dout = _run(a, torch.float32)
    q, k, v, kw = _split(a)
    g = sparseops.nsa_selected_attention_grad(
        q, k, v, out.detach(), dout, m, l, kw["topk_indices"], scale_value=kw["scale_value"],
        selected_block_size=kw["selected_block_size"], selected_block_count=kw["selected_block_count"],
        head_num=kw["head_num"], actual_seq_qlen=kw["actual_seq_qlen"], actual_seq_kvlen=kw["actual_seq_kvlen"],
        sparse_mode=kw["sparse_mode"], backend="torch")
    for x, y in zip(g, (dq, dk, dv)):
        assert torch.equal(x, y)


def test_reference_and_auto_backends_agree():
    a = _inputs(CASES[0], torch.float64)
    r = _run(a, torch.float64, backend="reference")
    t = _run(a, torch.float64, backend="auto")
    for x, y in zip(r[:6], t[:6]):
        assert_close(y, x, torch.float64)


@pytest.mark.parametrize("bs, K, N1, msg", [
    (3, 4, 2, "selected_block_size"),
    (12, 4, 2, "selected_block_size"),
    (1, 2049, 2, "selected_block_count"),
    (8, 1025, 2, "selected_block_count"),
    (16, 129, 2, "selected_block_count"),
    (1, 4, 129, "G = N1 / N2"),
    (16, 4, 33, "G = N1 / N2"),
])
def test_limits(bs, K, N1, msg):
    q = torch.randn(4, N1, 8)
    k = torch.randn(4, 1, 8)
    topk = torch.zeros(4, 1, K, dtype=torch.int32)
    with pytest.raises(ValueError, match=msg):
        sparseops.nsa_selected_attention(q, k, k, topk, 1.0, N1, bs, K, backend="torch")


def test_ids_outside_the_sequence_rejected():
    q = torch.randn(4, 2, 8)
    k = torch.randn(4, 1, 8)
    topk = torch.tensor([[[0, 4]]] * 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_indices"):
        sparseops.nsa_selected_attention(q, k, k, topk, 1.0, 2, 1, 2)


def test_cann_two_phase_api_at_token_granularity():
    """aclnnNsaSelectedAttention(Grad) with bs = 1, K = 6 and G = 8 write what the Python ops return."""
    from sparseops import aclnn

    d = make_nsa_inputs([9, 14], N1=8, N2=1, Dqk=16, Dv=8, bs=1, K=6, seed=5)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(23, 8, 8, generator=g)
    out, m, l = (torch.empty(23, 8, 8), torch.empty(23, 8, 8), torch.empty(23, 8, 8))
    mask = torch.ones(23, 23, dtype=torch.bool)  # CANN's forward masks causally only with a mask tensor
    args = [d["query"], d["key"], d["value"], d["topk_indices"], mask, d["actual_seq_qlen"], d["actual_seq_kvlen"],
            d["scale_value"], 8, "TND", 2, 1, 6, m, l, out]
    status, ws, ex = aclnn.aclnnNsaSelectedAttentionGetWorkspaceSize(*args)
    assert status == 0
    assert aclnn.aclnnNsaSelectedAttention(torch.empty(ws, dtype=torch.uint8), ws, ex, None) == 0
    q, k, v, kw = _split(d)
    want = sparseops.nsa_selected_attention(q, k, v, **kw)
    for got, exp in zip((out, m, l), want):
        assert torch.equal(got, exp)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    gargs = [q, k, v, out, dout, m, l, d["topk_indices"], d["actual_seq_qlen"], d["actual_seq_kvlen"], None,
             d["scale_value"], 1, 6, 8, "TND", 2, dq, dk, dv]
    status, ws, ex = aclnn.aclnnNsaSelectedAttentionGradGetWorkspaceSize(*gargs)
    assert status == 0
    assert aclnn.aclnnNsaSelectedAttentionGrad(torch.empty(ws, dtype=torch.uint8), ws, ex, None) == 0
    wq, wk, wv = sparseops.nsa_selected_attention_grad(
        q, k, v, out, dout, m, l, d["topk_indices"], scale_value=d["scale_value"], selected_block_size=1,
        selected_block_count=6, head_num=8, actual_seq_qlen=d["actual_seq_qlen"],
        actual_seq_kvlen=d["actual_seq_kvlen"], sparse_mode=2)
    for got, exp in zip((dq, dk, dv), (wq, wk, wv)):
        assert torch.equal(got, exp)


def test_non_contiguous_inputs():
    a = _inputs(CASES[2], torch.float64)
    want = _run(a, torch.float64)
    b = dict(a)
    for n in ("query", "key", "value"):
        b[n] = a[n].transpose(0, 1).contiguous().transpose(0, 1)  # same values, token stride 1
    b["topk_indices"] = a["topk_indices"].transpose(0, 1).contiguous().transpose(0, 1)
    got = _run(b, torch.float64)
    for x, y in zip(want[:6], got[:6]):
        assert torch.equal(x, y)
