"""The demo language model: a small causal LM of NSA attention and MoE FFNs, the associative-recall task it
learns, and its training loop (docs/demo.md)."""

from .lm import CausalLM, LMConfig
from .recall import RecallBatch, RecallTask
from .train import TrainConfig, demo_setup, train, train_expert_parallel

__all__ = ["CausalLM", "LMConfig", "RecallBatch", "RecallTask", "TrainConfig", "demo_setup", "train",
           "train_expert_parallel"]
