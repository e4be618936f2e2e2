"""indexer_training under transformers' own FSDP2 (``DistributedConfig(fsdp_size=2)``, two spawned gloo processes).

Rank r loads a tiny fp32 deepseek_v32 checkpoint with ``attn_implementation="sparseops"`` and runs batch r inside
``indexer_training``; the oracle is one process running both batches. Each rank's indexer losses must equal the
oracle's for its batch, and the gathered gradients the oracle's gradients of the mean over the two batches:
- the warm-up's way (docs/dsa.md): every parameter but the indexers' frozen, ``sum(losses).backward()`` alone, no
  output of the model requiring grad (so FSDP2's own backward hooks never run);
- the sparse stage's way, ``(out.loss + sum(losses)).backward()``, under transformers' activation checkpointing,
  non-reentrant and reentrant: every parameter's gradient;
- the sparse stage under FSDP2's mixed precision (``fsdp_mixed_precision=True``: bf16 parameters in the layers):
  the losses and every gradient as close to the fp32 oracle's as a bf16 copy of the model in one process.
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
from sparseops.testing import TOLERANCES, assert_close, rel_rms_error  # noqa: E402

from .test_transformers_dsa import _model  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT = 240.0
#: (run, transformers' activation checkpointing kwargs or None, FSDP2's bf16 mixed precision)
RUNS = (("warm-up", None, False), ("sparse", {"use_reentrant": False}, False),
        ("sparse", {"use_reentrant": True}, False), ("sparse", None, True))


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 40, (1, n), generator=g) for n in (11, 8)]  # uneven lengths per rank


def _load(path, fsdp, mixed=False):
    from transformers.distributed import DistributedConfig

    kwargs = {"distributed_config": DistributedConfig(fsdp_size=2, fsdp_mixed_precision=mixed)} if fsdp else {}
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
    for run, kwargs, mixed in RUNS:
        model = _load(path, fsdp=True, mixed=mixed)
        if kwargs is not None:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        losses = _step(model, run, _batches()[rank])
        out.append((losses, _grads(model)))
    return out


def _oracle(path, run, dtype=torch.float32):
    """One process, both batches, each backward scaled by 1/2 (FSDP2 averages the gradients over the 2 ranks)."""
    model = _load(path, fsdp=False).to(dtype)
    losses = [_step(model, run, ids, scale=0.5) for ids in _batches()]
    return losses, _grads(model)


def _within_bf16(got, ref, floor, name):
    err, limit = rel_rms_error(got, ref), max(TOLERANCES[torch.bfloat16], 2 * rel_rms_error(floor, ref))
    assert err <= limit, f"{name}: relative RMS error {err:.3g} from fp32 > {limit:.3g} (a bf16 model's, doubled)"


def test_indexer_training_under_fsdp2_matches_one_process(tmp_path):
    _model("deepseek_v32").float().save_pretrained(tmp_path)
    results = spawn(_worker, 2, str(tmp_path), timeout=TIMEOUT, threads=1)
    for i, (run, kwargs, mixed) in enumerate(RUNS):
        ref_losses, ref_grads = _oracle(str(tmp_path), run)
        assert len(ref_losses[0]) == 2 and any(".indexer." in n for n in ref_grads)
        assert all(".indexer." in n for n in ref_grads) == (run == "warm-up")
        if mixed:
            floor_losses, floor_grads = _oracle(str(tmp_path), run, torch.bfloat16)
        for rank, res in enumerate(results):
            losses, grads = res[i]
            where = f"{run} {kwargs}{' bf16' * mixed} rank {rank}"
            assert len(losses) == len(ref_losses[rank]), where
            assert grads.keys() == ref_grads.keys(), where
            for j, (a, b) in enumerate(zip(losses, ref_losses[rank])):
                if mixed:
                    _within_bf16(a, b, floor_losses[rank][j], f"{where} loss {j}")
                else:
                    assert_close(a, b, torch.float32, f"{where} loss {j}")
            for n, g in ref_grads.items():
                if mixed:
                    _within_bf16(grads[n], g, floor_grads[n], f"{where} d{n}")
                else:
                    assert_close(grads[n], g, torch.float32, f"{where} d{n}")
