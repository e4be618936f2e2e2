"""NativeSparseAttention against a float64 oracle built from the dense-mask references (output, every gradient,
the selection), causality by perturbing later tokens, packing invariance, gradcheck, the branches flag, G in
{1, 3, 16}, the paper's and fla's block configurations, bad input."""

import copy

import pytest
import torch
import torch.nn.functional as F

from sparseops.nn import NativeSparseAttention
from sparseops.nsa_branches import reference as R
from sparseops.testing import assert_close

CONFIGS = [
    # id: what it covers; module kwargs (hidden_size 32), cu_seqlens
    ("paper-blocks-G4-mlp-rope", dict(num_heads=4, num_kv_heads=1, head_dim=16, v_head_dim=8, compress_block_size=32,
                                      compress_stride=16, select_block_size=64, select_count=3, window_size=48,
                                      rope_theta=10000.0), [0, 260, 290, 291]),
    ("fla-blocks-mean-G16", dict(num_heads=16, num_kv_heads=1, head_dim=8, compress_block_size=16, compress_stride=16,
                                 select_block_size=16, select_count=4, window_size=24, compressor="mean"), [0, 150]),
    ("G1-len0-short", dict(num_heads=2, num_kv_heads=2, head_dim=16, v_head_dim=8, compress_block_size=16,
                           compress_stride=8, select_block_size=16, select_count=4, local_blocks=1, window_size=20,
                           rope_theta=10000.0), [0, 5, 5, 120]),
    ("G3-two-kv-heads", dict(num_heads=6, num_kv_heads=2, head_dim=8, compress_block_size=16, compress_stride=8,
                             select_block_size=32, select_count=2, local_blocks=1, window_size=40, rope_theta=500.0),
     [0, 100, 133]),
]


def _rope(x, pos, theta):
    """RoPE as complex rotation of (x[i], x[i + D/2]): an independent formulation of the module's."""
    D = x.shape[-1]
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])
    ang = pos.double()[:, None, None] * theta ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((z.real, z.imag), -1)


def oracle(m, x, cu):
    """``(y, topk)`` in float64 from the module's parameters and the dense references."""
    T = x.shape[0]
    N1, N2, Dqk, Dv = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim
    l, d, lb = m.compress_block_size, m.compress_stride, m.select_block_size
    q = F.linear(x, m.q_proj.weight).view(T, N1, Dqk)
    k_c, v_c, k_s, v_s, k_w, v_w = (t.reshape(T, N2, -1) for t in
                                    F.linear(x, m.kv_proj.weight).split([N2 * Dqk, N2 * Dv] * 3, -1))
    pos = torch.cat([torch.arange(cu[b + 1] - cu[b]) for b in range(len(cu) - 1)])
    if m.rope_theta is not None:
        q, k_s, k_w = (_rope(t, pos, m.rope_theta) for t in (q, k_s, k_w))
    phi = None if m.compressor == "mean" else (m.k_compressor, m.v_compressor)
    kc, vc, cu_cmp = R.compress_kv(k_c, v_c, cu, l, d, compressor=phi)
    if m.rope_theta is not None:
        kc = _rope(kc, torch.cat([torch.arange(cu_cmp[b + 1] - cu_cmp[b]) * d for b in range(len(cu) - 1)]),
                   m.rope_theta)
    o_cmp, lse = R.compressed_attention(q, kc, vc, cu, cu_cmp, l, d, m.scale)
    topk = R.select_blocks(q.detach(), kc.detach(), lse.detach(), cu, cu_cmp, l, d, lb, m.select_count,
                           m.init_blocks, m.local_blocks, m.scale)
    o_slc = R.selected_attention(q, k_s, v_s, topk, cu, lb, m.scale)
    o_win = R.sliding_window_attention(q, k_w, v_w, cu, m.window_size, m.scale)
    g = torch.sigmoid(F.linear(x, m.gate_proj.weight, m.gate_proj.bias)).view(T, N1, 3)
    on = [b in m.branches for b in ("cmp", "slc", "win")]
    o = sum(g[..., i:i + 1] * oi for i, oi in enumerate((o_cmp, o_slc, o_win)) if on[i])
    return F.linear(o.reshape(T, N1 * Dv), m.o_proj.weight), topk


def _module(kwargs, dtype=torch.float64, seed=0, **extra):
    torch.manual_seed(seed)
    m = NativeSparseAttention(32, **kwargs, **extra, dtype=dtype)
    with torch.no_grad():  # spread the scores so that the selection is decided by clear margins
        m.q_proj.weight.mul_(4)
        m.gate_proj.bias.normal_()
    return m


