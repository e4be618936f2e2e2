"""The two stages of ``sparseops train --attention dsa --dsa-dense-steps N`` (docs/dsa.md, "The two stages in
``sparseops train``").

Steps ``[0, N)`` are DeepSeek-V3.2's dense warm-up: every :class:`sparseops.nn.DeepSeekSparseAttention` layer in
``dense_warmup`` mode (dense causal attention over every visible key, the indexer's KL over them) and every
parameter but the indexers' frozen by ``requires_grad`` off. Steps ``[N, steps)`` are the sparse stage. Why
``requires_grad`` rather than gradients dropped after backward:

- a frozen parameter gets no gradient (``None``), so AdamW skips it: no moment, no step count, no weight decay;
  it stays bitwise as it was, and its AdamW state starts fresh at step N;
- the LM and MoE losses have no graph (nothing they reach needs a gradient; the indexer reads ``x.detach()``), so
  the step's one backward trains the indexers by their losses alone, and no MoE layer's backward collective
  runs on any rank: every rank freezes the same parameters;
- FSDP2 reduce-scatters the gradients that exist (its unsharded parameters follow the sharded ones'
  ``requires_grad`` at every all-gather); DDP, whose buckets hold every parameter, is built with
  ``find_unused_parameters`` (:func:`ddp_options`) so that it does not wait for the frozen ones' gradients and
  leaves them ``None``.
"""

from __future__ import annotations

import os

import torch

from ..nn import DeepSeekSparseAttention
from . import checkpoint


def ddp_options(dense_steps: int, data_parallel: str) -> dict | None:
    """``parallelize``'s ``ddp_options`` for a run with ``dense_steps`` warm-up steps: DDP must find the frozen
    parameters unused (it is built before they are frozen, with every parameter in its buckets)."""
    return {"find_unused_parameters": True} if dense_steps and data_parallel == "ddp" else None


class Stages:
    """The stage of each step of ``model`` (built, parallelized): ``enter(step)`` before the step.

    ``replicated``, ``experts``: the model's parameters as the loop splits them (the routed experts apart).
    With ``dense_steps = 0`` it changes nothing."""

    def __init__(self, model: torch.nn.Module, dense_steps: int, replicated: list, experts: list):
        self.dense_steps = dense_steps
        self.layers = [m for m in model.modules() if isinstance(m, DeepSeekSparseAttention)]
        if dense_steps and not self.layers:
            raise ValueError(f"dense_steps: expected a model with DeepSeekSparseAttention layers for {dense_steps} "
                             "dense warm-up steps, got none")
        indexer = {id(p) for m in self.layers for p in m.indexer_parameters()}
        self.frozen = [p for p in model.parameters() if id(p) not in indexer]
        self.replicated, self.experts = replicated, experts
        self.warm: bool | None = None

    def enter(self, step: int) -> tuple[list, list]:
        """Put the model in the stage of ``step``; returns the parameters that train in it, ``(replicated,
        experts)``: the frozen ones have no gradient to clip or fill in."""
        if not self.dense_steps:
            return self.replicated, self.experts
        warm = step < self.dense_steps
        if warm != self.warm:
            for layer in self.layers:
                layer.dense_warmup = warm
            for p in self.frozen:
                p.requires_grad_(not warm)
            self.warm = warm
        if not warm:
            return self.replicated, self.experts
        return [p for p in self.replicated if p.requires_grad], [p for p in self.experts if p.requires_grad]

    def before_load(self, path: str | os.PathLike) -> None:
        """The stage of the last step the checkpoint ``path`` took (its ``train.step`` - 1): the optimizer state
        a load asks for is then the one the checkpoint holds. The frozen parameters have AdamW state only once a
        sparse step ran, and ``get_optimizer_state_dict`` of an optimizer without state makes one for every
        parameter that requires a gradient."""
        if self.dense_steps:
            self.enter(int(checkpoint.read_values(path, ["train.step"])["train.step"]) - 1)
