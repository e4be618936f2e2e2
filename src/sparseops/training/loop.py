"""The training loop of ``sparseops train``: the LM of ``sparseops.models`` on one process or on every rank of a
``torchrun`` job, parallelized by :func:`sparseops.distributed.parallelize` (docs/training.md).

One step, at every layout alike (and bitwise the one-process ``sparseops.models.train.train`` in one process
with one micro-batch):

    every rank, for each micro-batch m of M (the global batch's sequences [m*B/M, (m+1)*B/M)): its share of it ->
        forward -> ce_rm = sum of its cross-entropies, aux_rm; backward of ce_rm / (n / W) + aux_rm / M (the mean
        over the rank's equal share; parallelize averages over W), the last micro-batch's after the all-reduce
    one all-reduce, after the last forward, of [sum_m ce_rm, mean_m aux_rm, nonfinite_r one-hot over the ranks]:
        the global loss (the aux terms' mean over the ranks: DSA's indexer loss is each rank's own tokens' mean),
        and a stop on every rank, naming the step and the ranks, when any rank's loss is not finite (before the
        last backward and the step)
    clip the global gradient norm (in one process the demo's sum, one term per parameter and per expert; on W
        ranks sparseops.distributed.clip_grad_norm_ across the meshes), stop on every rank when it is not
        finite; AdamW step; LambdaLR step (linear warm-up, cosine to 0)
    checkpoint every S steps and at the end (training/checkpoint.py)

With ``--attention dsa --dsa-dense-steps N`` the steps before N are DSA's dense warm-up: the same step with every
DSA layer dense and every parameter but the indexers' frozen (training/dsa_warmup.py).

Every micro-batch's backward reduces its gradients (FSDP2's reduce-scatter, DDP's all-reduce): the gradients stay
sharded between micro-batches, and the composable DDP has no ``no_sync`` (docs/training.md, "One step").

Collectives are bounded by ``--comm-timeout``: the process group's timeout, given to every group the layout
makes (``parallelize(timeout=)``), so a rank that stops responding makes its peers raise instead of wait
(training/faults.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import ParallelDims, clip_grad_norm_, parallelize
from ..models.lm import LMConfig, expert_parameter
from ..models.recall import IGNORE_INDEX, RecallTask
from ..models.train import TrainConfig, build_model, grad_norm_sq, lr_factor, recall
from . import checkpoint
from .data import RecallStream, TokenFile
from .dsa_warmup import Stages, ddp_options
from .faults import (
    TrainingStopped,
    collective_failure,
    evaluation_memory_failure,
    evaluation_where,
    fault_from_env,
    inject,
    memory_failure,
    nonfinite_ranks,
    out_of_memory,
)

#: ``Layout.data_parallel``: parallelize's two (``"fsdp"``, ``"ddp"``), or ``"none"``: expert parallelism without
#: data parallelism, every rank running the whole global batch (``MoELayer(replicated_tokens=True)``, the demo's
#: bitwise mode; docs/demo.md)
DATA_PARALLEL = ("fsdp", "ddp", "none")


@dataclass(frozen=True)
class Layout:
    """The parallel dimensions (torchtitan's names, :class:`sparseops.distributed.ParallelDims`), resolved:
    ``dp_replicate * dp_shard`` is the world size, ``ep`` divides ``dp_shard``. With ``data_parallel="none"``:
    ``dp_replicate = dp_shard = 1`` and ``ep`` the world size (no data parallelism)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    data_parallel: str = "fsdp"
    dispatcher: str = "alltoall"  #: of the MoE layers (sparseops.models.CausalLM)

    @property
    def data_ranks(self) -> int:
        """The ranks that split the global batch."""
        return 1 if self.data_parallel == "none" else self.dp_replicate * self.dp_shard

    def dims(self) -> dict:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "ep": self.ep}


