"""The torch backend against the reference (float64 on upcast inputs): output, stats and all three gradients,
every dtype, odd shapes; the seed op against autograd; the stat lanes; determinism."""

import pytest
import torch

import sparseops
from sparseops._varlen import normalize_cu_seqlens
from sparseops.nsa import reference, torch_impl, torch_jobs, torch_plan
from sparseops.testing import assert_close, make_nsa_inputs, make_topk_indices, poison_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

CASES = [
    # id: what edge it covers; seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, bs, K, causal, empty_frac, duplicates
    ("varlen-len0-S2-not-multiple", [5, 0, 40, 33], [7, 3, 40, 50], 6, 2, 32, 16, 16, 3, True, 0.2, True),
    ("G1-noncausal-dups", [17, 30], [17, 64], 2, 2, 16, 16, 16, 4, False, 0.3, True),
    ("G2-bs32-kv-longer", [20, 9], [70, 41], 4, 2, 24, 8, 32, 2, True, 0.0, False),
    ("G16-one-kv-head", [32], None, 16, 1, 32, 16, 16, 3, True, 0.1, True),
    ("head-dim-256", [24], None, 2, 1, 256, 128, 16, 2, True, 0.0, False),
    ("T1-one-token", [1], [33], 3, 1, 16, 16, 16, 2, False, 0.0, False),
    # sequences of 0-3 tokens packed several to a block row of the buffer (each sees only its own keys), and tiny
    # sequences packed into the last row of long ones
    ("tiny-seqs-packed", [1, 2, 3, 0, 1, 3, 2, 2, 1, 3, 0, 2], None, 4, 2, 16, 8, 16, 2, True, 0.0, False),
    ("long-and-tiny-mixed", [1, 2, 3, 20, 2, 0, 1, 18, 3, 2], None, 6, 2, 16, 8, 16, 3, True, 0.2, True),
    ("tiny-noncausal-kv-longer", [1, 3, 2, 1, 2], [3, 1, 2, 5, 2], 4, 2, 16, 8, 16, 2, False, 0.0, True),
]


@pytest.fixture(autouse=True)
def _torch_ops(override):
    """These tests check the torch ops; the C++ CPU kernels have their own (test_cpu_gather.py)."""
    override(torch_plan.SETTINGS, cpu_kernels=False)


def _case_inputs(case, dtype, seed=0):
    _, sq, skv, N1, N2, Dqk, Dv, bs, K, causal, ef, dup = case
    return make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=dtype, causal=causal,
                           empty_frac=ef, duplicates=dup, seed=seed)


def _ref(a, dout):
    """float64 reference on the upcast inputs: (out, m, l, dq, dk, dv)."""
    q, k, v = (a[n].double() for n in ("query", "key", "value"))
    cu_q = normalize_cu_seqlens("q", a["actual_seq_qlen"], q.shape[0])
    cu_kv = normalize_cu_seqlens("kv", a["actual_seq_kvlen"], k.shape[0])
    args = (a["topk_indices"], a["scale_value"], a["selected_block_size"], cu_q, cu_kv, a["sparse_mode"] == 2)
    out, m, l = reference.forward(q, k, v, *args)
    return (out, m, l, *reference.backward(q, k, v, out, dout.double(), m, l, *args))


def _split(a):
    a = dict(a)
    return a.pop("query"), a.pop("key"), a.pop("value"), a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_matches_reference(case, dtype):
    a = _case_inputs(case, dtype)
    q, k, v, kw = _split(a)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    out.backward(dout)
    r_out, r_m, r_l, r_dq, r_dk, r_dv = _ref(a, dout)
    assert out.dtype == dtype and m.dtype == torch.float32 and l.dtype == torch.float32
    assert_close(out, r_out, dtype, name="attention_out")
    assert_close(m[..., 0], r_m, dtype, name="softmax_max")
    assert_close(l[..., 0], r_l, dtype, name="softmax_sum")
    assert_close(q.grad, r_dq, dtype, name="dq")
    assert_close(k.grad, r_dk, dtype, name="dk")
    assert_close(v.grad, r_dv, dtype, name="dv")
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (dtype,) * 3


