"""training/loop.checkpoint_blocks: what `sparseops train --activation-checkpointing` (and `--compile`) builds."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from sparseops.models.train import build_model
from sparseops.training.loop import checkpoint_blocks

from ..models.test_lm import TINY


def test_checkpoint_blocks_compiles_each_block_inside_its_checkpoint():
    """With ``compile``, each block is compiled and then wrapped (a checkpoint around a block that holds an MoE layer
    would make dynamo run the block eagerly: docs/training.md, "Activation checkpointing and torch.compile"); the
    state dict keys stay the plain model's. Nothing compiles here: no forward runs."""
    plain = build_model(TINY, 0, torch.float32, "cpu")
    for compile in (False, True):
        model = build_model(TINY, 0, torch.float32, "cpu")
        checkpoint_blocks(model, compile=compile)
        assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
        inner = [b._checkpoint_wrapped_module for b in model.blocks]
        assert all((b._compiled_call_impl is not None) == compile for b in inner), compile
        assert model.state_dict().keys() == plain.state_dict().keys()
