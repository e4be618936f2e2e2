"""transformers' own ``Trainer`` on the sparseops backends: two AdamW steps with ``gradient_checkpointing=True`` of a
tiny float64 model give the training loss and every parameter of the same steps on transformers' own backends.
Qwen3-MoE: ``experts_implementation="sparseops"`` against eager; GLM-MoE-DSA: ``attn_implementation`` and
``experts_implementation`` ``"sparseops"`` against sdpa and eager experts."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")
pytest.importorskip("accelerate", reason="needs the sparseops[transformers] extra")

import sparseops.integrations.transformers  # noqa: E402, F401
from sparseops.testing import assert_close  # noqa: E402

from .test_transformers_dsa import _model as dsa_model  # noqa: E402
from .test_transformers_experts import tiny_model  # noqa: E402

#: family -> ((attn_implementation, experts_implementation) of ours, of transformers')
RUNS = {"qwen3_moe": ((None, "sparseops"), (None, "eager")),
        "glm_moe_dsa": (("sparseops", "sparseops"), ("sdpa", "eager"))}
#: the flag's name: ``gradient_checkpointing`` became ``activation_checkpointing`` in transformers 5.25
CHECKPOINTING = next(f for f in ("activation_checkpointing", "gradient_checkpointing")
                     if f in transformers.TrainingArguments.__dataclass_fields__)


def _train(model, attn, experts, out_dir):
    if attn is not None:
        model.set_attn_implementation(attn)
    model.set_experts_implementation(experts)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (8, 12), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, warmup_steps=0,
        **{CHECKPOINTING: True}, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return result.training_loss, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(RUNS))
def test_trainer_steps_match_transformers_backends(family, tmp_path):
    build = (lambda: tiny_model(family)) if family == "qwen3_moe" else (lambda: dsa_model(family).train())
    ours, theirs = (_train(build(), *impls, tmp_path / str(i)) for i, impls in enumerate(RUNS[family]))
    before = dict(build().named_parameters())
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12), "training loss"
    assert ours[1].keys() == theirs[1].keys()
    moved = 0
    for n, p in theirs[1].items():
        assert_close(ours[1][n], p, torch.float64, f"{n} after 2 steps")
        moved += not torch.equal(p, before[n])
    assert moved > len(before) // 2  # the steps did train