@dataclass(frozen=True)
class RunSpec:
    """Everything a run needs (``sparseops train``'s flags, checked): model, data, optimisation, layout."""

    model: LMConfig
    optim: TrainConfig  #: steps, batch_size (the global batch), lr, warmup, weight_decay, clip, seed, eval_*
    task: RecallTask | None = None  #: the recall task, or None with ``data_path``
    data_path: str | None = None
    data_dtype: str = "uint16"
    seq_len: int = 128  #: of the token file's sequences (the recall task has its own)
    dtype: torch.dtype = torch.float32
    layout: Layout = field(default_factory=Layout)
    save_dir: str | None = None
    save_every: int | None = None
    resume: str | None = None  #: the checkpoint path to resume from (the CLI picks the newest complete one)
    #: the flag ``resume`` came from (``--resume`` or ``--auto-resume``), which the messages about it name
    resume_flag: str = "--resume"
    comm_timeout: float = 300.0
    log_every: int = 0  #: print the loss every N steps on rank 0 (0: never)
    #: train ``torch.compile(model)`` (the MoE layers eager inside it; docs/demo.md); with
    #: ``activation_checkpointing``, each block compiled inside its checkpoint (:func:`checkpoint_blocks`)
    compile: bool = False
    #: the forward (and the recall evaluation) under ``torch.autocast`` in this dtype; None: off
    #: (docs/training.md, "Mixed precision")
    autocast: torch.dtype | None = None
    #: the DSA dense warm-up's steps (``attention="dsa"``): steps ``[0, dsa_dense_steps)`` train only the indexers
    dsa_dense_steps: int = 0
    #: ``{flag: value}`` the checkpoints record (``train.settings.*``: what a resume checks its flags against;
    #: sparseops.cli._resume); empty: none recorded
    settings: dict = field(default_factory=dict)
    #: ``M``: forward / backward passes per step, over consecutive pieces of the global batch (docs/training.md,
    #: "One step")
    micro_batches: int = 1
    #: the resumed checkpoint's ``M`` when this run's differs (``--resume DIR --micro-batches M2``), else None
    resumed_micro_batches: int | None = None
    #: each block of the LM under torch's ``checkpoint_wrapper`` (its activations recomputed in the backward)
    activation_checkpointing: bool = False


def make_data(spec: RunSpec):
    """The data source of ``spec``: the recall stream or the token file."""
    if spec.data_path is None:
        return RecallStream(spec.task, spec.optim.batch_size, spec.optim.seed)
    return TokenFile(spec.data_path, spec.data_dtype, spec.seq_len, spec.optim.batch_size, spec.optim.seed,
                     vocab_size=spec.model.vocab_size or None)


def checkpoint_blocks(model: torch.nn.Module, compile: bool = False) -> None:
    """Wrap each block of the LM in torch's ``checkpoint_wrapper``, before ``parallelize`` (docs/training.md,
    "Activation checkpointing and torch.compile"); the state dict's keys stay the plain model's. ``compile``: each
    block is compiled first (``Module.compile``), then wrapped: a checkpoint around a block that holds an MoE layer
    makes dynamo run the whole block eagerly, a compiled block inside the checkpoint keeps its attention compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        if compile:
            block.compile()
        model.blocks[i] = checkpoint_wrapper(block)


def _parallelize(model: torch.nn.Module, layout: Layout, timeout: float, ddp: dict | None = None) -> None:
    """``parallelize`` with every group of the layout given the run's timeout (DeviceMesh would create its
    sub-groups with torch's default, 30 minutes on gloo); ``ddp``: its ``ddp_options``."""
    dims = ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, ep=layout.ep)
    parallelize(model, dims, data_parallel=layout.data_parallel, timeout=timeout, ddp_options=ddp)


