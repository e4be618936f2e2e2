"""gradcheck (float64) through ``nsa_selected_attention``, the custom ops' registrations, and
``torch.compile(fullgraph=True)`` against eager (forward and gradients)."""

import pytest
import torch

import sparseops
from sparseops.testing import assert_close, make_nsa_inputs

GRADCHECK_CASES = [
    # id, seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, K, causal
    ("varlen-GQA-causal-Dqk!=Dv", [3, 0, 4], [5, 2, 17], 4, 2, 4, 3, 2, True),
    ("one-seq-noncausal-G3", [3], [18], 3, 1, 4, 4, 2, False),
]


@pytest.mark.parametrize("backend", ["torch"])
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_float64(case, backend):
    _, sq, skv, N1, N2, Dqk, Dv, K, causal = case
    a = make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=16, K=K, dtype=torch.float64,
                        causal=causal, empty_frac=0.2, duplicates=True, seed=2)
    q, k, v = (a.pop(n).requires_grad_() for n in ("query", "key", "value"))

    def f(q, k, v):
        return sparseops.nsa_selected_attention(q, k, v, backend=backend, **a)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


def test_opcheck_forward_op():
    from sparseops.nsa.api import _bwd_op, _fwd_op

    a = make_nsa_inputs([5, 7], [9, 20], N1=4, N2=2, Dqk=8, Dv=8, bs=16, K=2, dtype=torch.float32)
    q, k, v = (a[n].requires_grad_() for n in ("query", "key", "value"))
    args = (q, k, v, a["topk_indices"], a["scale_value"], 16, [0, 5, 12], [0, 9, 29], True, "torch", False)
    torch.library.opcheck(_fwd_op, args)
    out, m, l = _fwd_op(*args)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), torch.randn_like(out), m, l, *args[3:9], False,
             "torch", False)
    torch.library.opcheck(_bwd_op, bargs, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compile_backend):
    a = make_nsa_inputs([6, 0, 11], [9, 4, 30], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=torch.float32,
                        empty_frac=0.2, seed=4)
    q, k, v = (a.pop(n) for n in ("query", "key", "value"))

    def f(q, k, v):
        out, m, l = sparseops.nsa_selected_attention(q, k, v, **a)
        return out * 2.0 + 1.0, m, l

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=compile_backend)
    res = []
    for fn in (f, cf):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, m, l = fn(qq, kk, vv)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        res.append((out.detach(), m, l, qq.grad, kk.grad, vv.grad))
    for name, x, y in zip(("out", "softmax_max", "softmax_sum", "dq", "dk", "dv"), *res):
        assert_close(x, y, name=name)


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="torch without the cudagraph_unsafe tag")
def test_ops_are_kept_out_of_cuda_graphs():
    """Both NSA custom ops carry ``cudagraph_unsafe``: torch.compile(mode="reduce-overhead") runs them between
    its captured partitions (a replay would reread the pinned host buffers of the sequence lengths after they
    were freed). The MoE ops, whose Triton path reads nothing from the host, are not tagged."""
    for name in ("nsa_selected_attention_fwd", "nsa_selected_attention_bwd"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.sparseops, name).default.tags, name
    assert torch.Tag.cudagraph_unsafe not in torch.ops.sparseops.moe_unpermute_grad.default.tags


def test_compiled_backward_follows_set_deterministic_at_run_time(monkeypatch):
    # the switch is read when the backward op runs, not baked into the graph when it was traced
    from sparseops.nsa import torch_impl

    seen = []
    real = torch_impl.backward

    def spy(*args, deterministic, **kw):
        seen.append(deterministic)
        return real(*args, deterministic=deterministic, **kw)

    monkeypatch.setattr(torch_impl, "backward", spy)
    a = make_nsa_inputs([20, 13], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=torch.float32)
    q, k, v = (a.pop(n) for n in ("query", "key", "value"))
    torch._dynamo.reset()
    cf = torch.compile(lambda q, k, v: sparseops.nsa_selected_attention(q, k, v, **a)[0], fullgraph=True,
                       backend="aot_eager")
    before = sparseops.is_deterministic()
    try:
        for flag in (False, True, False):
            sparseops.set_deterministic(flag)
            cf(*(t.clone().requires_grad_() for t in (q, k, v))).sum().backward()
    finally:
        sparseops.set_deterministic(before)
    assert seen == [False, True, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_under_cpu_autocast(dtype):
    # autocast must not re-type the matmuls inside the op (bmm(..., out=fp32) failed); same numbers as without
    a = make_nsa_inputs([20, 13], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=dtype)
    q, k, v = (a.pop(n) for n in ("query", "key", "value"))
    res = []
    for enabled in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out, m, l = sparseops.nsa_selected_attention(qq, kk, vv, backend="torch", **a)
            out.float().sum().backward()
        res.append((out, m, qq.grad, kk.grad, vv.grad))
    for name, x, y in zip(("out", "softmax_max", "dq", "dk", "dv"), *res):
        assert torch.equal(x, y), name


def test_double_backward_is_a_clear_error_and_zero_cotangents_pass():
    a = make_nsa_inputs([20, 13], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=torch.float64)
    q, k, v = (a.pop(n).requires_grad_() for n in ("query", "key", "value"))
    out, _, _ = sparseops.nsa_selected_attention(q, k, v, **a)
    dq, dk, dv = torch.autograd.grad(out.pow(2).sum(), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError, match="nsa_selected_attention_grad is not differentiable"):
        dq.pow(2).sum().backward(retain_graph=True)
    # a zero cotangent has the exact answer zero, whatever the function
    (dq * 0.0).sum().backward()
    assert not q.grad.any()


def test_compiled_function_calling_the_grad_op_on_inputs_that_require_grad():
    # AOT autograd traces a backward for every output that requires grad: the grad op needs a formula for that
    # even when nothing backpropagates through it (a recomputation, a diagnostic)
    a = make_nsa_inputs([20, 13], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=torch.float32)
    q, k, v = (a.pop(n) for n in ("query", "key", "value"))
    kw = {n: a[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                             "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}

    def f(q, k, v):
        out, m, l = sparseops.nsa_selected_attention(q, k, v, **a)
        dq, _, _ = sparseops.nsa_selected_attention_grad(q, k, v, out, torch.ones_like(out), m, l,
                                                         a["topk_indices"], **kw)
        return out, dq

    torch._dynamo.reset()
    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, dq = fn(qq, kk, vv)
        out.sum().backward()
        res.append((out.detach(), dq.detach(), qq.grad))
    for name, x, y in zip(("out", "dq", "q.grad"), *res):
        assert_close(y, x, name=name)
