"""Forward-mode AD through the custom ops is a NotImplementedError naming the op (torch would run them without the
tangents: a zero derivative, silently); reverse mode, vmap and forward mode around the ops still work."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import sparseops
from sparseops.nsa_branches import compress_kv, compressed_attention, sliding_window_attention
from sparseops.testing import make_nsa_inputs

F64 = torch.float64


# made outside the transforms (vmap refuses random ops)
NSA = make_nsa_inputs([9, 7], N1=4, N2=2, Dqk=8, Dv=8, bs=16, K=1, dtype=F64)
Q, K, V = (NSA.pop(n) for n in ("query", "key", "value"))
OUT, M, L = sparseops.nsa_selected_attention(Q, K, V, **NSA)
KC, VC, CU_CMP = compress_kv(K, V, [0, 9, 16], 4, 2)


def _selected_grad(dout):
    a = dict(NSA)
    topk = a.pop("topk_indices")
    return sparseops.nsa_selected_attention_grad(Q, K, V, OUT, dout, M, L, topk, **a)[0]


IDX = torch.tensor([[0, 2], [1, 0], [2, 1]])
SI = sparseops.moe_token_permute_with_ep(torch.zeros(3, 1), IDX)[1]

#: (public name, a function of one float64 tensor through the op, that tensor's shape)
CASES = [
    ("moe_token_permute_with_ep", lambda t: sparseops.moe_token_permute_with_ep(t, IDX)[0], (3, 4)),
    ("moe_token_unpermute_with_ep", lambda t: sparseops.moe_token_unpermute_with_ep(t, SI, topk_num=2), (6, 4)),
    ("moe_token_unpermute_with_ep_grad", lambda t: sparseops.moe_token_unpermute_with_ep_grad(t, SI, topk_num=2)[0],
     (3, 4)),
    ("moe_token_permute_with_ep_grad", lambda t: sparseops.moe_token_permute_with_ep_grad(t, SI, topk_num=2)[0],
     (6, 4)),
    ("nsa_selected_attention", lambda q: sparseops.nsa_selected_attention(q, K, V, **NSA)[0], (16, 4, 8)),
    ("nsa_selected_attention_grad", _selected_grad, (16, 4, 8)),
    ("sliding_window_attention", lambda q: sliding_window_attention(q, K, V, [0, 9, 16], 3), (16, 4, 8)),
    ("compressed_attention", lambda q: compressed_attention(q, KC, VC, [0, 9, 16], CU_CMP, 4, 2)[0], (16, 4, 8)),
]


@pytest.mark.parametrize("name, fn, shape", CASES, ids=[c[0] for c in CASES])
def test_forward_mode_ad_is_a_clear_error(name, fn, shape):
    x = torch.randn(shape, dtype=F64)
    with pytest.raises(NotImplementedError, match=f"^{name}: forward-mode AD"):
        torch.func.jvp(fn, (x,), (torch.ones_like(x),))
    with pytest.raises(NotImplementedError, match=f"^{name}: forward-mode AD"):
        with fwAD.dual_level():
            fn(fwAD.make_dual(x, torch.ones_like(x)))
    # what still works: the op on tensors without a tangent inside forward mode, vmap, reverse mode (not through
    # the grad ops: no double backward)
    with fwAD.dual_level():
        y = fn(x)
    assert torch.equal(y, fn(x))
    _, tangent = torch.func.jvp(lambda s: s * fn(x).sum(), (torch.ones((), dtype=F64),), (torch.ones((), dtype=F64),))
    assert tangent == fn(x).sum()
    assert torch.equal(torch.func.vmap(fn)(torch.stack([x, 2 * x])), torch.stack([fn(x), fn(2 * x)]))
    if not name.endswith("_grad"):
        xr = x.clone().requires_grad_()
        fn(xr).sum().backward()
        assert xr.grad is not None
