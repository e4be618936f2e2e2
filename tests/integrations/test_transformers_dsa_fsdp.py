"""indexer_training under transformers' own FSDP2 (``DistributedConfig(fsdp_size=2)``, two spawned gloo processes).

Rank r loads a tiny fp32 deepseek_v32 checkpoint with ``attn_implementation="sparseops"`` and runs batch r inside
``indexer_training``; the oracle is one process running both batches. Each rank's indexer losses must equal the
oracle's for its batch, and the gathered gradients the oracle's gradients of the mean over the two batches:
- the warm-up's way (docs/dsa.md): every parameter but the indexers' frozen, ``sum(losses).backward()`` alone, no
  output of the model requiring grad (so FSDP2's own backward hooks never run);
- the sparse stage's way, ``(out.loss + sum(losses)).backward()``, under transformers' activation checkpointing,
  non-reentrant and reentrant: every parameter's gradient.
fp32, not float64: the model keeps some parameters in fp32, and FSDP2 takes one dtype per group.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")
pytest.importorskip("accelerate", reason="needs the sparseops[transformers] extra")
tdsa = pytest.importorskip("sparseops.integrations.transformers_dsa")

from sparseops.distributed import spawn  # noqa: E402
from sparseops.testing import assert_close  # noqa: E402

from .test_transformers_dsa import _model  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT = 240.0
#: (run, transformers' activation checkpointing kwargs or None)
RUNS = (("warm-up", None), ("sparse", {"use_reentrant": False}), ("sparse", {"use_reentrant": True}))


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 40, (1, n), generator=g) for n in (11, 8)]  # uneven lengths per rank


def _load(path, fsdp):
    from transformers.distributed import DistributedConfig

    kwargs = {"distributed_config": DistributedConfig(fsdp_size=2)} if fsdp else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=tdsa.NAME, experts_implementation="eager", **kwargs)
    return model.train()


def _step(model, run, ids, scale=1.0):
    """One forward and backward of ``run``; the indexer losses, detached."""
    if run == "warm-up":
        model.requires_grad_(False)
        for n, p in model.named_parameters():
            p.requires_grad_(".indexer." in n)
    with tdsa.indexer_training(model) as losses:
        out = model(ids, labels=ids)
        loss = sum(losses) if run == "warm-up" else out.loss + sum(losses)
        (loss * scale).backward()
    return [x.detach() for x in losses]


def _grads(model):
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world_size, path):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    out = []
    for run, kwargs in RUNS:
        model = _load(path, fsdp=True)
        if kwargs is not None:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        losses = _step(model, run, _batches()[rank])
        out.append((losses, _grads(model)))
    return out


def test_indexer_training_under_fsdp2_matches_one_process(tmp_path):
    _model("deepseek_v32").float().save_pretrained(tmp_path)
    results = spawn(_worker, 2, str(tmp_path), timeout=TIMEOUT, threads=1)
    for i, (run, kwargs) in enumerate(RUNS):
        model = _load(str(tmp_path), fsdp=False)
        # FSDP2 averages the gradients over the 2 data-parallel ranks
        ref_losses = [_step(model, run, ids, scale=0.5) for ids in _batches()]
        ref_grads = _grads(model)
        assert len(ref_losses[0]) == 2 and any(".indexer." in n for n in ref_grads)
        assert all(".indexer." in n for n in ref_grads) == (run == "warm-up")
        for rank, res in enumerate(results):
            losses, grads = res[i]
            where = f"{run} {kwargs} rank {rank}"
            assert len(losses) == len(ref_losses[rank]), where
            for j, (a, b) in enumerate(zip(losses, ref_losses[rank])):
                assert_close(a, b, torch.float32, f"{where} loss {j}")
            assert grads.keys() == ref_grads.keys(), where
            for n, g in ref_grads.items():
                assert_close(grads[n], g, torch.float32, f"{where} d{n}")
