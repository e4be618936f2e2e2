"""Training, evaluation and the expert-parallel run of the demo model on the recall task (docs/demo.md).

One step: draw the global batch of ``batch_size`` sequences from the step's seed and minimise

    loss = (sum of the cross-entropies at the query keys of the global batch) / (their count) + aux loss,

then clip the global gradient norm and take an AdamW step. Two expert-parallel modes (:data:`EP_MODES`):

- ``"replicated"``: every rank trains on the whole batch; the layers other than the routed experts compute it
  alike on every rank and each MoE layer splits its tokens over the ranks for the experts (``MoELayer``'s
  ``replicated_tokens``). Nothing is all-reduced but the gradient norm's per-expert terms, gathered into the
  one-process order: every loss and every parameter is bitwise the one-process one.
- ``"data"``: rank r of ``ep`` ranks trains on sequences ``[r*B/ep, (r+1)*B/ep)`` and the gradients of the
  replicated parameters (all but the routed experts', which :class:`sparseops.nn.MoELayer` already sums over
  the group) are all-reduced. The sum of the ranks' losses is the one-process loss, so the run follows the
  one-process run up to the rounding of the different summation order.

The gradient norm sums the squares per parameter, the routed experts' per expert in global expert order, in
every mode and in one process alike.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _checks
from ..distributed.dispatchers import DISPATCHERS
from .lm import CausalLM, LMConfig, expert_parameter, load_full_state
from .recall import IGNORE_INDEX, RecallTask


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings: AdamW with linear warm-up then cosine decay to 0, global-norm clipping."""

    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    eval_sequences: int = 256
    eval_batch: int = 64