def train_run(spec: RunSpec, result: dict, *, device: torch.device | None = None, data=None,
              on_step: Callable[[int, float], None] | None = None) -> dict:
    """Train ``spec`` on this process (one rank of the initialised process group, or alone) and fill ``result``.

    ``data``: the data source, :func:`make_data` of ``spec`` (None: made here).

    ``result`` (filled as the run goes, so that a caller can report a run that stopped): ``steps``, ``loss``
    (the global mean loss of each step run here), ``resumed_from``, ``checkpoints`` (paths written),
    ``recall`` (the recall task, ``eval_sequences > 0``; else None), ``seconds``.

    Raises:
        TrainingStopped: a non-finite loss or gradient norm (on every rank, before the optimizer step), a
            collective that failed or timed out (a peer stopped responding or died), or an allocation that failed;
            the message names the step, or the recall evaluation at the end.
    """
    device = torch.device("cpu") if device is None else device
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    cfg = spec.optim
    data = make_data(spec) if data is None else data
    model_cfg = spec.model.replace(vocab_size=data.vocab_size)
    layout = spec.layout
    replicated_tokens = world > 1 and layout.data_parallel == "none"
    ctx = _Ctx(rank, world, *((0, 1) if replicated_tokens else (rank, world)),
               dist.group.WORLD if replicated_tokens else None, cfg, device, spec.autocast, spec.micro_batches)
    model = build_model(model_cfg, cfg.seed, spec.dtype, device, ep_group=ctx.ep_group,
                        dispatcher=layout.dispatcher)
    if spec.activation_checkpointing:
        checkpoint_blocks(model, compile=spec.compile)
    if world > 1 and not replicated_tokens:  # replicated tokens: the MoE layers on the world group
        _parallelize(model, layout, spec.comm_timeout, ddp_options(spec.dsa_dense_steps, layout.data_parallel))
    run = torch.compile(model) if spec.compile and not spec.activation_checkpointing else model
    named = list(model.named_parameters())
    replicated = [p for n, p in named if not expert_parameter(n)]
    experts = [p for n, p in named if expert_parameter(n)]
    opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    state = checkpoint.TrainState(sched, data, rank, device, spec.settings)
    stages = Stages(model, spec.dsa_dense_steps, replicated, experts)
    result.update(steps=[], loss=[], resumed_from=None, checkpoints=[], recall=None, seconds=0.0)
    if spec.resume is not None:
        stages.before_load(spec.resume)
        result["resumed_from"] = checkpoint.load(spec.resume, model, opt, state, flag=spec.resume_flag)
        _schedule_lr(opt, sched)
    fault = fault_from_env()
    start = time.perf_counter()
    for step in range(state.step, cfg.steps):
        try:
            loss = _step(ctx, run, opt, sched, data, *stages.enter(step), step, inject(fault, step, rank))
            state.step = step + 1
            result["steps"].append(step)
            result["loss"].append(loss)
            if spec.save_dir is not None and (state.step == cfg.steps or (
                    spec.save_every and state.step % spec.save_every == 0)):
                path = checkpoint.checkpoint_path(spec.save_dir, state.step)
                checkpoint.save(path, model, opt, state)
                result["checkpoints"].append(str(path))
        except TrainingStopped:
            raise
        except checkpoint.SaveFailed as exc:  # on every rank (DCP gathers the write results)
            raise TrainingStopped(step, str(exc)) from None
        except (RuntimeError, dist.DistError) as exc:
            if out_of_memory(exc):  # named on the rank that ran out (torchrun then ends the others)
                raise memory_failure(step, rank, exc) from exc
            if world == 1:
                raise
            raise collective_failure(step, rank, spec.comm_timeout, exc) from exc
        finally:
            result["seconds"] = time.perf_counter() - start
        if on_step is not None and rank == 0:
            on_step(step, loss)
    if spec.task is not None and spec.data_path is None and cfg.eval_sequences > 0:
        result["recall"] = _evaluate(ctx, model, spec, state.step, _trained_checkpoint(spec, result))
    result["seconds"] = time.perf_counter() - start
    return result


def _evaluate(ctx: _Ctx, model: torch.nn.Module, spec: RunSpec, steps: int, saved: str | None) -> float:
    """The recall evaluation at the end of the run; an allocation or a collective that fails in it stops the run
    with a message as in a step (``TrainingStopped``; ``saved``: the checkpoint of the trained model, or None)."""
    try:
        with ctx.autocast_ctx():
            return recall(model, spec.task, ctx.cfg, ctx.device, dist.group.WORLD if ctx.dp_world > 1 else None)
    except (RuntimeError, dist.DistError) as exc:
        if out_of_memory(exc):  # named on the rank that ran out (torchrun then ends the others)
            raise evaluation_memory_failure(steps, ctx.rank, exc, saved) from exc
        if ctx.world == 1:
            raise
        raise collective_failure(steps, ctx.rank, spec.comm_timeout, exc, evaluation_where(steps)) from exc


def _trained_checkpoint(spec: RunSpec, result: dict) -> str | None:
    """The checkpoint that holds the run's trained model: its last save (at the last step), or the resumed one
    when the run trained no step; None: none."""
    if result["checkpoints"]:
        return result["checkpoints"][-1]
    return str(spec.resume) if spec.resume is not None and not result["steps"] else None


