"""grouped_linear against a per-row float64 loop: both layouts, bias, both GEMM paths, empty experts, R = 0."""

from __future__ import annotations

import pytest
import torch

from sparseops.nn.experts import SETTINGS
from sparseops.nn.grouped_linear import grouped_linear
from sparseops.testing import assert_close


def _oracle(x, w, b, counts, transposed):
    rows, s = [], 0
    for e, c in enumerate(counts):
        we = w[e] if transposed else w[e].T  # [C, N]
        for i in range(s, s + c):
            y = x[i] @ we
            rows.append(y if b is None else y + b[e])
        s += c
    N = w.shape[2] if transposed else w.shape[1]
    return torch.stack(rows) if rows else x.new_zeros(0, N)


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ENC", "ECN"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [(3, 0, 5, 1), (0, 0, 0, 0), (0, 7, 0, 0)],
                         ids=["empty-expert", "no-rows", "one-expert"])
def test_grouped_linear_matches_the_loop(gemm, transposed, bias, dtype, counts):
    E, C, N = 4, 9, 7  # odd sizes
    R = sum(counts)
    g = torch.Generator().manual_seed(R + 10 * transposed)
    x = torch.randn(R, C, generator=g, dtype=torch.float64)
    w = torch.randn(E, *((C, N) if transposed else (N, C)), generator=g, dtype=torch.float64)
    b = torch.randn(E, N, generator=g, dtype=torch.float64) if bias else None
    gy = torch.randn(R, N, generator=g, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_(True) for t in (x, w, b) if t is not None]
    with SETTINGS.override(gemm=gemm):
        y = grouped_linear(leaves[0], leaves[1], list(counts), transposed=transposed,
                           bias=leaves[2] if bias else None)
        (y * gy.to(dtype)).sum().backward()
    assert y.dtype == dtype and y.shape == (R, N)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = _oracle(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None, counts, transposed)
    assert_close(y, ref, dtype, "y")
    if R:
        grads = torch.autograd.grad((ref * gy).sum(), ref_leaves, allow_unused=True)
    else:
        grads = [None] * len(ref_leaves)
    for name, leaf, ref_leaf, gr in zip(["x", "w", "bias"], leaves, ref_leaves, grads):
        assert leaf.grad is not None, f"{name}: no gradient"
        assert_close(leaf.grad, torch.zeros_like(ref_leaf) if gr is None else gr, dtype, f"{name}.grad")
    for e, c in enumerate(counts):
        if c == 0:  # an expert with no rows: zero gradients, not None
            assert torch.count_nonzero(leaves[1].grad[e]) == 0
            if bias:
                assert torch.count_nonzero(leaves[2].grad[e]) == 0


def test_a_strided_weight_view_is_used_as_is():
    # transformers' gate/up halves are views of one parameter: a slice along N, no copy
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 10, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = grouped_linear(x, w[:, 5:], [2, 1, 3])
    y.sum().backward()
    ref = _oracle(x, w.detach()[:, 5:], None, [2, 1, 3], False)
    assert_close(y, ref, torch.float64, "y")
    assert torch.count_nonzero(w.grad[:, :5]) == 0


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"x": torch.zeros(2, 3, 1)}, ValueError, "x: expected shape"),
    ({"w": torch.zeros(2, 4)}, ValueError, "w: expected shape"),
    ({"x": torch.zeros(3, 5)}, ValueError, r"x: expected shape \[R, C=4\]"),
    ({"w": torch.zeros(2, 3, 4, dtype=torch.float64)}, TypeError, "w: expected dtype"),
    ({"bias": torch.zeros(2, 4)}, ValueError, r"bias: expected shape \[E=2, N=3\]"),
    ({"counts": [1, 1]}, ValueError, "tokens_per_expert: expected counts summing"),
    ({"counts": [3]}, ValueError, "tokens_per_expert: expected 2 counts"),
    ({"transposed": 1}, TypeError, "transposed: expected a bool"),
    # sparse layouts died in torch ("unsupported memory format option", "expand is unsupported for Sparse tensors")
    ({"x": torch.zeros(3, 4).to_sparse()}, TypeError, r"^x: expected a dense \(torch.strided\) tensor, got layout "),
    ({"w": torch.zeros(2, 3, 4).to_sparse()}, TypeError, r"^w: expected a dense \(torch.strided\) tensor, got layout"),
    ({"x": torch.zeros(3, 4, dtype=torch.int64), "w": torch.zeros(2, 3, 4, dtype=torch.int64)}, TypeError,
     "x: expected a floating-point dtype"),
])
def test_bad_arguments_name_themselves(kwargs, exc, match):
    args = {"x": torch.zeros(3, 4), "w": torch.zeros(2, 3, 4), "counts": [1, 2], "transposed": False, "bias": None}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        grouped_linear(args["x"], args["w"], args["counts"], transposed=args["transposed"], bias=args["bias"])