def test_float64_inputs_give_float64_stats():
    a = _case_inputs(CASES[0], torch.float64)
    q, k, v, kw = _split(a)
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    r_out, r_m, r_l, *_ = _ref(a, torch.zeros_like(out))
    assert m.dtype == l.dtype == torch.float64
    assert_close(out, r_out, name="attention_out")
    assert_close(l[..., 0], r_l, name="softmax_sum")


def test_stat_lanes_equal_and_not_differentiable():
    q, k, v, kw = _split(_case_inputs(CASES[0], torch.float32))
    q.requires_grad_()
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    assert m.shape == l.shape == (q.shape[0], q.shape[1], 8)
    assert torch.equal(m, m[..., :1].expand_as(m)) and torch.equal(l, l[..., :1].expand_as(l))
    assert out.requires_grad and not m.requires_grad and not l.requires_grad


def test_rows_with_no_visible_key():
    # token 0: only -1; token 1 (causal, position 1): only block 1, which starts after it; token 2: block 0
    q = torch.randn(3, 2, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(40, 1, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(40, 1, 16, dtype=torch.float64, requires_grad=True)
    topk = torch.tensor([[[-1, -1]], [[1, -1]], [[0, -1]]], dtype=torch.int32)
    out, m, l = sparseops.nsa_selected_attention(q, k, v, topk, 0.25, 2, 16, 2, sparse_mode=2,
                                                 actual_seq_qlen=[3], actual_seq_kvlen=[40])
    out.sum().backward()
    for t in (q.grad, k.grad, v.grad, out, m, l):
        assert torch.isfinite(t).all()
    assert out[:2].eq(0).all() and m[:2].eq(0).all() and l[:2].eq(0).all()
    assert q.grad[:2].eq(0).all()
    assert out[2].ne(0).any()
    # token 2 sees keys 0..2 only (causal): every other key row gets exactly 0 gradient
    assert k.grad[3:].eq(0).all() and v.grad[3:].eq(0).all() and v.grad[:3].ne(0).any()


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_seed_op_equals_autograd(backend):
    a = _case_inputs(CASES[0], torch.float32)
    q, k, v, kw = _split(a)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend=backend, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    kw = {n: kw[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                             "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    qd, kd, vd = (t.detach() for t in (q, k, v))
    snap = [t.clone() for t in (qd, kd, vd, out, dout, m, l)]
    dq, dk, dv = sparseops.nsa_selected_attention_grad(
        qd, kd, vd, out.detach(), dout, m, l, a["topk_indices"], backend=backend, **kw
    )
    assert torch.equal(dq, q.grad) and torch.equal(dk, k.grad) and torch.equal(dv, v.grad)
    # the seed op writes into nothing it was given
    for before, after in zip(snap, (qd, kd, vd, out, dout, m, l)):
        assert torch.equal(before, after)


def test_seed_op_reads_lane_zero_only():
    a = _case_inputs(CASES[3], torch.float32)
    q, k, v, kw = _split(a)
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    gkw = {n: kw[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                              "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    ref = sparseops.nsa_selected_attention_grad(q, k, v, out, dout, m, l, a["topk_indices"], **gkw)
    m2, l2 = m.clone(), l.clone()
    poison_(m2[..., 1:])
    poison_(l2[..., 1:])
    got = sparseops.nsa_selected_attention_grad(q, k, v, out, dout, m2, l2, a["topk_indices"], **gkw)
    for x, y in zip(got, ref):
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", [CASES[3], CASES[7]], ids=[CASES[3][0], CASES[7][0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_is_bitwise_reproducible(dtype, case):
    # G16 with duplicates: many (token, slot) pairs add into the same key rows; tiny sequences packed into
    # shared block rows: the slots of several sequences add into one row
    a = _case_inputs(case, dtype, seed=5)
    q, k, v, kw = _split(a)
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    dout = torch.randn(out.shape).to(dtype)
    gkw = {n: kw[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                              "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    runs = [
        sparseops.nsa_selected_attention_grad(q, k, v, out, dout, m, l, a["topk_indices"], deterministic=True, **gkw)
        for _ in range(2)
    ]
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def test_deterministic_none_follows_the_switches(monkeypatch):
    seen = []
    real = torch_impl.backward

    def spy(*args, deterministic=False, **kw):  # the dispatcher passes every argument by keyword
        seen.append(deterministic)
        return real(*args, deterministic=deterministic, **kw)

    monkeypatch.setattr(torch_impl, "backward", spy)
    a = _case_inputs(CASES[5], torch.float32)
    q, k, v, kw = _split(a)
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    gkw = {n: kw[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                              "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    call = lambda **d: sparseops.nsa_selected_attention_grad(q, k, v, out, out, m, l, a["topk_indices"], **gkw, **d)  # noqa: E731
    call()
    sparseops.set_deterministic(True)
    try:
        call()
        call(deterministic=False)
    finally:
        sparseops.set_deterministic(False)
    assert seen == [False, True, False]


def test_meta_tensors_give_shapes():
    # shape inference: the block-id check reads data, which meta tensors do not have, so it is skipped
    m = {"device": "meta"}
    q, k, v = torch.empty(32, 4, 16, **m), torch.empty(40, 2, 16, **m), torch.empty(40, 2, 8, **m)
    topk = torch.empty(32, 2, 2, dtype=torch.int32, **m)
    out, sm, ss = sparseops.nsa_selected_attention(q, k, v, topk, 0.25, 4, 16, 2, actual_seq_qlen=[32],
                                                   actual_seq_kvlen=[40], backend="torch")
    assert (out.shape, sm.shape, out.device.type) == ((32, 4, 8), (32, 4, 8), "meta")
    dq, dk, dv = sparseops.nsa_selected_attention_grad(q, k, v, out, out, sm, ss, topk, scale_value=0.25,
                                                       selected_block_size=16, selected_block_count=2, head_num=4,
                                                       backend="torch")
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_int64_topk_and_tensor_cu_seqlens():
    a = _case_inputs(CASES[0], torch.float32)
    q, k, v, kw = _split(a)
    ref = sparseops.nsa_selected_attention(q, k, v, **kw)
    kw["topk_indices"] = kw["topk_indices"].long()
    kw["actual_seq_qlen"] = torch.tensor(kw["actual_seq_qlen"])
    kw["actual_seq_kvlen"] = torch.tensor(kw["actual_seq_kvlen"], dtype=torch.int32)
    got = sparseops.nsa_selected_attention(q, k, v, **kw)
    for x, y in zip(got, ref):
        assert torch.equal(x, y)


def _autograd_matches_reference(a, seed):
    """The torch backend's forward and autograd backward on float64 inputs ``a`` against the reference;
    returns ``(out, m, l, dout, reference results)``."""
    q, k, v, kw = _split(a)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out.backward(dout)
    ref = _ref(a, dout)
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"),
                          (out, m[..., 0], l[..., 0], q.grad, k.grad, v.grad), ref):
        assert_close(x, y, name=name)
    return out.detach(), m, l, dout, ref


def _force_layout(override, layout):
    """Make the torch backend take one layout wherever it can: "span", "union" (gathered), "tiles" (per chunk),
    "global" (global tiles); "default": its own choice."""
    if layout in ("tiles", "global"):
        share = float("inf") if layout == "global" else 0.0
        override(torch_plan.SETTINGS, union_waste=0.0, global_fwd_share=share, global_bwd_share=share)
    elif layout != "default":
        override(torch_plan.SETTINGS, union_waste=float("inf"), span=layout == "span", span_slack=float("inf"))


@pytest.fixture
def layouts(monkeypatch):
    """The set of layouts the torch backend's plans took in this test: "span", "union" (gathered), "tiles",
    "global" (global tiles)."""
    seen, real = set(), torch_plan.Plan.jobs

    def jobs(self, *args):
        for t0, t1, job in real(self, *args):
            seen.add("span" if job.layout == "union" and job.span else job.layout)
            yield t0, t1, job

    monkeypatch.setattr(torch_plan.Plan, "jobs", jobs)
    return seen


@pytest.mark.parametrize("layout", ["span", "union", "tile1", "tile3", "tile64", "global1", "global3"])
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 3, 6, 7)], ids=[CASES[i][0] for i in (0, 1, 3, 6, 7)])
def test_every_layout_matches_reference(case, layout, override, layouts):
    # the torch backend picks per chunk a union layout (its blocks as one span of the block buffer, a view, or
    # gathered) or a block-centric one whose tiles hold M slots of one block (M picked per chunk, or over all
    # tile chunks at once: global tiles, run in batches); force a span wherever a chunk holds one sequence
    # (small chunks: most do), a gathered union, or tiles with M = 1 (no padding), an odd M (padding rows in
    # most tiles) and M = 64 (one tile per block, mostly padding), or global tiles of 1 and 3 slots in batches
    # of a few tiles
    kind = layout.rstrip("0123456789")
    _force_layout(override, "tiles" if kind == "tile" else kind)
    if kind in ("span", "union"):
        override(torch_plan.SETTINGS, chunk_bytes=2**15)
    else:
        override(torch_plan.SETTINGS, tile=int(layout[len(kind):]))
    if kind == "global":
        override(torch_plan.SETTINGS, chunk_bytes=2**14)  # chunks of a few tokens, batches of a few tiles
    _autograd_matches_reference(_case_inputs(case, torch.float64, seed=11), seed=3)
    if layout == "span":  # chunks across a sequence boundary take the gathered union
        assert "span" in layouts and layouts <= {"span", "union"}
    else:
        assert layouts == {"tiles" if kind == "tile" else kind}


def test_small_g_dense_selection_takes_a_span(layouts):
    # G = 1 with every token picking most of its visible blocks: tiles would gather a block per slot (memory
    # bound); the plan takes the selection's span of the block buffer instead (no gather), never across a
    # sequence boundary, and its results and gradients (deterministic or not) match the reference
    case = ("G1-dense", [300, 200], None, 4, 4, 32, 16, 16, 12, True, 0.0, False)
    a = _case_inputs(case, torch.float64, seed=5)
    q, k, v, kw = _split(a)
    cu = normalize_cu_seqlens("q", kw["actual_seq_qlen"], q.shape[0])
    plan = torch_plan.Plan(q, k, kw["topk_indices"], 16, cu, cu, True)
    spans = [(t0, t1, job) for t0, t1, job in plan.jobs(2**12, 1)
             if isinstance(job, torch_jobs.UnionJob) and job.span]
    assert spans and all(job.gathered == 0 for _, _, job in spans)
    assert all(t1 <= 300 or t0 >= 300 for t0, t1, _ in spans)  # never across the sequence boundary
    layouts.clear()
    out, m, l, dout, ref = _autograd_matches_reference(a, seed=4)
    grads = sparseops.nsa_selected_attention_grad(
        q, k, v, out, dout, m, l, kw["topk_indices"],
        scale_value=kw["scale_value"], selected_block_size=16, selected_block_count=12, head_num=4,
        actual_seq_qlen=kw["actual_seq_qlen"], actual_seq_kvlen=kw["actual_seq_kvlen"], sparse_mode=2,
        deterministic=True, backend="torch")
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref[3:]):
        assert_close(x, y, name=name)
    assert "span" in layouts


@pytest.mark.parametrize("pattern", ["uniform", "nsa"])
def test_tile_chunks_sharing_little_are_tiled_globally(pattern, override, layouts):
    """Chunks of 8 tokens that draw 4 of up to 38 blocks each share almost none (G * share ~ 5), while the call
    shares ~60 slots per block: their tiles are built over all of them at once (forward and backward), and the
    results are the reference's. NSA-like selections (neighbours share their blocks) keep the union layout."""
    override(torch_plan.SETTINGS, chunk_bytes=48 * 2**10)
    a = make_nsa_inputs([600, 7], N1=4, N2=1, Dqk=16, Dv=8, bs=16, K=4, dtype=torch.float64, seed=5)
    a["topk_indices"] = make_topk_indices([600, 7], [600, 7], N2=1, K=4, bs=16, pattern=pattern, seed=5)
    _autograd_matches_reference(a, seed=2)
    assert ("global" in layouts) == (pattern == "uniform"), layouts


@pytest.mark.parametrize("layout", ["default", "span", "union", "tiles", "global"])
def test_huge_finite_keys_out_of_sight_give_finite_results(layout, override):
    # fp32 keys so large that q.k overflows to +-inf, in rows no query sees: a causally masked row of a
    # selected block, and a whole sequence that has keys but no queries (a span across it would read it with
    # weight 0). The -inf mask must not turn +inf into NaN: outputs and gradients stay finite in every layout
    _force_layout(override, layout)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 1, 16, generator=g)
    k, v = torch.randn(96, 1, 16, generator=g), torch.randn(96, 1, 16, generator=g)
    k[32:64] = 3e38  # sequence 1: keys, no queries
    k[10], k[11] = -3e38, 3e38  # sequence 0: after its queries (causal), in the block they select
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    topk = torch.zeros(8, 1, 1, dtype=torch.int32)  # every query takes its sequence's block 0
    out, m, l = sparseops.nsa_selected_attention(
        q, k, v, topk, scale_value=0.25, head_num=1, selected_block_size=16, selected_block_count=1,
        actual_seq_qlen=[4, 4, 8], actual_seq_kvlen=[32, 64, 96], sparse_mode=2, backend="torch")
    dout = torch.ones_like(out)
    out.backward(dout)
    a = {"query": q.detach(), "key": k.detach(), "value": v.detach(), "topk_indices": topk, "scale_value": 0.25,
         "selected_block_size": 16, "actual_seq_qlen": [4, 4, 8], "actual_seq_kvlen": [32, 64, 96],
         "sparse_mode": 2}
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"),
                          (out, m[..., 0], l[..., 0], q.grad, k.grad, v.grad), _ref(a, dout)):
        assert torch.isfinite(x).all(), name
        assert_close(x, y, torch.float32, name=name)


@pytest.mark.parametrize("layout", ["default", "span", "union", "tiles", "global"])
def test_ids_out_of_range_unvalidated_act_as_empty_slots(layout, override):
    """validate=False with ids past a sequence's blocks, below -1, or outside int32 (undefined behaviour): every
    layout gives the results of those slots left empty (-1), bitwise; ``2**60 - 2**36`` (``id * bs`` wraps to
    a negative position) used to pass as live and fail with an IndexError deep in torch."""
    _force_layout(override, layout)
    a = make_nsa_inputs([9, 14], [20, 40], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, seed=4)
    bad = a["topk_indices"].to(torch.int64)
    empty = bad.clone()
    for (t, n, s), x in (((3, 0, 1), 2), ((12, 1, 0), 5), ((5, 0, 1), 2**32), ((8, 0, 0), -2**32),
                         ((10, 1, 1), 2**60 - 2**36), ((11, 0, 0), -5)):
        bad[t, n, s], empty[t, n, s] = x, -1
    q, k, v, kw = _split(a)
    kw.pop("topk_indices")
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(1))
    got = []
    for ids in (bad, empty):
        out, m, l = sparseops.nsa_selected_attention(q, k, v, ids, validate=False, backend="torch", **kw)
        grads = sparseops.nsa_selected_attention_grad(q, k, v, out, dout, m, l, ids, validate=False,
                                                      backend="torch", **kw)
        got.append((out, m, l, *grads))
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"), *got):
        assert torch.equal(x, y), name


def test_very_negative_scores_give_exact_zeros():
    # scores far below the row max (exp underflows; the backend clamps the exponent for speed) must still give
    # the reference's probabilities, and invisible keys exactly 0 gradient
    a = _case_inputs(CASES[3], torch.float32, seed=2)
    q, k, v, kw = _split(a)
    k = k.clone()
    k[::3] *= 60.0
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dout)
    ref = _ref({**a, "key": k.detach()}, dout)
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"),
                          (out, m[..., 0], l[..., 0], q.grad, k.grad, v.grad), ref):
        assert_close(x, y, torch.float32, name=name)
        assert torch.isfinite(x).all()


