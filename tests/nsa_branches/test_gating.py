"""gated_sum (the NSA branches' gated sum) against the float64 expression it replaces: output and every gradient,
each dtype, one to three outputs, an empty batch, gradcheck, torch.compile, bad input."""

import pytest
import torch

from sparseops.nsa_branches.gating import gated_sum
from sparseops.testing import assert_close


def _inputs(T, C, dtype, seed=0, N1=3, D=5):
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand(T, N1, C, generator=g, dtype=torch.float64)
    outs = [torch.randn(T, N1, D, generator=g, dtype=torch.float64) for _ in range(C)]
    do = torch.randn(T, N1, D, generator=g, dtype=torch.float64)
    return gates, outs, do


def _expected(gates, outs, do):
    x = [t.detach().requires_grad_() for t in (gates, *outs)]
    o = sum(x[0][..., c:c + 1] * x[1 + c] for c in range(len(outs)))
    return (o, *torch.autograd.grad(o, x, do))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C", [1, 2, 3])
@pytest.mark.parametrize("T", [0, 1, 700])  # 700: more than one slice of the gate gradients' row sums
def test_matches_float64_expression(dtype, C, T):
    gates, outs, do = _inputs(T, C, dtype)
    want = _expected(gates, outs, do)
    x = [t.to(dtype).requires_grad_() for t in (gates, *outs)]
    o = gated_sum(*x)
    got = (o, *torch.autograd.grad(o, x, do.to(dtype)))
    assert o.dtype == dtype
    for a, e in zip(got, want):
        assert a.dtype == dtype
        assert_close(a, e, dtype=dtype)


def test_gradcheck():
    gates, outs, _ = _inputs(6, 3, torch.float64)
    x = [t.requires_grad_() for t in (gates, *outs)]
    assert torch.autograd.gradcheck(gated_sum, x)


def test_only_the_requested_gradients():
    gates, outs, do = _inputs(4, 2, torch.float64)
    outs[1].requires_grad_()
    o = gated_sum(gates, *outs)
    (d1,) = torch.autograd.grad(o, [outs[1]], do)
    assert torch.equal(d1, do * gates[..., 1:2])


def test_compiles_fullgraph():
    gates, outs, do = _inputs(8, 3, torch.float32)
    x = [t.float().requires_grad_() for t in (gates, *outs)]
    fn = torch.compile(gated_sum, fullgraph=True, backend="eager")
    o = fn(*x)
    got = torch.autograd.grad(o, x, do.float())
    want = _expected(gates, outs, do)
    assert_close(o, want[0], dtype=torch.float32)
    for a, e in zip(got, want[1:]):
        assert_close(a, e, dtype=torch.float32)


@pytest.mark.parametrize("case", [
    ("outs-shapes-differ", lambda g, o: (g, o[0], o[1][:2], o[2]), "outs\\[1\\]: expected the shape of outs\\[0\\]"),
    ("gates-rows", lambda g, o: (g[:2], *o), "gates: expected shape"),
    ("outs-rank", lambda g, o: (g, o[0][0], o[1], o[2]), "outs\\[0\\]: expected a 3-D tensor"),
], ids=lambda c: c[0])
def test_shapes_must_match(case):
    gates, outs, _ = _inputs(4, 3, torch.float64)
    with pytest.raises(ValueError, match=case[2]):
        gated_sum(*case[1](gates, outs))


def test_gate_columns_must_match_the_outputs():
    gates, outs, _ = _inputs(4, 3, torch.float64)
    with pytest.raises(ValueError, match="gates: expected 2 columns"):
        gated_sum(gates, *outs[:2])


@pytest.mark.parametrize("which", ["gates", "outs"])
def test_dtypes_must_match(which):
    gates, outs, _ = _inputs(4, 3, torch.float64)
    if which == "gates":
        gates = gates.float()
        msg = "outs\\[0\\]: expected the dtype of gates \\(float32\\), got float64"
    else:
        outs = (outs[0], outs[1].to(torch.bfloat16), outs[2])
        msg = "outs\\[1\\]: expected the dtype of gates \\(float64\\), got bfloat16"
    with pytest.raises(TypeError, match=msg):
        gated_sum(gates, *outs)


def test_integer_gates_are_refused():
    _, outs, _ = _inputs(4, 3, torch.float64)
    with pytest.raises(TypeError, match="gates: expected dtype in"):
        gated_sum(torch.ones(*outs[0].shape[:-1], 3, dtype=torch.int64), *outs)
