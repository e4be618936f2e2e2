"""Activation checkpointing and per-block torch.compile under parallelize (W = 2, ep = 2, gloo) against the
one-process float64 oracle.

The model is test_parallel.py's (two [RMSNorm, NSA, RMSNorm, MoE] blocks, one per dispatcher). The recompute
re-runs each MoE layer's statistics all-gather and its dispatch's collectives (all-gather / reduce-scatter, or
all-to-all) inside the backward, beside FSDP2's or DDP's own collectives: every run must end where the oracle
ends (losses, gradients at the first step, parameters and balancing biases after the AdamW steps, within
TRAINING_TOLERANCE), the checkpointed runs bitwise where the plain parallel run ends, and the routed slots must be
counted once (the recompute must not add to ``local_tokens_per_expert``). One spawn runs every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from sparseops.distributed import ParallelDims, parallelize, spawn
from sparseops.nn import TopKRouter

from .parallel_net import SEED, Net
from .parallel_net import model as _model
from .test_parallel import _batch, _check, _train

pytestmark = pytest.mark.distributed

TIMEOUT = 300.0


class _FunctionNet(Net):
    """``torch.utils.checkpoint.checkpoint(block, ...)`` in the forward's loop over the blocks."""

    use_reentrant = False

    def forward(self, tokens, cu):
        h = self.embed(tokens)
        aux = h.new_zeros(())
        for block in self.blocks:
            h, a = checkpoint(block, h, cu, use_reentrant=self.use_reentrant)
            aux = aux + a
        return F.linear(self.norm(h), self.embed.weight), aux


def _function_model(use_reentrant: bool) -> Net:
    torch.manual_seed(SEED)
    model = _FunctionNet()
    model.use_reentrant = use_reentrant
    return model


def _blocks(model, wrap=False, composable=False, compile=False, moe=False):
    """torchtitan's per-block steps, in its order: checkpoint each block (or each MoE layer), then compile it."""
    for i in range(len(model.blocks)):
        if wrap and moe:
            model.blocks[i].moe = checkpoint_wrapper(model.blocks[i].moe)
        elif wrap:
            model.blocks[i] = checkpoint_wrapper(model.blocks[i])
        if composable:
            composable_checkpoint(model.blocks[i])
        if compile:
            # AOT autograd without inductor's code generation (minutes on a small CPU machine)
            model.blocks[i].compile(backend="aot_eager")
    return model


def _counted_once(model, rank: int, world: int) -> bool:
    """One forward and backward: the routers' counts after the backward are those of the forward (the
    recompute routes again without counting); counts and gradients are cleared afterwards."""
    tokens, targets, cu = _batch(0, rank, world)
    logits, aux = model(tokens, cu)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    forward = [r.local_tokens_per_expert.clone() for r in routers]
    (F.cross_entropy(logits, targets) + aux).backward()
    once = all(torch.equal(r.local_tokens_per_expert, c) and c.sum() > 0 for r, c in zip(routers, forward))
    for r in routers:
        r.local_tokens_per_expert.zero_()
    for p in model.parameters():
        p.grad = None
    return once


def _cases(dp: str) -> dict:
    """name -> a function building the model of that case (parallelize inside, before or after the AC)."""

    def par(model):
        return parallelize(model, ParallelDims(ep=2), data_parallel=dp, timeout=TIMEOUT)

    cases = {
        "plain": lambda: par(_model()),
        "checkpoint_wrapper, then parallelize": lambda: par(_blocks(_model(), wrap=True)),
        "composable checkpoint, then parallelize": lambda: par(_blocks(_model(), composable=True)),
        "parallelize, then checkpoint_wrapper": lambda: _blocks(par(_model()), wrap=True),
        "parallelize, then composable checkpoint": lambda: _blocks(par(_model()), composable=True),
        "checkpoint() in forward": lambda: par(_function_model(False)),
        "checkpoint(use_reentrant=True) in forward": lambda: par(_function_model(True)),
        "compile": lambda: par(_blocks(_model(), compile=True)),
        "checkpoint_wrapper, compile, parallelize": lambda: par(_blocks(_model(), wrap=True, compile=True)),
    }
    if dp == "fsdp":
        cases["checkpoint_wrapper of the MoE layers, then parallelize"] = lambda: par(_blocks(_model(), wrap=True,
                                                                                              moe=True))
        cases["parallelize, checkpoint_wrapper, compile"] = lambda: _blocks(par(_model()), wrap=True, compile=True)
    return cases


def _worker(rank: int, world: int) -> tuple[dict, dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from .test_collectives import compiled_matches_eager

    out = {}
    for dp in ("fsdp", "ddp"):
        for name, make in _cases(dp).items():
            torch._dynamo.reset()
            graphs = counters["stats"]["unique_graphs"]
            model = make()
            once = _counted_once(model, rank, world)
            out[f"{dp}: {name}"] = {"counted_once": once, **_train(model, rank, world),
                                    "graphs": counters["stats"]["unique_graphs"] - graphs}
    return out, compiled_matches_eager(rank, world)


def _plain_names(run: dict) -> dict:
    """The one-process parameter names: without the wrappers' ``_checkpoint_wrapped_module.`` / ``_orig_mod.``."""
    out = dict(run)
    for kind in ("grads", "params", "bias"):
        out[kind] = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): t
                     for n, t in run[kind].items()}
    return out


@pytest.fixture(scope="module")
def w2() -> list:
    return spawn(_worker, 2, timeout=TIMEOUT)


def test_collectives_compiled_match_eager(w2):
    """test_collectives.compiled_matches_eager in this launch (dynamo is loaded here already)."""
    for rank, (_, collectives) in enumerate(w2):
        want = {name: [True, True] for name in ("all_gather", "reduce_scatter", "all_to_all")}
        assert collectives == want, rank


def test_checkpointed_and_compiled_blocks_match_the_one_process_run(w2):
    w2 = [runs for runs, _ in w2]
    oracle = _train(_model(), 0, 1)
    for rank in (0, 1):
        assert len(w2[rank]) == 2 * 9 + 2
        for what, run in w2[rank].items():
            run = _plain_names(run)
            assert run["counted_once"], f"{what}: the recompute counted the routed slots again"
            # the compile takes effect, except where a checkpoint wraps the block first: dynamo cannot place
            # MoELayer.forward's graph break inside its checkpoint operator and runs the block eagerly
            # (docs/training.md, "Activation checkpointing and torch.compile")
            compiled = "compile" in what and "checkpoint_wrapper" not in what
            assert (run["graphs"] > 0) == compiled, f"{what}: {run['graphs']} graphs compiled"
            if rank == 0:  # the losses, gradients and parameters are every rank's (full tensors)
                _check(run, oracle, f"W=2 ep=2 {what}")
            plain = _plain_names(w2[rank][what.split(":")[0] + ": plain"])
            if "compile" not in what:  # the recompute runs the same ops on the same inputs
                for kind in ("grads", "params", "bias"):
                    for n, t in plain[kind].items():
                        assert torch.equal(run[kind][n], t), f"{what}: {kind} {n} differs from the plain run"
                assert run["loss"] == plain["loss"], what