def _x(T, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 32, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_float64_against_oracle(cfg):
    _, kwargs, cu = cfg
    m = _module(kwargs)
    x = _x(cu[-1])
    y, info = m(x, torch.tensor(cu, dtype=torch.int32), return_info=True)
    y_ref, topk_ref = oracle(m, x, cu)
    assert torch.equal(info["topk_indices"], topk_ref)
    assert info["gates"].shape == (cu[-1], m.num_heads, 3)
    assert_close(y, y_ref, name="y")
    dy = torch.randn_like(y)
    params = [x, *m.parameters()]
    got = torch.autograd.grad(y, params, dy)
    want = torch.autograd.grad(y_ref, params, dy)
    names = ["x", *(n for n, _ in m.named_parameters())]
    for name, a, e in zip(names, got, want):
        assert_close(a, e, name=f"d{name}")


def _rounded(kwargs, cu, dtype):
    """``(m, x, y_ref, topk_ref, m32, x32)``: the float64 module and input holding values rounded to ``dtype``, the
    oracle's output and selection on them, and fp32 copies of the module and the input."""
    m = _module(kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(dtype))
    x = _x(cu[-1]).detach().to(dtype).double().requires_grad_()
    y_ref, topk_ref = oracle(m, x, cu)
    return m, x, y_ref, topk_ref, copy.deepcopy(m).float(), x.detach().float().requires_grad_()


def _check_fp32_gradients(y, y_ref, m, x, m32, x32, tolerance_dtype):
    """x's and every parameter's gradient of the fp32 copies (in fp32) against the oracle's, within
    ``tolerance_dtype``'s tolerance."""
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(y, [x32, *m32.parameters()], dy.to(y.dtype))
    want = torch.autograd.grad(y_ref, [x, *m.parameters()], dy)
    for name, a, e in zip(["x", *(n for n, _ in m.named_parameters())], got, want):
        assert a.dtype == torch.float32, name
        assert_close(a, e, dtype=tolerance_dtype, name=f"d{name}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_fp32_against_oracle(cfg):
    """An fp32 module (G = 16: the branches' C++ kernels) against the float64 oracle on the same values: the
    selection, y, and x's and every parameter's gradient within the fp32 tolerance."""
    _, kwargs, cu = cfg
    m, x, y_ref, topk_ref, m32, x32 = _rounded(kwargs, cu, torch.float32)
    y, info = m32(x32, torch.tensor(cu, dtype=torch.int32), return_info=True)
    assert y.dtype == torch.float32
    assert torch.equal(info["topk_indices"], topk_ref)
    assert_close(y, y_ref, name="y")
    _check_fp32_gradients(y, y_ref, m, x, m32, x32, torch.float32)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=[CONFIGS[0][0], CONFIGS[3][0]])
def test_causal_bitwise(cfg):
    _, kwargs, _ = cfg
    m = _module(kwargs)
    T, t0 = 200, 131
    x1 = _x(T)
    x2 = x1.detach().clone()
    x2[t0:] += torch.randn(T - t0, 32, dtype=torch.float64)
    x2.requires_grad_()
    dy = torch.randn(T, 32, dtype=torch.float64)
    dy[t0:] = 0
    res = []
    for x in (x1, x2):
        y = m(x)
        res.append((y.detach(), torch.autograd.grad(y, [x, *m.parameters()], dy)))
    assert torch.equal(res[0][0][:t0], res[1][0][:t0])
    assert torch.equal(res[0][1][0][:t0], res[1][1][0][:t0])
    for a, b in zip(res[0][1][1:], res[1][1][1:]):
        assert torch.equal(a, b)


def test_packing_invariance():
    _, kwargs, _ = CONFIGS[3]
    m = _module(kwargs)
    cu = [0, 70, 71, 71, 171]
    x = _x(cu[-1])
    dy = torch.randn(cu[-1], 32, dtype=torch.float64)
    y = m(x, cu)
    (dx,) = torch.autograd.grad(y, x, dy)
    for b in range(len(cu) - 1):
        xb = x.detach()[cu[b]:cu[b + 1]].clone().requires_grad_()
        yb = m(xb)
        (dxb,) = torch.autograd.grad(yb, xb, dy[cu[b]:cu[b + 1]])
        assert_close(y[cu[b]:cu[b + 1]], yb, name=f"y of sequence {b}")
        assert_close(dx[cu[b]:cu[b + 1]], dxb, name=f"dx of sequence {b}")


def test_gradcheck_tiny():
    # 20 tokens, l' = 16: 2 selection blocks and n = 2, so the selection is fixed and the layer is smooth
    torch.manual_seed(0)
    m = NativeSparseAttention(8, 2, 1, 4, compress_block_size=4, compress_stride=2, select_block_size=16,
                              select_count=2, local_blocks=1, window_size=5, rope_theta=100.0, dtype=torch.float64)
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: m(x, [0, 13, 20]), (x,), fast_mode=True)


def test_window_only_branches():
    _, kwargs, cu = CONFIGS[2]
    m = _module(kwargs, branches=("win",))
    x = _x(cu[-1])
    y, info = m(x, cu, return_info=True)
    assert bool((info["gates"][..., :2] == 0).all()) and bool((info["gates"][..., 2] > 0).all())
    assert bool((info["topk_indices"] == -1).all())
    y_ref, _ = oracle(m, x, cu)
    assert_close(y, y_ref, name="y")


