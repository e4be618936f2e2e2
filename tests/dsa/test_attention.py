"""sparse_attention: the selected-attention op over the indexer's [T, topk] indices, and the loss's target from its
own pass equal to indexer_kl_loss's: GQA, more query heads than one vector's lanes, varlen, -1 slots, a slot after
its token; gradients as the op's; bad input."""

import pytest
import torch

import sparseops
from sparseops.dsa import indexer_kl_loss, loss, sparse_attention
from sparseops.testing import assert_close

# every test on both CPU paths: the C++ kernels (where they build) and the torch ops
pytestmark = pytest.mark.usefixtures("cpu_paths")


def _case(T, N1, N2, topk, dtype, cu=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = d(T, N1, 16), d(T, N2, 16), d(T, N2, 12)
    cu_l = cu or [0, T]
    idx = torch.full((T, topk), -1, dtype=torch.int32)
    for a, b in zip(cu_l[:-1], cu_l[1:]):
        for t in range(a, b):
            n = min(topk - 1, t - a + 1)
            idx[t, :n] = torch.randperm(t - a + 1, generator=g)[:n].to(torch.int32)
    return q, k, v, idx


@pytest.mark.parametrize("T, N1, N2, topk, cu, dtype", [
    (21, 4, 1, 6, None, torch.float64),
    (23, 40, 2, 5, [0, 7, 7, 23], torch.float32),  # G = 20: two vectors of heads in fp32, three in float64
    (23, 40, 2, 5, [0, 9, 23], torch.float64),
    (18, 16, 1, 8, None, torch.bfloat16),
], ids=str)
def test_matches_the_op_and_the_loss_target(T, N1, N2, topk, cu, dtype):
    q, k, v, idx = _case(T, N1, N2, topk, dtype, cu)
    idx[5, topk - 1] = 5 + 3 if cu is None else idx[5, topk - 1]  # (one sequence) a slot after its token
    cu_l = cu or [0, T]
    out, p = sparse_attention(q, k, v, idx, scale=0.3, cu_seqlens=cu, return_target=True)
    assert p.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and not p.requires_grad
    blocks = idx[:, None, :].expand(T, N2, topk)
    want = sparseops.nsa_selected_attention(q, k, v, blocks, 0.3, N1, 1, topk, actual_seq_qlen=cu_l[1:],
                                            actual_seq_kvlen=cu_l[1:], sparse_mode=2)[0]
    assert torch.equal(out, want)
    seen = idx.clone()
    if cu is None:
        seen[5, topk - 1] = -1  # the attention does not see it: no probability there
        assert p[5, topk - 1] == 0
    p_want = loss._target(q.detach(), k.detach(), seen, 0.3, cu_l)
    assert_close(p, p_want, torch.float64 if dtype == torch.float64 else torch.float32, name="target")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    exp = torch.autograd.grad(want, (q, k, v), dout)
    for name, a, b in zip(("dq", "dk", "dv"), got, exp):
        assert torch.equal(a, b), name


def test_without_target_and_the_loss_takes_it():
    T, N1, topk = 19, 4, 5
    q, k, v, idx = _case(T, N1, 1, topk, torch.float64, seed=3)
    out = sparse_attention(q, k, v, idx, scale=0.5)
    assert isinstance(out, torch.Tensor) and out.shape == (T, N1, 12)
    _, p = sparse_attention(q, k, v, idx, scale=0.5, return_target=True)
    scores = torch.randn(T, topk, dtype=torch.float64, requires_grad=True)
    a = indexer_kl_loss(q.detach(), k.detach(), idx, scores, scale=0.5, head_num=N1, target=p)
    b = indexer_kl_loss(q.detach(), k.detach(), idx, scores, scale=0.5, head_num=N1)
    assert_close(a, b, torch.float64)
    ga, = torch.autograd.grad(a, scores)
    gb, = torch.autograd.grad(b, scores)
    assert_close(ga, gb, torch.float64)


@pytest.mark.parametrize("edit, exc, msg", [
    (lambda a: a.update(indices=a["indices"][:, None]), ValueError, "indices"),
    (lambda a: a.update(indices=a["indices"].float()), TypeError, "indices"),
    (lambda a: a.update(indices=a["indices"].clone().fill_(30)), ValueError, "topk_indices"),
    (lambda a: a.update(q=a["q"][:, :, :8]), ValueError, "key"),
    (lambda a: a.update(return_target=1), TypeError, "return_target"),
    (lambda a: a.update(cu_seqlens=[0, 4]), ValueError, "cu_seqlens"),
    # the op's scale_value and selected_block_count, under this function's names
    (lambda a: a.update(scale=None), TypeError, "^scale: expected a float, got NoneType"),
    (lambda a: a.update(indices=a["indices"][:, :0]), ValueError, "^indices: expected 1 to 2048 keys per query"),
    (lambda a: a.update(indices=a["indices"][:, :1].expand(10, 2049)), ValueError,
     "^indices: expected 1 to 2048 keys per query .*got 2049"),
])
def test_bad_input(edit, exc, msg):
    q, k, v, idx = _case(10, 4, 1, 3, torch.float64)
    a = {"q": q, "k": k, "v": v, "indices": idx, "scale": 0.5}
    edit(a)
    with pytest.raises(exc, match=msg):
        sparse_attention(**a)


def test_loss_target_shape_is_checked():
    q, k, _, idx = _case(10, 4, 1, 3, torch.float64)
    scores = torch.zeros(10, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="target"):
        indexer_kl_loss(q, k, idx, scores, scale=0.5, head_num=4, target=torch.zeros(10, 2, dtype=torch.float64))


@pytest.mark.parametrize("target", [False, True], ids=["out", "with-target"])
def test_second_derivative_is_an_error_not_a_silent_zero(target):
    # the backward runs outside autograd (the seed op, or the C++ kernels of the target's pass)
    q, k, v, idx = _case(10, 4, 1, 3, torch.float64)
    out = sparse_attention(q, k, v, idx, scale=0.5, return_target=target)
    (dq,) = torch.autograd.grad((out[0] if target else out).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (dq.pow(2).sum() + q.sum()).backward()


@pytest.mark.parametrize("name", ["k", "v", "indices"])
def test_rows_are_checked_under_this_functions_names(name):
    q, k, v, idx = _case(10, 4, 1, 3, torch.float64)
    a = {"q": q, "k": k, "v": v, "indices": idx}
    a[name] = a[name][:7]
    with pytest.raises(ValueError, match=f"^{name}: expected 10 rows .*got shape \\[7"):
        sparse_attention(**a, scale=0.5)
