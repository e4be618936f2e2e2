"""Expert-parallel training against the one-process run (spawned gloo processes), and the gradient norm."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.train import demo_setup, grad_norm_sq, train, train_expert_parallel

STEPS = 4
TIMEOUT = 300.0


def _losses(r: dict) -> torch.Tensor:
    return torch.tensor(r["loss"], dtype=torch.float64)


@pytest.mark.distributed
def test_ep_modes_against_one_process():
    """float64 (fp32, where the compiled CPU kernels take part, is the demo test's): replicated + alltoall is
    bitwise; the other configurations add in another order: equal up to rounding."""
    dtype = torch.float64
    task, model_cfg, cfg = demo_setup(quick=True, steps=STEPS)
    one = _losses(train(model_cfg, task, cfg, dtype=dtype))
    exact = train_expert_parallel(model_cfg, task, cfg, 2, dtype=dtype, timeout=TIMEOUT)
    assert torch.equal(_losses(exact), one)
    tol = 1e-12
    for mode, dispatcher in (("data", "alltoall"), ("replicated", "allgather")):
        r = train_expert_parallel(model_cfg, task, cfg, 2, dtype=dtype, ep_mode=mode, dispatcher=dispatcher,
                                  timeout=TIMEOUT)
        rel = ((_losses(r) - one).abs() / one.abs()).max().item()
        assert rel <= tol, f"{mode}/{dispatcher}: {rel}"


def test_grad_norm_sq_orders_terms_by_expert():
    """One process: the replicated terms, then one term per (expert parameter, expert)."""
    torch.manual_seed(0)
    rep = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    exp = [torch.zeros(4, 2, 3, requires_grad=True)]
    for p in rep + exp:
        p.grad = torch.randn_like(p, dtype=torch.float64).float()
    want = torch.stack([p.grad.pow(2).sum() for p in rep] + [g.pow(2).sum() for g in exp[0].grad.unbind(0)]).sum()
    assert torch.equal(grad_norm_sq(rep, exp), want)
    torch.testing.assert_close(grad_norm_sq(rep, exp).double(),
                               sum(p.grad.double().pow(2).sum() for p in rep + exp), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kw, match", [({"ep_mode": "tensor"}, "ep_mode: expected one of")])
def test_bad_ep_mode(kw, match):
    task, model_cfg, cfg = demo_setup(quick=True, steps=1)
    with pytest.raises(ValueError, match=match):
        train(model_cfg, task, cfg, **kw)
    with pytest.raises(ValueError, match=match):
        train_expert_parallel(model_cfg, task, cfg, 2, **kw)
