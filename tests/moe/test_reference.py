"""The CANN doc test vectors of docs/moe.md, verbatim, on the reference and the torch backend."""

import pytest
import torch

from sparseops import (
    moe_token_permute_with_ep,
    moe_token_permute_with_ep_grad,
    moe_token_unpermute_with_ep,
    moe_token_unpermute_with_ep_grad,
)

BACKENDS = ["torch", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_doc_example(backend):
    tokens = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    indices = torch.tensor([[1, 2], [3, 1], [2, 3]], dtype=torch.int32)
    probs = torch.tensor([[0.5, 0.3], [0.4, 0.2], [0.5, 0.4]])
    out, si, pp = moe_token_permute_with_ep(tokens, indices, probs, [1, 5], backend=backend)
    assert si.dtype == torch.int32
    assert si.tolist() == [0, 2, 4, 1, 3, 5]
    assert torch.equal(out, torch.tensor([[0.2] * 4, [0.1] * 4, [0.3] * 4, [0.2] * 4]))
    assert torch.equal(pp, torch.tensor([0.2, 0.3, 0.5, 0.4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpermute_of_doc_example(backend):
    # the permute example's window fed back: slots 0 and 5 (rows 0 and 5) are outside [1, 5)
    pt = torch.tensor([[0.2] * 4, [0.1] * 4, [0.3] * 4, [0.2] * 4], dtype=torch.float64)
    si = torch.tensor([0, 2, 4, 1, 3, 5], dtype=torch.int32)
    probs = torch.tensor([[0.5, 0.3], [0.4, 0.2], [0.5, 0.4]], dtype=torch.float64)
    out = moe_token_unpermute_with_ep(pt, si, probs, range=[1, 5], backend=backend)
    want = torch.tensor([[0.3 * 0.1] * 4, [0.4 * 0.2 + 0.2 * 0.2] * 4, [0.5 * 0.3] * 4], dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpermute_grad_doc_vector(backend):
    ptg, pg = moe_token_unpermute_with_ep_grad(
        torch.ones(1, 2), torch.tensor([0, 1, 2], dtype=torch.int32), torch.ones(3, 2), torch.ones(1, 3),
        backend=backend,
    )
    assert torch.equal(ptg, torch.ones(3, 2))
    assert torch.equal(pg, torch.tensor([[2.0, 2.0, 2.0]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_grad_doc_vector(backend):
    tg, pg = moe_token_permute_with_ep_grad(
        torch.tensor([[2.0, 2], [1, 1], [3, 3], [2, 2]]),
        torch.tensor([2, 0, 4, 1, 5, 3], dtype=torch.int32),
        torch.tensor([0.2, 0.5, 0.4, 0.4]),
        2,
        [1, 5],
        backend=backend,
    )
    assert torch.equal(tg, torch.tensor([[1.0, 1], [4, 4], [3, 3]]))
    assert torch.equal(pg, torch.tensor([[0.5, 0.0], [0.4, 0.2], [0.0, 0.4]]))
