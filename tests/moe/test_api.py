"""gradcheck of the two differentiable ops in float64, and torch.compile(fullgraph=True) against eager."""

import pytest
import torch

from sparseops import moe_token_permute_with_ep, moe_token_unpermute_with_ep
from sparseops.testing import assert_close, make_moe_inputs

F64 = torch.float64

GRADCHECK_CASES = [
    pytest.param(5, 2, 3, None, id="full-window"),
    pytest.param(5, 2, 3, [2, 8], id="partial-window"),
    pytest.param(4, 3, 2, [-5, -1], id="negative-range"),
]


@pytest.mark.parametrize("T,K,H,rng", GRADCHECK_CASES)
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_gradcheck_permute(T, K, H, rng, backend):
    d = make_moe_inputs(T, K, H, dtype=F64)
    t = d["tokens"].requires_grad_()
    p = d["probs"].requires_grad_()

    def f(t, p):
        out, _, pp = moe_token_permute_with_ep(t, d["indices"], p, rng, backend=backend)
        return out, pp

    assert torch.autograd.gradcheck(f, (t, p))


@pytest.mark.parametrize("T,K,H,rng", GRADCHECK_CASES)
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_gradcheck_unpermute(T, K, H, rng, backend):
    d = make_moe_inputs(T, K, H, dtype=F64)
    pt, si, _ = moe_token_permute_with_ep(d["tokens"], d["indices"], None, rng)
    x = pt.clone().requires_grad_()
    p = d["probs"].requires_grad_()
    assert torch.autograd.gradcheck(lambda x, p: moe_token_unpermute_with_ep(x, si, p, K, rng, backend=backend), (x, p))
    # no probs: differentiable in permuted_tokens alone
    assert torch.autograd.gradcheck(lambda x: moe_token_unpermute_with_ep(x, si, None, K, rng, backend=backend), (x,))


def _moe_layer(tokens, probs, indices, w):
    pt, si, pp = moe_token_permute_with_ep(tokens, indices, probs, [3, 12])
    y = torch.tanh(pt * w) + pp[:, None]
    return moe_token_unpermute_with_ep(y, si, probs, indices.shape[1], [3, 12])


def test_torch_compile_fullgraph_matches_eager():
    """No graph break (fullgraph=True), same forward and gradients as eager; inductor with one compile
    thread so that the test does not wait for a worker pool."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    d = make_moe_inputs(7, 2, 5, dtype=torch.float32)
    w = torch.randn(5)
    torch._dynamo.reset()
    with inductor_config.patch(compile_threads=1):
        compiled = torch.compile(_moe_layer, fullgraph=True)
        results = []
        for fn in (_moe_layer, compiled):
            t = d["tokens"].clone().requires_grad_()
            p = d["probs"].clone().requires_grad_()
            out = fn(t, p, d["indices"], w)
            out.pow(2).sum().backward()
            results.append((out.detach(), t.grad, p.grad))
    for name, a, b in zip(("out", "tokens.grad", "probs.grad"), *results):
        assert_close(b, a, torch.float32, name=name)


def test_torch_compile_tensor_range_is_a_clear_error():
    # a range tensor's values decide the number of output rows: a traced graph cannot read them. Ours says so
    # (carried in dynamo's error) instead of dynamo's data-dependent guard failure; eager takes a tensor range
    import torch._dynamo

    d = make_moe_inputs(4, 2, 3, dtype=torch.float32)

    def f(t, idx, r):
        return moe_token_permute_with_ep(t, idx, None, r)[0]

    r = torch.tensor([1, 6])
    assert torch.equal(f(d["tokens"], d["indices"], r), f(d["tokens"], d["indices"], [1, 6]))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="range: expected two Python ints under torch.compile"):
        torch.compile(f, fullgraph=True, backend="eager")(d["tokens"], d["indices"], r)


@pytest.mark.parametrize("name", ["moe_permute", "moe_unpermute", "moe_unpermute_grad", "moe_permute_grad"])
def test_custom_op_opcheck(name):
    """Schema, fake kernel, autograd registration and AOT dispatch with dynamic shapes."""
    args = list(_opcheck_args(name))
    if name in ("moe_permute", "moe_unpermute"):
        args[0].requires_grad_()
        args[2].requires_grad_()
    torch.library.opcheck(getattr(torch.ops.sparseops, name), tuple(args))


def _opcheck_args(name):
    d = make_moe_inputs(5, 2, 3, dtype=torch.float32)
    from sparseops.moe import torch_impl

    si = torch_impl.sorted_indices_from(d["indices"])
    if name == "moe_permute":
        return (d["tokens"], si, d["probs"], 2, 1, 9, "torch", False)
    if name == "moe_unpermute":
        return (torch.randn(8, 3), si, d["probs"], 2, 1, 9, "torch", False)
    if name == "moe_unpermute_grad":
        return (torch.randn(5, 3), si, torch.randn(8, 3), d["probs"], 2, 1, 9, "torch", False)
    return (torch.randn(8, 3), si, torch.randn(8), 2, 1, 9, "torch", False)


def test_double_backward_is_a_clear_error():
    d = make_moe_inputs(5, 2, 3, dtype=F64)
    t, p = d["tokens"].requires_grad_(), d["probs"].requires_grad_()
    pt, si, _ = moe_token_permute_with_ep(t, d["indices"], p)
    out = moe_token_unpermute_with_ep(pt * 2.0, si, p)
    (gt,) = torch.autograd.grad(out.pow(2).sum(), (t,), create_graph=True)
    with pytest.raises(RuntimeError, match="moe_token_(un)?permute_with_ep_grad is not differentiable"):
        gt.pow(2).sum().backward()


def test_compiled_function_calling_a_grad_op_on_inputs_that_require_grad():
    import torch._dynamo

    from sparseops import moe_token_permute_with_ep_grad

    d = make_moe_inputs(5, 2, 3, dtype=torch.float32)

    def f(tok):
        out, si, _ = moe_token_permute_with_ep(tok, d["indices"])
        tg, _ = moe_token_permute_with_ep_grad(out, si, topk_num=2)
        return out, tg

    torch._dynamo.reset()
    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        t = d["tokens"].clone().requires_grad_()
        out, tg = fn(t)
        out.sum().backward()
        res.append((out.detach(), tg.detach(), t.grad))
    for name, x, y in zip(("out", "tg", "tokens.grad"), *res):
        assert_close(y, x, torch.float32, name=name)


def test_one_dim_indices_mean_k1():
    d = make_moe_inputs(7, 1, 5, dtype=torch.float64)
    a = moe_token_permute_with_ep(d["tokens"], d["indices"][:, 0], d["probs"][:, 0], backend="torch")
    b = moe_token_permute_with_ep(d["tokens"], d["indices"], d["probs"], backend="torch")
    for x, y in zip(a, b):
        assert torch.equal(x, y)