def check_train_config(cfg: TrainConfig) -> None:
    """Every field of ``cfg``, before anything is built: a ``ValueError`` / ``TypeError`` whose message starts with
    the field's name (as :func:`sparseops.models.lm.check_config` does for the model's)."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg: expected a TrainConfig, got {type(cfg).__name__}")
    for name, lo in (("steps", 0), ("batch_size", 1), ("warmup", 0), ("eval_sequences", 1), ("eval_batch", 1)):
        _checks.check_int(name, getattr(cfg, name), lo=lo)
    _checks.check_int("seed", cfg.seed)
    for name, strict in (("lr", False), ("weight_decay", False), ("clip", True)):
        v = _checks.check_float(name, getattr(cfg, name))
        if v < 0 or (strict and v == 0):
            raise ValueError(f"{name}: expected a float {'>' if strict else '>='} 0, got {v}")


#: the parameter dtypes of :func:`train`. Not float16: AdamW's eps (1e-8) is 0 there, so a parameter whose gradient
#: is 0 steps to NaN, and train has no gradient scaler
TRAIN_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _check_run_args(task: RecallTask, cfg: TrainConfig, compile: bool, dtype) -> None:
    if not isinstance(task, RecallTask):
        raise TypeError(f"task: expected a RecallTask, got {type(task).__name__}")
    check_train_config(cfg)
    _checks.check_bool("compile", compile)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    got = torch.get_default_dtype() if dtype is None else dtype
    if got not in TRAIN_DTYPES:  # a floating dtype is a ValueError, another a TypeError (as CausalLM's)
        why = " (float16 needs a gradient scaler; train has none)" if got == torch.float16 else ""
        default = " (torch's default dtype)" if dtype is None else ""
        raise (ValueError if got.is_floating_point else TypeError)(
            f"dtype: expected one of {_checks._dtype_names(TRAIN_DTYPES)}, got {str(got).replace('torch.', '')}"
            f"{default}{why}")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """``min(1, (step+1)/warmup) * (1 + cos(pi * step / steps)) / 2``: the schedule's multiple of ``lr`` (the
    ``LambdaLR`` factor of ``sparseops train``)."""
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    return warm * 0.5 * (1.0 + math.cos(math.pi * step / cfg.steps))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """``lr * lr_factor(step, cfg)``, rounded as ``LambdaLR`` rounds it."""
    return cfg.lr * lr_factor(step, cfg)


#: the expert-parallel modes of :func:`train` (see the module docstring)
EP_MODES = ("replicated", "data")


def build_model(model_cfg: LMConfig, seed: int, dtype: torch.dtype, device, ep_group=None,
                ep_mode: str = "replicated", dispatcher: str = "alltoall") -> CausalLM:
    """The model as seeded in one process; under EP every rank loads its own experts from that same state."""
    torch.manual_seed(seed)
    full = CausalLM(model_cfg, dispatcher=dispatcher, device=device, dtype=dtype)
    if ep_group is None:
        return full
    model = CausalLM(model_cfg, ep_group=ep_group, replicated_tokens=ep_mode == "replicated",
                     dispatcher=dispatcher, device=device, dtype=dtype)
    load_full_state(model, full.state_dict())
    return model


def _shard(batch, rank: int, world: int, seq_len: int):
    """This rank's consecutive share of the batch's sequences, packed again."""
    B = batch.cu_seqlens.numel() - 1
    if B % world:
        raise ValueError(f"batch_size: expected a multiple of the EP size {world}, got {B}")
    lo, hi = rank * B // world * seq_len, (rank + 1) * B // world * seq_len
    cu = torch.arange(B // world + 1, dtype=torch.int32) * seq_len
    return batch.tokens[lo:hi], batch.targets[lo:hi], cu


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def _check_ep_args(ep_mode: str, dispatcher: str) -> None:
    if ep_mode not in EP_MODES:
        raise ValueError(f"ep_mode: expected one of {EP_MODES}, got {ep_mode!r}")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher: expected one of {DISPATCHERS}, got {dispatcher!r}")


def grad_norm_sq(replicated: list[torch.Tensor], experts: list[torch.Tensor], group=None) -> torch.Tensor:
    """The squared global gradient norm, summed in an order that does not depend on the EP size.

    One term per replicated parameter, then one per (routed expert parameter, expert) with the experts of all
    ranks gathered in global order (``group``: the EP group, None in one process)."""
    terms = [p.grad.pow(2).sum() for p in replicated]
    if experts:
        local = torch.stack([torch.stack([g.pow(2).sum() for g in p.grad.unbind(0)]) for p in experts])
        if group is not None and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = torch.cat(parts, dim=1)
        terms.extend(local.reshape(-1).unbind(0))
    return torch.stack(terms).sum()


@torch.no_grad()
def recall(model: CausalLM, task: RecallTask, cfg: TrainConfig, device, group=None) -> float:
    """Recall on ``eval_sequences`` held-out sequences: the share of query keys whose argmax is their value.

    ``group``: the data-parallel group whose ranks share the sequences (None: this process runs them all)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    was_training = model.training
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64)
    for _ in range(max(1, cfg.eval_sequences // cfg.eval_batch)):
        tokens, targets, cu = _shard(task.sample(cfg.eval_batch, gen), rank, world, task.seq_len)
        logits, _ = model(tokens.to(device), cu.tolist())
        asked = targets != IGNORE_INDEX
        hits[0] += (logits.argmax(-1).cpu()[asked] == targets[asked]).sum().item()
        hits[1] += asked.sum().item()
    model.train(was_training)
    _all_reduce(hits, group)
    return float(hits[0] / hits[1])


def train(model_cfg: LMConfig, task: RecallTask, cfg: TrainConfig, *, dtype: torch.dtype = torch.float32,
          device=None, ep_group=None, ep_mode: str = "replicated", dispatcher: str = "alltoall",
          compile: bool = False,
          on_step: Callable[[int, float, float], None] | None = None) -> dict:
    """Train one model from its seed and evaluate its recall.

    Args:
        model_cfg, task, cfg: the model, the task and the optimisation.
        dtype: of the parameters and activations (:data:`TRAIN_DTYPES`: float32, float64 or bfloat16;
            None: torch's default dtype).
        device: where to run (None: the CPU).
        ep_group: run expert-parallel over this group (each rank calls ``train``), or None.
        ep_mode: one of :data:`EP_MODES` (see the module docstring); ignored without ``ep_group``.
        dispatcher: of the MoE layers under EP (:class:`sparseops.models.CausalLM`); ``"alltoall"`` keeps the
            one-process arithmetic.
        compile: run the model under ``torch.compile`` (the MoE layers eager inside it; recall on the eager model;
            docs/demo.md, "`--compile`").
        on_step: called as ``on_step(step, loss, tokens_per_second)`` after each step (rank 0 under EP).

    Returns:
        ``{"loss": [float per step], "recall": float, "seconds": float, "tokens_per_second": float}``.
    """
    _check_ep_args(ep_mode, dispatcher)
    _check_run_args(task, cfg, compile, dtype)
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step: expected None or a callable, got {type(on_step).__name__}")
    device = torch.device("cpu") if device is None else torch.device(device)
    # the group over which the ranks split the batch: none when every rank runs it whole
    dp_group = ep_group if ep_mode == "data" else None
    rank, world = (0, 1) if dp_group is None else (dist.get_rank(dp_group), dist.get_world_size(dp_group))
    model = build_model(model_cfg, cfg.seed, dtype, device, ep_group, ep_mode, dispatcher)
    run = torch.compile(model) if compile else model
    named = list(model.named_parameters())
    replicated = [p for n, p in named if not expert_parameter(n)]
    experts = [p for n, p in named if expert_parameter(n)]
    opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_targets = cfg.batch_size * task.num_queries
    losses = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        tokens, targets, cu = _shard(task.sample(cfg.batch_size, gen), rank, world, task.seq_len)
        logits, aux = run(tokens.to(device), cu.tolist())
        ce = F.cross_entropy(logits, targets.to(device), ignore_index=IGNORE_INDEX, reduction="sum") / n_targets
        opt.zero_grad(set_to_none=False)
        (ce + aux).backward()
        for p in replicated + experts:  # parameters of a branch the ablation does not compute
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if dp_group is not None:
            for p in replicated:
                dist.all_reduce(p.grad, group=dp_group)
        coef = (cfg.clip / (grad_norm_sq(replicated, experts, ep_group).sqrt() + 1e-6)).clamp(max=1.0)
        for p in replicated + experts:
            p.grad.mul_(coef)
        opt.step()
        loss = _all_reduce(ce.detach().clone(), dp_group) + aux.detach()
        losses.append(float(loss))
        if on_step is not None and rank == 0:
            elapsed = time.perf_counter() - start
            on_step(step, losses[-1], (step + 1) * cfg.batch_size * task.seq_len / elapsed)
    seconds = time.perf_counter() - start
    return {"loss": losses, "recall": recall(model, task, cfg, device, dp_group), "seconds": seconds,
            "tokens_per_second": cfg.steps * cfg.batch_size * task.seq_len / seconds}


def _ep_worker(rank: int, world_size: int, model_cfg: LMConfig, task: RecallTask, cfg: TrainConfig,
               dtype: torch.dtype, ep_mode: str, dispatcher: str, compile: bool) -> dict:
    return train(model_cfg, task, cfg, dtype=dtype, ep_group=dist.group.WORLD, ep_mode=ep_mode,
                 dispatcher=dispatcher, compile=compile)


def train_expert_parallel(model_cfg: LMConfig, task: RecallTask, cfg: TrainConfig, world_size: int, *,
                          dtype: torch.dtype = torch.float32, ep_mode: str = "replicated",
                          dispatcher: str = "alltoall", compile: bool = False, threads: int | None = 1,
                          timeout: float = 1800.0) -> dict:
    """:func:`train` on ``world_size`` spawned CPU processes over gloo, the experts split across them.

    ``threads``: ``torch.set_num_threads`` in each process (None: torch's default). Compare with a one-process
    run at the same thread count: MKL rounds a few small GEMM shapes differently with another number of
    threads (docs/demo.md). Returns rank 0's result (every rank logs the same losses).
    """
    from ..distributed.launch import spawn

    _check_ep_args(ep_mode, dispatcher)
    _check_run_args(task, cfg, compile, dtype)
    return spawn(_ep_worker, world_size, model_cfg, task, cfg, dtype, ep_mode, dispatcher, compile,
                 backend="gloo", timeout=timeout, threads=threads)[0]


def demo_setup(quick: bool = False, steps: int | None = None, seed: int = 0) -> tuple[RecallTask, LMConfig,
                                                                                       TrainConfig]:
    """The task, model and training settings of ``sparseops demo``.

    ``quick``: the same model on a smaller task (64-token sequences, 2 pairs, 8 values), where the lookup forms
    within 200 steps: the point of the full run (NSA recalls, the window-only ablation stays near chance) in
    about a quarter of its time (docs/demo.md)."""
    _checks.check_bool("quick", quick)
    if steps is not None:
        _checks.check_int("steps", steps, lo=0)
    _checks.check_int("seed", seed)
    if quick:
        task = RecallTask(seq_len=64, num_pairs=2, num_queries=16, num_keys=16, num_values=8, num_filler=8,
                          pair_spacing=16)
        train_cfg = TrainConfig(steps=200, batch_size=16, lr=1e-2, seed=seed, eval_sequences=128, eval_batch=64)
    else:
        task = RecallTask(seq_len=128, num_pairs=4, num_queries=32, num_keys=32, num_values=16, num_filler=16,
                          pair_spacing=16)
        train_cfg = TrainConfig(steps=600, batch_size=8, lr=5e-3, seed=seed)
    model = LMConfig(vocab_size=task.vocab_size, window_size=16, rope_theta=None)
    if steps is not None:
        train_cfg = dataclasses.replace(train_cfg, steps=steps)
    return task, model, train_cfg