def test_short_sequences_only_window_and_selection():
    # every sequence shorter than l: no compressed block, o_cmp = 0; the selection is the token's own block
    _, kwargs, _ = CONFIGS[0]
    m = _module(kwargs)
    y, info = m(_x(30), [0, 10, 30], return_info=True)
    assert torch.equal(info["o_cmp"], torch.zeros_like(info["o_cmp"]))
    assert info["topk_indices"][:, 0].tolist() == [[0, -1, -1]] * 30
    assert bool(torch.isfinite(y).all())


BAD_INIT = [
    ("kv-heads-not-dividing", dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    ("G-33", dict(num_heads=66, num_kv_heads=2), "num_kv_heads"),
    ("stride-not-dividing-l", dict(compress_block_size=24, compress_stride=16), "compress_stride"),
    ("stride-not-dividing-lsel", dict(compress_block_size=48, compress_stride=48, select_block_size=64),
     "compress_stride"),
    ("n-below-forced", dict(select_count=2, init_blocks=1, local_blocks=2), "select_count"),
    ("lsel-24", dict(select_block_size=24, compress_block_size=8, compress_stride=8), "select_block_size"),
    ("dv-over-dqk", dict(head_dim=16, v_head_dim=32), "v_head_dim"),
    ("compressor-max", dict(compressor="max"), "compressor"),
    ("branches-unknown", dict(branches=("cmp", "sw")), "branches"),
    ("branches-empty", dict(branches=()), "branches"),
    ("branches-none", dict(branches=None), "branches"),
    ("branches-int", dict(branches=5), "branches"),
    ("rope-negative", dict(rope_theta=-1.0), "rope_theta"),
    ("window-0", dict(window_size=0), "window_size"),
]
BAD_INIT_TYPE = [
    ("dtype-int", dict(dtype=torch.int32), "dtype"),
]


@pytest.mark.parametrize("case", BAD_INIT + BAD_INIT_TYPE, ids=[c[0] for c in BAD_INIT + BAD_INIT_TYPE])
def test_bad_constructor_args(case):
    _, kwargs, name = case
    args = dict(num_heads=4, num_kv_heads=1)
    args.update(kwargs)
    with pytest.raises(TypeError if case in BAD_INIT_TYPE else ValueError, match=f"^{name}:"):
        NativeSparseAttention(32, **args)


def test_branches_from_any_iterable():
    m = NativeSparseAttention(32, 4, 1, 8, select_block_size=16, branches=iter(["win", "cmp"]))
    assert m.branches == ("cmp", "win")


BAD_CALL = [
    ("x-3d", dict(x=torch.zeros(1, 10, 32)), ValueError, "x"),
    ("x-width", dict(x=torch.zeros(10, 16)), ValueError, "x"),
    ("x-dtype", dict(x=torch.zeros(10, 32, dtype=torch.float64)), TypeError, "x"),
    ("x-sparse", dict(x=torch.zeros(10, 32).to_sparse()), TypeError, "x"),
    ("cu-no-leading-0", dict(cu_seqlens=[4, 10]), ValueError, "cu_seqlens"),
    ("cu-decreasing", dict(cu_seqlens=[0, 6, 3, 10]), ValueError, "cu_seqlens"),
    ("cu-not-ending-at-T", dict(cu_seqlens=torch.tensor([0, 9])), ValueError, "cu_seqlens"),
    ("return-info-int", dict(return_info=1), TypeError, "return_info"),
    ("x-meta", dict(x=torch.zeros(10, 32, device="meta")), ValueError, "x"),  # not the parameters' device
    ("cu-meta", dict(cu_seqlens=torch.tensor([0, 10], device="meta")), ValueError, "cu_seqlens"),
]


@pytest.mark.parametrize("case", BAD_CALL, ids=[c[0] for c in BAD_CALL])
def test_bad_call_args(case):
    _, kwargs, exc, name = case
    m = NativeSparseAttention(32, 4, 1, 8, select_block_size=16, compress_block_size=16, compress_stride=8)
    args = dict(x=torch.zeros(10, 32))
    args.update(kwargs)
    with pytest.raises(exc, match=f"^{name}:"):
        m(**args)


def test_bf16_autocast_against_oracle():
    """fp32 parameters under ``torch.autocast(bf16)``: the projections and the branches run in bf16 (their
    outputs and y in bf16), the oracle's selection, y and every gradient (in fp32, the parameters' dtype) within
    the bf16 tolerance of the float64 oracle on the bf16 values of x and the parameters."""
    _, kwargs, cu = CONFIGS[3]
    # the oracle's inputs: what autocast computes from, x and the parameters rounded to bf16
    m, x, y_ref, topk_ref, m32, x32 = _rounded(kwargs, cu, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, info = m32(x32, torch.tensor(cu, dtype=torch.int32), return_info=True)
    assert y.dtype == info["o_slc"].dtype == torch.bfloat16
    assert torch.equal(info["topk_indices"], topk_ref)
    # what a bf16 copy computes, bitwise: autocast re-types none of the ops' own fp32 products (the selection's
    # scores, the branches' accumulation)
    assert torch.equal(y, copy.deepcopy(m).bfloat16()(x.detach().bfloat16(), torch.tensor(cu, dtype=torch.int32)))
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    _check_fp32_gradients(y, y_ref, m, x, m32, x32, torch.bfloat16)