@pytest.mark.parametrize("transposed", [False, True])
def test_under_autocast_it_casts_as_f_linear_does(transposed):
    # fp32 x, w and bias under autocast: bitwise the bf16 call on their bf16 copies, gradients in fp32; float64
    # is left alone, as autocast leaves it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 6, generator=g)
    w = torch.randn(3, 6, 5, generator=g) if transposed else torch.randn(3, 5, 6, generator=g)
    b = torch.randn(3, 5, generator=g)
    counts = [3, 0, 4]
    ts = [t.clone().requires_grad_() for t in (x, w, b)]
    lows = [t.bfloat16().requires_grad_() for t in (x, w, b)]
    gy = torch.randn(7, 5, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_linear(ts[0], ts[1], counts, transposed=transposed, bias=ts[2])
    y.backward(gy)
    y_low = grouped_linear(lows[0], lows[1], counts, transposed=transposed, bias=lows[2])
    y_low.backward(gy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_low)
    for t, low in zip(ts, lows):
        assert t.grad.dtype == torch.float32 and torch.equal(t.grad, low.grad.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y64 = grouped_linear(x.double(), w.double(), counts, transposed=transposed)
    assert y64.dtype == torch.float64


def test_create_graph_then_a_second_derivative_is_a_clear_error():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(grouped_linear(x, w, [2, 0, 3]).sum(), x, create_graph=True)  # dx depends on w
    with pytest.raises(RuntimeError, match="grouped_linear is not differentiable twice"):
        dx.sum().backward()


def test_compiled_with_bias_matches_the_loop():
    """Traced by dynamo, the bias rows are added out of place: under torch 2.11 an in-place add to the returned
    tensor leaves every gradient wrong (pytorch/pytorch#180642)."""
    counts, E, C, N = [3, 0, 2], 3, 4, 5
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, C), (E, N, C), (E, N)))
    gy = torch.randn(5, N, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    fn = torch.compile(lambda x, w, b: grouped_linear(x, w, counts, bias=b), fullgraph=True, backend="eager")
    y = fn(*leaves)
    got = torch.autograd.grad((y * gy).sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref = _oracle(*ref_leaves, counts, False)
    want = torch.autograd.grad((ref * gy).sum(), ref_leaves)
    assert_close(y, ref, torch.float64, "y")
    for name, a, e in zip(["x", "w", "bias"], got, want):
        assert_close(a, e, torch.float64, f"{name}.grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("C, N", [(4, 6), (8, 16)], ids=["unaligned", "aligned"])
def test_compiled_with_grouped_gemms_in_every_dtype(dtype, C, N):
    """gemm="grouped" under torch.compile: grouped_mm's fake kernel takes bf16 operands with 16-byte aligned
    strides only (bf16 "aligned" runs it), so the others trace the loop (before, their trace failed in dynamo's
    fake-tensor run)."""
    counts = [3, 0, 2]
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, C), (3, N, C)))
    gy = torch.randn(5, N, generator=g, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_(True) for t in (x, w)]
    with SETTINGS.override(gemm="grouped"):
        fn = torch.compile(lambda x, w: grouped_linear(x, w, counts), fullgraph=True, backend="eager")
        y = fn(*leaves)
        got = torch.autograd.grad((y * gy.to(dtype)).sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w)]
    ref = _oracle(*ref_leaves, None, counts, False)
    want = torch.autograd.grad((ref * gy).sum(), ref_leaves)
    assert_close(y, ref, dtype, "y")
    for name, a, e in zip(["x", "w"], got, want):
        assert_close(a, e, dtype, f"{name}.grad")
