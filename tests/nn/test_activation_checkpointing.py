"""Activation checkpointing and per-block torch.compile of an [RMSNorm, NSA or DSA, RMSNorm, MoELayer] block, in one
process, against the same block run plainly (float64).

The recompute re-runs the MoE layer's routing, statistics and dispatch and the attention's C++ kernels in the
backward; it must change no loss, gradient, parameter or balancing bias (bitwise: the same ops on the same
inputs), and must not count the routed slots a second time (``TopKRouter.local_tokens_per_expert``, what
``update_expert_bias`` reads). The layer runs with a shared expert, the load-balance and z losses, ``expert_bias``
and a capacity that drops slots; DSA's indexer loss is part of the loss. The distributed cases are
tests/distributed/test_activation_checkpointing.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from sparseops.nn import DeepSeekSparseAttention, MoELayer, NativeSparseAttention, update_expert_bias
from sparseops.testing import TRAINING_TOLERANCE

H, T, CU, STEPS = 16, 64, [0, 32, 64], 2
WRAPPED = "_checkpoint_wrapped_module."


class _Block(nn.Module):
    """``h + attn(norm(h))``, then ``h + moe(norm(h))``; returns ``(h, aux loss [+ indexer loss], MoEAux)``."""

    def __init__(self, attention: str):
        super().__init__()
        f64 = torch.float64
        self.norm1 = nn.RMSNorm(H, dtype=f64)
        if attention == "nsa":
            self.attn = NativeSparseAttention(H, 2, 1, 8, compress_block_size=16, compress_stride=16,
                                              select_block_size=16, select_count=3, window_size=16, dtype=f64)
        else:
            self.attn = DeepSeekSparseAttention(H, 2, 1, 8, topk=8, index_heads=2, index_head_dim=8, dtype=f64)
        self.dsa = attention == "dsa"
        self.norm2 = nn.RMSNorm(H, dtype=f64)
        # capacity 0.75 of the even share: some slots are dropped every step
        self.moe = MoELayer(H, 8, 4, 2, shared_ffn_size=8, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, expert_bias=True,
                            capacity_factor=0.75, dtype=f64)

    def forward(self, h, cu):
        extra = h.new_zeros(())
        if self.dsa:
            a, info = self.attn(self.norm1(h), cu, return_info=True)
            extra = info["indexer_loss"]
        else:
            a = self.attn(self.norm1(h), cu)
        h = h + a
        y, aux = self.moe(self.norm2(h))
        return h + y, aux.loss + extra, aux


class _Call(nn.Module):
    """``torch.utils.checkpoint.checkpoint(block, ...)`` inside the forward, as a model's loop over blocks does."""

    def __init__(self, block: nn.Module, use_reentrant: bool):
        super().__init__()
        self.block, self.use_reentrant = block, use_reentrant

    def forward(self, h, cu):
        return checkpoint(self.block, h, cu, use_reentrant=self.use_reentrant)


def _prepare(block: _Block, how: str) -> nn.Module:
    if how == "function":
        return _Call(block, use_reentrant=False)
    if how == "function_reentrant":
        return _Call(block, use_reentrant=True)
    if how == "wrapper_block":
        return checkpoint_wrapper(block)
    if how == "wrapper_moe":
        block.moe = checkpoint_wrapper(block.moe)
    elif how == "composable":
        composable_checkpoint(block)
    elif how == "composable_moe":
        composable_checkpoint(block.moe)
    return block


def _name(n: str) -> str:
    return n.replace(WRAPPED, "").replace("_orig_mod.", "").removeprefix("block.")


def _run(attention: str, prepare=lambda b: b) -> dict:
    """STEPS AdamW steps with update_expert_bias; what each step leaves and the parameters and biases at the end."""
    torch.manual_seed(0)
    model = prepare(_Block(attention))
    routers = [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"loss": [], "grads": [], "x_grad": [], "counts": [], "aux": []}
    for _ in range(STEPS):
        h, loss, aux = model(x, CU)
        total = h.pow(2).mean() + loss
        total.backward()
        out["loss"].append(total.detach())
        out["grads"].append({_name(n): p.grad.clone() for n, p in model.named_parameters()})
        out["x_grad"].append(x.grad.clone())
        out["counts"].append([r.local_tokens_per_expert.clone() for r in routers])  # after the recompute
        out["aux"].append((aux.tokens_per_expert.clone(), aux.dropped))
        x.grad = None
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, rate=1e-2)
    out["params"] = {_name(n): p.detach().clone() for n, p in model.named_parameters()}
    out["bias"] = [r.expert_bias.clone() for r in routers]
    return out


