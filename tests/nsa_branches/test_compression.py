"""compress_kv against the float64 reference: block count C(L), mean pooling and a learned compressor, gradients,
packed sequences shorter than a block, bad input."""

import pytest
import torch

from sparseops.nsa_branches import compress_kv, reference
from sparseops.testing import assert_close

CASES = [
    # id: what edge it covers; cu_seqlens, l, d
    ("paper-32-16", [0, 100], 32, 16),
    ("packed-short-and-len0", [0, 31, 31, 64, 97], 32, 16),
    ("fla-l-eq-d", [0, 48, 80], 16, 16),
    ("all-shorter-than-l", [0, 3, 7], 8, 4),
]


def _kv(T, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, 2, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(T, 2, 6, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return k, v


def test_block_count_formula():
    k, v = _kv(64 + 3 + 31)
    _, _, cu_cmp = compress_kv(k, v, [0, 64, 67, 98], 32, 16)
    # L = 64: blocks [0, 32), [16, 48), [32, 64); L = 3: none; L = 31: none (shorter than l)
    assert cu_cmp.tolist() == [0, 3, 3, 3]
    assert cu_cmp.dtype == torch.int32


@pytest.mark.parametrize("learned", [False, True], ids=["mean", "mlp"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_float64_forward_backward(case, learned):
    _, cu, l, d = case
    k, v = _kv(cu[-1])
    phi = None
    if learned:
        torch.manual_seed(0)
        lin_k, lin_v = torch.nn.Linear(l * 8, 8).double(), torch.nn.Linear(l * 6, 6).double()
        phi = (lambda b: lin_k(b.permute(0, 2, 1, 3).flatten(2)), lambda b: lin_v(b.permute(0, 2, 1, 3).flatten(2)))
    kc, vc, cu_cmp = compress_kv(k, v, torch.tensor(cu), l, d, compressor=phi)
    kr, vr, cu_ref = reference.compress_kv(k, v, cu, l, d, compressor=phi)
    assert cu_cmp.tolist() == cu_ref
    assert_close(kc, kr, name="k_cmp")
    assert_close(vc, vr, name="v_cmp")
    if kc.numel():
        gk, gv = torch.randn_like(kc), torch.randn_like(vc)
        got = torch.autograd.grad((kc, vc), (k, v), (gk, gv))
        want = torch.autograd.grad((kr, vr), (k, v), (gk, gv))
        for name, a, e in zip(("dk", "dv"), got, want):
            assert_close(a, e, name=name)


def test_mean_is_the_block_average():
    k = torch.arange(8.0).view(8, 1, 1)
    kc, _, _ = compress_kv(k, k, None, 4, 2)
    assert kc.flatten().tolist() == [1.5, 3.5, 5.5]


BAD = [
    ("stride-not-dividing", dict(stride=3), ValueError, "stride"),
    ("block-size-0", dict(block_size=0), ValueError, "block_size"),
    ("cu-not-ending-at-T", dict(cu_seqlens=[0, 5]), ValueError, "cu_seqlens"),
    ("v-dtype", dict(v=torch.zeros(20, 1, 4, dtype=torch.float16)), TypeError, "v"),
    ("v-heads", dict(v=torch.zeros(20, 2, 4)), ValueError, "v"),
    ("v-head-dim-0", dict(v=torch.zeros(20, 1, 0)), ValueError, "v"),
    ("compressor-not-callable", dict(compressor=3), TypeError, "compressor"),
    ("compressor-wrong-shape", dict(compressor=lambda b: b.sum(1)[:, :, :2]), ValueError, "compressor"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    _, changes, exc, name = case
    args = dict(k=torch.zeros(20, 1, 4), v=torch.zeros(20, 1, 4), cu_seqlens=None, block_size=8, stride=4)
    args.update(changes)
    with pytest.raises(exc, match=f"^{name}:"):
        compress_kv(**args)