def _schedule_lr(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> None:
    """The learning rate of the resumed step from this run's schedule (``--steps`` and ``--warmup`` may change on
    resume): the loaded optimizer holds the rate its run's schedule set, which would drive the first step; the
    same arithmetic as ``LambdaLR.step``, so an unchanged schedule gives the same rate bitwise."""
    lrs = [base * factor(sched.last_epoch) for base, factor in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        group["lr"] = lr


@dataclass(frozen=True)
class _Ctx:
    rank: int
    world: int
    dp_rank: int  #: this rank's share of the global batch, of ``dp_world``
    dp_world: int
    ep_group: object  #: the MoE layers' raw EP group in the replicated-tokens mode, else None
    cfg: TrainConfig
    device: torch.device
    autocast: torch.dtype | None = None
    micro_batches: int = 1

    def autocast_ctx(self):
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)


def _step(ctx: _Ctx, model, opt, sched, data, replicated, experts, step, poison: bool) -> float:
    cfg = ctx.cfg
    batches = data.batches(step, ctx.dp_rank, ctx.dp_world, ctx.micro_batches)
    n = batches[0].n_targets
    opt.zero_grad(set_to_none=False)
    ces, auxes = [], []
    for m, batch in enumerate(batches):
        ce, aux = _forward(ctx, model, batch, poison and m == 0)
        ces.append(ce.detach())
        auxes.append(aux.detach())
        if m + 1 < len(batches):  # the last one's waits for the loss check
            _backward(ctx, ce, aux, n)
    loss = _global_loss(ctx, step, torch.stack(ces).sum(), torch.stack(auxes).mean(), n)
    _backward(ctx, ce, aux, n)
    for p in replicated + experts:  # a parameter no token reached this step
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if ctx.dp_world == 1:  # the demo's clipping, term for term (the experts gathered in global order)
        norm = grad_norm_sq(replicated, experts, ctx.ep_group).sqrt()
        coef = (cfg.clip / (norm + 1e-6)).clamp(max=1.0)
        for p in replicated + experts:
            p.grad.mul_(coef)
    else:
        norm = clip_grad_norm_(replicated + experts, cfg.clip)
    if not torch.isfinite(norm):
        raise TrainingStopped(step, f"non-finite gradient norm ({float(norm)}); every rank stopped before the "
                                    "optimizer step")
    opt.step()
    sched.step()
    return loss


def _forward(ctx: _Ctx, model, batch, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's cross-entropy sum over this rank's share and its aux terms."""
    tokens, targets, cu, _ = batch
    with ctx.autocast_ctx():
        logits, aux = model(tokens.to(ctx.device), cu.tolist())
    # the loss in the parameters' dtype (fp32 under autocast)
    ce = F.cross_entropy(logits.to(aux.dtype), targets.to(ctx.device), ignore_index=IGNORE_INDEX, reduction="sum")
    return (ce * math.nan if poison else ce), aux


def _backward(ctx: _Ctx, ce: torch.Tensor, aux: torch.Tensor, n: int) -> None:
    """The micro-batch's part of the step's gradient: its cross-entropy over the rank's ``n / W`` targets of the
    step, its aux terms over the ``M`` micro-batches."""
    (ce / (n // ctx.dp_world) + aux / ctx.micro_batches).backward()


def _global_loss(ctx: _Ctx, step: int, ce: torch.Tensor, aux: torch.Tensor, n: int) -> float:
    """The step's loss from this rank's cross-entropy sum and aux mean over its micro-batches: one all-reduce,
    which also stops every rank (``TrainingStopped``) when any rank's loss is not finite."""
    total, aux_g = ce, aux
    if ctx.world > 1:
        stats = torch.zeros(2 + ctx.world, dtype=ce.dtype, device=ctx.device)
        if ctx.dp_world > 1:  # the ranks' shares; with replicated tokens every rank holds the whole sum
            # the MoE aux loss is the global (micro-)batch's on every rank already; DSA's indexer loss is the mean
            # over the rank's own tokens: the mean over the ranks' equal shares is the global one
            stats[0], stats[1] = total, aux_g
        stats[2 + ctx.rank] = float(not torch.isfinite(total))
        dist.all_reduce(stats)
        bad = nonfinite_ranks(stats[2:])
        if ctx.dp_world > 1:
            total, aux_g = stats[0], stats[1] / ctx.dp_world
    else:
        bad = [] if torch.isfinite(total) else [0]
    loss = float(total / n + aux_g)
    if bad:
        raise TrainingStopped(step, f"non-finite loss on rank(s) {bad} (global loss {loss}); every rank stopped "
                                    "before the optimizer step")
    return loss
