"""parallelize: spawned gloo runs of the NSA + MoE LM against the one-process float64 oracle.

Each run takes a few AdamW steps with gradient clipping and update_expert_bias on the global batch split over
the ranks; its losses, every parameter's gradient at the first step and every parameter at the end must be the
one-process run's (the global batch in one process), never another parallel run's. One spawn per layout runs
every check of that layout (process start-up dominates the time).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparseops.distributed import ParallelDims, clip_grad_norm_, parallelize, spawn
from sparseops.models.lm import CausalLM, LMConfig
from sparseops.nn import update_expert_bias
from sparseops.testing import TRAINING_TOLERANCE, rel_rms_error

pytestmark = pytest.mark.distributed

#: 2 layers (dense, MoE), 4 experts of which 2 per token, the balancing bias on; windows and blocks of 16
CFG = LMConfig(vocab_size=24, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16,
               num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3)
SEQ, BATCH, STEPS, SEED = 32, 4, 3, 0
TIMEOUT = 240.0


def _model() -> CausalLM:
    torch.manual_seed(SEED)
    return CausalLM(CFG, dtype=torch.float64)


def _batch(step: int, rank: int, world: int):
    """This rank's equal share of the global batch of ``step`` (a function of the seed and the step only)."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    per = BATCH // world
    mine = tokens[rank * per:(rank + 1) * per]
    cu = (torch.arange(per + 1) * SEQ).tolist()
    return mine[:, :-1].reshape(-1), mine[:, 1:].reshape(-1), cu


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rank: int, world: int) -> dict:
    """STEPS AdamW steps; each rank's loss is the mean over its share (+ the MoE aux loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], None
    for step in range(STEPS):
        tokens, targets, cu = _batch(step, rank, world)
        logits, aux = model(tokens, cu)
        loss = F.cross_entropy(logits, targets) + aux
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, rate=1e-2)
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(float(value) / world)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return {"loss": losses, "grads": grads, "params": params, "bias": bias}


def _worker(rank: int, world: int, layouts: list) -> list:
    out = []
    for dp_replicate, ep, data_parallel in layouts:
        model = parallelize(_model(), ParallelDims(dp_replicate=dp_replicate, ep=ep), data_parallel=data_parallel)
        out.append(_train(model, rank, world))
    return out


@pytest.fixture(scope="module")
def oracle() -> dict:
    return _train(_model(), 0, 1)


def _check(run: dict, oracle: dict, what: str) -> None:
    for a, b in zip(run["loss"], oracle["loss"]):
        assert abs(a - b) <= TRAINING_TOLERANCE * abs(b), f"{what}: losses {run['loss']} vs {oracle['loss']}"
    for kind in ("grads", "params", "bias"):
        assert run[kind].keys() == oracle[kind].keys()
        for name, ref in oracle[kind].items():
            err = rel_rms_error(run[kind][name], ref)
            assert err <= TRAINING_TOLERANCE, f"{what}: {kind} {name}: relative error {err:.2e}"


def test_w2_fsdp_and_ddp_ep2(oracle):
    layouts = [(1, 2, "fsdp"), (1, 2, "ddp")]
    results = spawn(_worker, 2, layouts, timeout=TIMEOUT)
    for (dp_replicate, ep, data_parallel), run in zip(layouts, results[0], strict=True):
        assert dp_replicate == 1
        _check(run, oracle, f"W=2 {data_parallel} ep={ep}")