def test_small_chunks_give_the_same_result(override):
    # forces many chunks (one token each) through the chunk loop, incl. chunks with nothing visible
    a = _case_inputs(CASES[0], torch.float64)
    q, k, v, kw = _split(a)
    q.requires_grad_()
    out, m, l = sparseops.nsa_selected_attention(q, k, v, **kw)
    (g,) = torch.autograd.grad(out, q, torch.ones_like(out))
    override(torch_plan.SETTINGS, chunk_bytes=1)
    out2, m2, l2 = sparseops.nsa_selected_attention(q, k, v, **kw)
    (g2,) = torch.autograd.grad(out2, q, torch.ones_like(out2))
    assert_close(out2, out, name="out")
    assert_close(l2, l, name="softmax_sum")
    assert_close(g2, g, name="dq")


def test_chunks_whose_gathered_blocks_pass_the_budget_are_split(override):
    # G = 1, few tokens per sequence, non-causal: each slot gathers its own block, which the per-slot budget of
    # chunks() does not count; jobs() halves such chunks (down to one token) and the results stay the same
    case = ("G1-short-q-long-kv", [3, 2, 4, 1], [60, 70, 33, 48], 2, 2, 16, 8, 16, 3, False, 0.0, True)
    a = _case_inputs(case, torch.float64)
    dout = torch.randn(a["query"].shape[0], 2, 8, dtype=torch.float64)
    want = _ref(a, dout)
    # a span (a view of the buffer) gathers nothing: off
    override(torch_plan.SETTINGS, chunk_bytes=32768, gather_bytes=32768, span=False)
    q, k, v, kw = _split(a)
    cu_q = normalize_cu_seqlens("q", kw["actual_seq_qlen"], q.shape[0])
    cu_kv = normalize_cu_seqlens("kv", kw["actual_seq_kvlen"], k.shape[0])
    plan = torch_plan.Plan(q, k, kw["topk_indices"], 16, cu_q, cu_kv, False)
    per_block = 16 * (16 + 8) * 8
    per_slot = 1 * (16 + 2 * 8 + 16) * 8  # the forward's: G * (Dqk + 2 Dv + bs) * elt
    assert len(plan.chunks(per_slot)) == 1  # all 10 tokens fit the per-slot budget
    jobs = list(plan.jobs(per_slot, per_block))
    assert len(jobs) > 1  # but not their gathered blocks
    assert [j[0] for j in jobs] == sorted(j[0] for j in jobs)  # in token order (a fixed summation order)
    for t0, t1, job in jobs:
        assert t1 - t0 == 1 or job.rows.numel() * per_block <= 32768
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    got = (out, m[..., 0], l[..., 0], *sparseops.nsa_selected_attention_grad(
        q, k, v, out, dout, m, l, kw["topk_indices"], scale_value=kw["scale_value"], selected_block_size=16,
        selected_block_count=3, head_num=2, actual_seq_qlen=kw["actual_seq_qlen"],
        actual_seq_kvlen=kw["actual_seq_kvlen"], sparse_mode=0, backend="torch"))
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"), got, want):
        assert_close(x, y, torch.float64, name=name)


def test_atten_mask_is_accepted_and_never_read():
    a = _case_inputs(CASES[0], torch.float32)
    q, k, v, kw = _split(a)
    ref = sparseops.nsa_selected_attention(q, k, v, **kw)
    for mask in (torch.ones(4, 4, dtype=torch.bool), torch.zeros(2048, 2048, dtype=torch.uint8)):
        got = sparseops.nsa_selected_attention(q, k, v, atten_mask=mask, **kw)
        for x, y in zip(got, ref):
            assert torch.equal(x, y)


def test_triton_backend_request_is_clear():
    a = _case_inputs(CASES[5], torch.float32)
    q, k, v, kw = _split(a)
    with pytest.raises(ValueError, match="backend"):
        sparseops.nsa_selected_attention(q, k, v, backend="triton", **kw)
