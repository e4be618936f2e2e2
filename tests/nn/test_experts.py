"""GroupedExperts against a per-row float64 loop: both GEMM paths, empty experts, R = 0, every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparseops.nn import GroupedExperts
from sparseops.nn.experts import SETTINGS
from sparseops.testing import assert_close


def _oracle(x, w1, w3, w2, counts, activation):
    rows, s = [], 0
    for e, c in enumerate(counts):
        for i in range(s, s + c):
            h = w1[e] @ x[i]
            a = F.silu(h) * (w3[e] @ x[i]) if activation == "swiglu" else F.gelu(h)
            rows.append(w2[e] @ a)
        s += c
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [(3, 0, 5, 1), (0, 0, 0, 0), (0, 7, 0, 0)],
                         ids=["empty-expert", "no-rows", "one-expert"])
def test_grouped_experts_match_the_loop(gemm, activation, dtype, counts):
    E, H, Fd = 4, 9, 7  # odd sizes
    ex = GroupedExperts(E, H, Fd, activation, dtype=dtype)
    R = sum(counts)
    g = torch.Generator().manual_seed(R)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    gy = torch.randn(R, H, generator=g, dtype=torch.float64)
    xd = x.to(dtype).requires_grad_(True)
    with SETTINGS.override(gemm=gemm):
        y = ex(xd, list(counts))
        (y * gy.to(dtype)).sum().backward()
    assert y.dtype == dtype and y.shape == (R, H)
    leaves = [xd.detach().double().requires_grad_(True)] + [p.detach().double().requires_grad_(True)
                                                           for p in (ex.w1, ex.w3, ex.w2) if p is not None]
    w1, *rest = leaves[1:]
    w3, w2 = (rest[0], rest[1]) if activation == "swiglu" else (None, rest[0])
    ref = _oracle(leaves[0], w1, w3, w2, counts, activation)
    assert_close(y, ref, dtype, "y")
    grads = torch.autograd.grad((ref * gy).sum(), leaves, allow_unused=True) if R else [None] * len(leaves)
    got = [xd.grad] + [p.grad for p in (ex.w1, ex.w3, ex.w2) if p is not None]
    for name, a, b, leaf in zip(["x", "w1", "w3" if w3 is not None else "w2", "w2"], got, grads, leaves):
        assert a is not None, f"{name}: no gradient"
        b = torch.zeros_like(leaf) if b is None else b
        assert_close(a, b, dtype, f"{name}.grad")
    for e, c in enumerate(counts):
        if c == 0:  # an expert with no rows: zero gradients, not None
            assert torch.count_nonzero(ex.w1.grad[e]) == 0 and torch.count_nonzero(ex.w2.grad[e]) == 0


def test_counts_as_a_tensor():
    ex = GroupedExperts(3, 4, 5)
    x = torch.randn(4, 4)
    torch.testing.assert_close(ex(x, torch.tensor([1, 0, 3])), ex(x, [1, 0, 3]), rtol=0, atol=0)


@pytest.mark.parametrize("counts, err, match", [
    ([1, 1], ValueError, "tokens_per_expert: expected 3 counts"),
    ([1, 1, 1], ValueError, r"summing to the rows of x \(R = 4\), got sum 3"),
    ([5, -1, 0], ValueError, "counts >= 0"),
    (torch.tensor([1.0, 1.0, 2.0]), TypeError, "integer tensor"),
    ([1, 1, 2.0], TypeError, "expected ints"),
    (torch.tensor([1, 1, 2], device="meta"), ValueError, "tokens_per_expert: expected a tensor with data"),
    ("1,1,2", TypeError, "tokens_per_expert"),
])
def test_bad_counts(counts, err, match):
    ex = GroupedExperts(3, 4, 5)
    with pytest.raises(err, match=match):
        ex(torch.randn(4, 4), counts)


def test_bad_construction_and_input():
    with pytest.raises(ValueError, match="activation: expected one of"):
        GroupedExperts(2, 4, 4, activation="relu")
    ex = GroupedExperts(2, 4, 4)
    with pytest.raises(ValueError, match=r"x: expected shape \[R, H=4\], got \[3, 5\]"):
        ex(torch.randn(3, 5), [3, 0])
    with pytest.raises(TypeError, match="x: expected dtype torch.float32"):
        ex(torch.randn(3, 4, dtype=torch.float64), [3, 0])
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_coo$"):  # was "unsupported memory format option"
        ex(torch.randn(3, 4).to_sparse(), [3, 0])
    with pytest.raises(ValueError, match="ExpertSettings.gemm"), SETTINGS.override(gemm="fast"):
        ex(torch.randn(3, 4), [3, 0])
    with pytest.raises(ValueError, match="x: expected device cpu"):
        ex(torch.randn(3, 4, device="meta"), [3, 0])
    with pytest.raises(TypeError, match="dtype: expected None or one of"):
        GroupedExperts(2, 4, 4, dtype=torch.int32)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_under_autocast_the_gemms_run_in_its_dtype(activation):
    # as F.linear under autocast: the fp32 module computes what a bf16 copy computes on bf16 rows, bitwise,
    # and its weights' gradients are the copy's, in fp32
    torch.manual_seed(0)
    ex = GroupedExperts(3, 8, 5, activation)
    low = GroupedExperts(3, 8, 5, activation, dtype=torch.bfloat16)
    low.load_state_dict(ex.state_dict())
    x = torch.randn(7, 8)
    counts = [3, 0, 4]
    gy = torch.randn(7, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x.requires_grad_(), counts)
    y.backward(gy)
    xl = x.detach().bfloat16().requires_grad_()
    yl = low(xl, counts)
    yl.backward(gy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, yl)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xl.grad.float())
    for (n, p), q in zip(ex.named_parameters(), low.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float()), n
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"x: expected dtype torch.float32 \(the experts' weights\) or torch.bfloat16 \(the "
                             r"enclosing autocast's\), got torch.float16"):
        ex(x.detach().half(), counts)


def test_create_graph_then_a_second_derivative_is_a_clear_error():
    experts = GroupedExperts(3, 4, 5, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(experts(x, [2, 0, 3]).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="GroupedExperts is not differentiable twice"):
        dx.sum().backward()