def _assert_same(got: dict, want: dict, what: str, tol: float = 0.0) -> None:
    """Bitwise (``tol = 0``), else every tensor within ``tol`` relative RMS; the counts always exactly."""

    def close(a, b, name):
        if tol == 0.0:
            assert torch.equal(a, b), f"{what}: {name} differs"
        else:
            err = (a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)
            assert err <= tol, f"{what}: {name}: relative error {float(err):.2e}"

    for s in range(STEPS):
        close(got["loss"][s], want["loss"][s], f"loss {s}")
        close(got["x_grad"][s], want["x_grad"][s], f"x gradient {s}")
        assert got["grads"][s].keys() == want["grads"][s].keys(), what
        # the compressors' key bias gradient is zero in exact arithmetic (rounding noise): compared against a floor
        floor = 1e-6 * torch.cat([g.reshape(-1) for g in want["grads"][s].values()]).pow(2).mean().sqrt()
        for n, g in want["grads"][s].items():
            if tol == 0.0 or g.pow(2).mean().sqrt() > floor:
                close(got["grads"][s][n], g, f"gradient {n} at step {s}")
        for a, b in zip(got["counts"][s], want["counts"][s], strict=True):
            assert torch.equal(a, b), f"{what}: routed slots counted {a.tolist()}, expected {b.tolist()} (step {s})"
        assert torch.equal(got["aux"][s][0], want["aux"][s][0]) and got["aux"][s][1] == want["aux"][s][1], what
    for n, p in want["params"].items():
        close(got["params"][n], p, f"parameter {n}")
    for a, b in zip(got["bias"], want["bias"], strict=True):
        assert torch.equal(a, b), f"{what}: expert_bias differs"


@pytest.fixture(scope="module")
def plain() -> dict:
    return {attention: _run(attention) for attention in ("nsa", "dsa")}


@pytest.mark.parametrize("how", ["function", "function_reentrant", "wrapper_block", "wrapper_moe", "composable",
                                 "composable_moe"])
@pytest.mark.parametrize("attention", ["nsa", "dsa"])
def test_checkpointed_block_is_bitwise_the_plain_block(plain, attention, how):
    """Every AC API around the block or the MoE layer alone: bitwise the plain run, the routed slots counted once
    (the recompute used to add them again: twice the counts in ``local_tokens_per_expert``)."""
    want = plain[attention]
    assert all(d > 0 for _, d in want["aux"])  # the capacity drops slots: the sink path is recomputed too
    _assert_same(_run(attention, lambda b: _prepare(b, how)), want, f"{attention}, {how}")


def test_compiled_block_with_and_without_checkpointing(plain):
    """Per-block torch.compile (not fullgraph, torchtitan's), alone, after checkpoint_wrapper (torchtitan's order)
    and under it (a compiled block recomputed by the checkpoint): the plain eager run's values within
    TRAINING_TOLERANCE, the routed slots counted once. AOT autograd's backend: inductor's code generation takes
    minutes on a small CPU machine and is not what the checkpointing changes."""
    import torch._dynamo

    def compiled(block, ac_first):
        if ac_first:
            block = checkpoint_wrapper(block)
            block.compile(backend="aot_eager")
            return block
        block.compile(backend="aot_eager")
        return checkpoint_wrapper(block) if ac_first is False else block

    for ac_first, what in ((None, "compile"), (True, "checkpoint_wrapper, then compile"),
                           (False, "compile, then checkpoint_wrapper")):
        torch._dynamo.reset()
        _assert_same(_run("nsa", lambda b, a=ac_first: compiled(b, a)), plain["nsa"], what, TRAINING_TOLERANCE)
