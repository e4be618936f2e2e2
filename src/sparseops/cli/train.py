"""Train the NSA + MoE language model of sparseops.models on the associative-recall task (the default) or on a
token file, in one process or under torchrun, with DCP checkpoints, resume at any layout and faults that end
in a message (docs/training.md, "sparseops train"): e.g. `torchrun --nproc-per-node 4 -m sparseops train
--dp-shard 4 --ep 2 --save ckpt --save-every 100`, later `--resume ckpt` at any layout.
Without torchrun it runs in one process. Every flag left out takes the value of `sparseops demo`'s full run.
Exit status: 0 done; 1 the run stopped (a non-finite loss or gradient, a collective that failed or timed out:
the message names the step); 2 bad flags or input (checked before any collective)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from . import _flags, _group, _report, _resume
from ._flags import adamw_problem, memory_bytes, outputs_problem, seed_problem, torchrun_env, write_json
from ._resume import LEFT_OUT

HELP = "train the NSA + MoE LM under torchrun (or in one process): layouts, DCP checkpoints, resume, faults"

#: LMConfig fields that are not flags (the vocabulary comes from the data; the ablation is the demo's)
_NOT_FLAGS = ("vocab_size", "window_only")

#: RecallTask fields as flags (``--recall-<name>``); seq_len is ``--seq-len``
_RECALL = {"num_pairs": "pairs", "num_queries": "queries", "num_keys": "keys", "num_values": "values",
           "num_filler": "filler", "pair_spacing": "pair-spacing"}

#: TrainConfig fields and their flags
_OPTIM = {"steps": "steps", "batch_size": "global-batch", "lr": "lr", "warmup": "warmup",
          "weight_decay": "weight-decay", "clip": "clip", "seed": "seed", "eval_sequences": "eval-sequences",
          "eval_batch": "eval-batch"}


#: LMConfig's size fields, written out so that ``sparseops --help`` does not import torch
_MODEL_INT = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "dense_layers", "ffn_size",
              "num_experts", "top_k", "expert_ffn_size", "compress_block_size", "compress_stride",
              "select_block_size", "select_count", "window_size", "dsa_topk", "index_heads", "index_head_dim")
_MODEL_FLOAT = ("aux_loss_coeff", "rope_theta", "indexer_loss_coeff")
#: the longest --comm-timeout, a week: torch's stores and groups take it in milliseconds, and overflow far above
_COMM_TIMEOUT_MAX = 7 * 24 * 3600
#: LMConfig.attention's values (sparseops.models.lm.ATTENTIONS)
_ATTENTIONS = ("nsa", "dsa")


def _float_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, metavar="N", help="steps to train in all (a resumed run "
                   "continues up to N)")
    g.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="sequences per step over all ranks (a multiple of the world size)")
    g.add_argument("--seq-len", type=int, default=None, metavar="L", help="tokens per sequence")
    g.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="forward/backward passes per step, each over B/M sequences of the global batch, gradients "
                        "accumulated (default 1; with --resume the checkpoint's, which it may change); the aux loss "
                        "is the mean of the micro-batches'")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward (torch's checkpoint_wrapper): less "
                        "memory, the same losses")
    g.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="of the parameters, gradients, optimizer state and checkpoints (default float32; with "
                        "--resume the checkpoint's, which it may change: the saved values are cast)")
    g.add_argument("--autocast", choices=("bfloat16",), default=None,
                   help="forward under torch.autocast in this dtype (mixed precision with --dtype float32; the "
                        "routing, losses and gradient reductions stay in fp32)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--lr", type=float, default=None, help="AdamW peak learning rate (linear warm-up, cosine to 0)")
    g.add_argument("--warmup", type=int, default=None, metavar="N", help="warm-up steps")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--clip", type=float, default=None, help="global gradient-norm clip")
    g.add_argument("--eval-sequences", type=int, default=None, metavar="N",
                   help="held-out recall sequences evaluated at the end (0: none; the recall task only)")
    g.add_argument("--eval-batch", type=int, default=None, metavar="N",
                   help="sequences per evaluation batch (the recall task only)")
    g.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads per process")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (rank LOCAL_RANK's device, NCCL + gloo) when present, else the CPU (gloo)")
    g.add_argument("--compile", action="store_true", help="train torch.compile(model) (the MoE layers eager)")
    g.add_argument("--log-every", type=int, default=10, metavar="N", help="print the loss every N steps (0: never)")
    g.add_argument("--dsa-dense-steps", type=int, default=None, metavar="N",
                   help="with --attention dsa: the first N steps are the dense warm-up (dense attention, every "
                        "parameter but the indexers' frozen, the indexers trained by their dense KL loss); default 0")
    g = parser.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", default=None,
                   help="a flat file of token ids (next-token prediction); default: the recall task")
    g.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                   help="of the token file's ids, native byte order (default uint16; with --resume the checkpoint's)")
    g.add_argument("--vocab-size", type=int, default=None, help="with --data (default: the largest id + 1)")
    for name, flag in _RECALL.items():
        g.add_argument(f"--recall-{flag}", dest=f"recall_{name}", type=int, default=None, metavar="N",
                       help=f"recall task: {name.replace('_', ' ')}")
    g = parser.add_argument_group("model (default: the demo's)")
    g.add_argument("--attention", dest="model_attention", choices=_ATTENTIONS, default=None,
                   help="nsa: NativeSparseAttention (default); dsa: DeepSeekSparseAttention (--dsa-topk keys per "
                        "query, an --index-heads x --index-head-dim indexer trained by its KL loss)")
    for name in _MODEL_INT:
        g.add_argument(f"--{name.replace('_', '-')}", dest=f"model_{name}", type=int, default=None, metavar="N")
    for name in _MODEL_FLOAT:
        rope = name == "rope_theta"  # the one with an off
        g.add_argument(f"--{name.replace('_', '-')}", dest=f"model_{name}", type=_float_or_none if rope else float,
                       default=LEFT_OUT if rope else None, metavar="X", help="'none' for no RoPE" if rope else None)
    g = parser.add_argument_group("layout (torchrun's world: dp_replicate * dp_shard ranks)")
    g.add_argument("--dp-replicate", type=int, default=1, metavar="N", help="replicas (HSDP with --dp-shard)")
    g.add_argument("--dp-shard", type=int, default=-1, metavar="N", help="FSDP ranks per replica (-1: the rest)")
    g.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel ranks (divides --dp-shard and E; default 1, the world size with "
                        "--replicated-tokens)")
    g.add_argument("--ddp", action="store_true", help="replicate the dense parameters (DDP) instead of FSDP")
    g.add_argument("--replicated-tokens", action="store_true",
                   help="expert parallelism without data parallelism: every rank runs the whole batch, the MoE "
                        "layers split its tokens over the --ep = world ranks (bitwise the one-process run with the "
                        "alltoall dispatcher; no checkpoints)")
    g.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                   help="the MoE layers' token dispatcher")
    g = parser.add_argument_group("checkpoints and faults")
    g.add_argument("--save", metavar="DIR", default=None, help="write DCP checkpoints DIR/step_<s>")
    g.add_argument("--save-every", type=int, default=None, metavar="S", help="a checkpoint every S steps (and at "
                   "the end)")
    g.add_argument("--resume", metavar="DIR", default=None,
                   help="resume from DIR's newest complete checkpoint, at any layout")
    g.add_argument("--auto-resume", action="store_true",
                   help="with --save DIR: resume from DIR's newest complete checkpoint when it holds one, else start "
                        "at step 0 (one command for the first launch and torchrun --max-restarts' restarts)")
    g.add_argument("--comm-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="every collective's timeout: a rank that stops responding ends the job after it")
    g.add_argument("--json", metavar="PATH", default=None, help="write the losses and the layout here (rank 0)")


class _Bad(ValueError):
    """A flag or input that is rejected before any collective (exit status 2)."""


def _check_int(args, name: str, lo: int) -> None:
    v = getattr(args, name)
    if v is not None and v < lo:
        raise _Bad(f"--{name.replace('_', '-')}: expected an int >= {lo}, got {v}")


def resolve_layout(world: int, dp_replicate: int, dp_shard: int, ep: int | None, num_experts: int, global_batch: int,
                   data_parallel: str, dispatcher: str = "alltoall"):
    """The :class:`sparseops.training.loop.Layout` of the flags at this world size, or ``_Bad`` naming the flag."""
    from ..training.loop import Layout

    if data_parallel == "none":  # --replicated-tokens
        if (dp_replicate, dp_shard) != (1, -1):
            raise _Bad(f"--replicated-tokens: expected no --dp-replicate / --dp-shard (no data parallelism), got "
                       f"{dp_replicate} / {dp_shard}")
        ep = world if ep is None else ep
        if ep != world or num_experts % world:
            raise _Bad(f"--ep: expected the world size {world} (a divisor of --num-experts = {num_experts}) with "
                       f"--replicated-tokens, got {ep}")
        return Layout(1, 1, world, "none", dispatcher)
    if dp_replicate < 1:
        raise _Bad(f"--dp-replicate: expected an int >= 1, got {dp_replicate}")
    if dp_shard == -1:
        if world % dp_replicate:
            raise _Bad(f"--dp-replicate: expected a divisor of the world size {world}, got {dp_replicate}")
        dp_shard = world // dp_replicate
    if dp_shard < 1:
        raise _Bad(f"--dp-shard: expected -1 or an int >= 1, got {dp_shard}")
    ep = 1 if ep is None else ep
    if dp_replicate * dp_shard != world:
        raise _Bad(f"--dp-shard: expected --dp-replicate * --dp-shard = the world size {world} (torchrun's ranks), "
                   f"got {dp_replicate} * {dp_shard} = {dp_replicate * dp_shard}")
    if ep < 1:
        raise _Bad(f"--ep: expected an int >= 1, got {ep}")
    if dp_shard % ep:
        raise _Bad(f"--ep: expected a divisor of --dp-shard = {dp_shard}, got {ep}")
    if num_experts % ep:
        raise _Bad(f"--ep: expected a divisor of --num-experts = {num_experts}, got {ep}")
    if global_batch % world:
        raise _Bad(f"--global-batch: expected a multiple of the world size {world}, got {global_batch}")
    return Layout(dp_replicate, dp_shard, ep, data_parallel, dispatcher)


def build_spec(args: argparse.Namespace, world: int):
    """The :class:`~sparseops.training.loop.RunSpec` of the flags (the demo's settings where a flag is left out),
    checked at this world size: ``_Bad`` names the flag."""
    import torch

    from ..models.recall import RecallTask
    from ..models.train import demo_setup
    from ..training import checkpoint
    from ..training.loop import RunSpec

    for name, lo in (("steps", 1), ("global_batch", 1), ("seq_len", 1), ("warmup", 0), ("eval_sequences", 0),
                     ("eval_batch", 1), ("threads", 1), ("log_every", 0), ("save_every", 1), ("vocab_size", 1),
                     ("dsa_dense_steps", 0), ("micro_batches", 1)):
        _check_int(args, name, lo)
    if not 1 <= args.comm_timeout <= _COMM_TIMEOUT_MAX:  # torch counts it in int milliseconds
        raise _Bad(f"--comm-timeout: expected a number of seconds in [1, {_COMM_TIMEOUT_MAX}], got {args.comm_timeout}")
    if args.lr is not None and not 0 < args.lr < math.inf:
        raise _Bad(f"--lr: expected a number > 0 (and finite), got {args.lr}")
    if args.clip is not None and not 0 < args.clip < math.inf:  # <= 0 would scale the gradients by <= 0
        raise _Bad(f"--clip: expected a number > 0 (and finite), got {args.clip}")
    if args.weight_decay is not None and not 0 <= args.weight_decay < math.inf:
        raise _Bad(f"--weight-decay: expected a number >= 0 (and finite), got {args.weight_decay}")
    problem = seed_problem(args.seed) if args.seed is not None else None  # what torch's generators take
    if problem:
        raise _Bad(problem)
    if args.save_every is not None and args.save is None:
        raise _Bad("--save-every: expected --save DIR with it, got no --save")
    if args.vocab_size is not None and args.data is None:
        raise _Bad("--vocab-size: expected --data PATH with it (the recall task sets its vocabulary)")
    if args.data_dtype is not None and args.data is None:
        raise _Bad(f"--data-dtype: expected --data PATH with it (the recall task reads no file), got --data-dtype "
                   f"{args.data_dtype}")
    if args.data is not None:  # the recall task's flags, and its evaluation's, would be silently ignored
        recall = [f"--recall-{f}" for n, f in _RECALL.items() if getattr(args, f"recall_{n}") is not None]
        recall += ["--eval-sequences"] * bool(args.eval_sequences) + ["--eval-batch"] * (args.eval_batch is not None)
        if recall:
            raise _Bad(f"{recall[0]}: expected no recall-task flag with --data (next-token prediction on the file: no "
                       f"recall task, no recall evaluation), got {' '.join(recall)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise _Bad("--device: expected a machine where torch sees CUDA for 'cuda', got none "
                   "(torch.cuda.is_available() is False)")
    resume, resumed, given_micro, saved_micro, given_dtype = None, 0, args.micro_batches, None, args.dtype
    flag = _resume.resume_flag(args)  # named in every message about the checkpoint
    if (source := _resume.resume_source(args, _Bad)) is not None:
        try:
            resumed, resume = checkpoint.newest_complete(source, flag)
        except ValueError as exc:
            raise _Bad(str(exc)) from None
        saved_micro = _resume.take_settings(args, os.fspath(resume), _MODEL_INT + _MODEL_FLOAT, _RECALL, _Bad, flag)
    kept = f" (the checkpoint's, which {flag} keeps)" if given_dtype is None and args.dtype is not None else ""
    args.dtype = args.dtype or "float32"  # with a resume, take_settings gave it the checkpoint's
    if args.autocast is not None and args.dtype != "float32":  # autocast leaves float64 as it is: a silent no-op
        raise _Bad(f"--autocast: expected --dtype float32 with it (the fp32 weights autocast casts), got --dtype "
                   f"{args.dtype}{kept}")
    task, model, optim = demo_setup()
    given = {k: getattr(args, f.replace("-", "_")) for k, f in _OPTIM.items()}
    optim = dataclasses.replace(optim, **{k: v for k, v in given.items() if v is not None})
    if problem := adamw_problem(optim.lr, optim.weight_decay, torch.finfo(getattr(torch, args.dtype)).max):
        raise _Bad(problem)
    model = dataclasses.replace(model, **{n: v for n in (*_MODEL_INT, *_MODEL_FLOAT, "attention")
                                          if (v := getattr(args, f"model_{n}")) is not LEFT_OUT
                                          and (v is not None or n == "rope_theta")})
    dense_steps = _dense_steps(args.dsa_dense_steps, model)
    if args.replicated_tokens and args.ddp:
        raise _Bad("--ddp: expected no --ddp with --replicated-tokens (no data parallelism), got both")
    if args.replicated_tokens and (args.save or args.resume):
        raise _Bad("--replicated-tokens: expected no --save / --resume (checkpoints need the parallelize layouts), "
                   "got " + ("--save" if args.save else "--resume"))
    layout = resolve_layout(world, args.dp_replicate, args.dp_shard, args.ep, model.num_experts, optim.batch_size,
                            "none" if args.replicated_tokens else "ddp" if args.ddp else "fsdp", args.dispatcher)
    micro = args.micro_batches or 1
    if optim.batch_size % (micro * layout.data_ranks):  # each rank takes an equal share of each micro-batch
        raise _Bad(_resume.micro_batches_problem(optim.batch_size, layout.data_ranks, micro, given_micro, saved_micro,
                                                 flag))
    seq_len = args.seq_len if args.seq_len is not None else task.seq_len
    if args.data is None:
        changes = {n: getattr(args, f"recall_{n}") for n in _RECALL if getattr(args, f"recall_{n}") is not None}
        try:
            task = RecallTask(**{**dataclasses.asdict(task), "seq_len": seq_len, **changes})
        except ValueError as exc:
            raise _Bad(f"the recall task (--seq-len, --recall-*): {exc}") from None
        model = model.replace(vocab_size=task.vocab_size)
        if args.eval_batch is not None and not optim.eval_sequences:
            raise _Bad(f"--eval-batch: expected --eval-sequences above 0 with it (0: no recall evaluation), got "
                       f"--eval-batch {args.eval_batch} with --eval-sequences 0")
        if optim.eval_sequences:
            eval_batch = min(optim.eval_batch, optim.eval_sequences)
            if eval_batch % layout.data_ranks:
                raise _Bad(f"--eval-batch: expected a multiple of the data-parallel ranks {layout.data_ranks} (at most "
                           f"--eval-sequences), got {eval_batch} (--eval-sequences 0 skips the evaluation)")
            optim = dataclasses.replace(optim, eval_batch=eval_batch)
    else:
        task = None
        model = model.replace(vocab_size=args.vocab_size or 0)
    if resume is not None:
        if optim.steps < resumed:  # --steps counts from step 0: such a run would train nothing and say done
            raise _Bad(f"--steps: expected at least the resumed step {resumed} (steps count from 0, a resumed run "
                       f"continues up to N), got {optim.steps}")
    if args.save is not None:
        # a complete checkpoint after the start would be written over in place (its old .metadata standing
        # until the new one replaces it) or, kept, picked by a later --resume (docs/training.md)
        later = [p.name for s, p in checkpoint.scan(args.save)[0] if s > resumed]
        if later:
            raise _Bad(f"--save: expected a directory with no complete checkpoint after step {resumed} (the start of "
                       f"this run), got {args.save!r} holding {', '.join(later)}; resume from it with --resume "
                       f"{args.save}, or save elsewhere")
        blocked = [p.name for p in checkpoint.in_the_way(args.save)]
        if blocked:  # a checkpoint's save there would fail after the steps before it
            raise _Bad(f"--save: expected only checkpoint directories named step_<s> in {args.save!r}, got "
                       f"{', '.join(blocked)}, not a directory")
    spec = RunSpec(model=model, optim=optim, task=task, data_path=args.data, data_dtype=args.data_dtype or "uint16",
                   seq_len=seq_len, dtype=getattr(torch, args.dtype), layout=layout, save_dir=args.save,
                   save_every=args.save_every, resume=resume, resume_flag=flag, comm_timeout=args.comm_timeout,
                   log_every=args.log_every, compile=args.compile, dsa_dense_steps=dense_steps,
                   micro_batches=micro, resumed_micro_batches=saved_micro if saved_micro != micro else None,
                   activation_checkpointing=args.activation_checkpointing,
                   autocast=None if args.autocast is None else getattr(torch, args.autocast))
    return dataclasses.replace(spec, settings=_resume.settings(spec, _MODEL_INT + _MODEL_FLOAT, _RECALL))


def _dense_steps(given: int | None, model) -> int:
    """``--dsa-dense-steps`` (None: 0) for the resolved ``model``: a warm-up needs DSA layers and an indexer loss
    that trains them (with ``--indexer-loss-coeff 0`` the warm-up would change nothing)."""
    if not given:
        return 0
    if model.attention != "dsa":
        raise _Bad(f"--dsa-dense-steps: expected --attention dsa with it (the warm-up of DeepSeek Sparse Attention's "
                   f"indexer), got --attention {model.attention}")
    if model.indexer_loss_coeff == 0:
        raise _Bad("--dsa-dense-steps: expected --indexer-loss-coeff > 0 with it (the warm-up trains the indexers by "
                   "their loss alone), got --indexer-loss-coeff 0")
    return given


def check_run(spec, data, args: argparse.Namespace):
    """The checks that need the data (its vocabulary), before any collective and without writing: the model of
    the flags built on the ``meta`` device (its layers' own checks, no storage) and, with ``--resume``, the
    checkpoint against it: every parameter at the same global shape, data of the same kind (the same token
    file's windows). AdamW's ``lr`` and ``weight_decay`` come back from the checkpoint: ``--lr`` /
    ``--weight-decay`` given with another value are refused (they would be ignored), and when not given the
    checkpoint's values are the run's. Returns ``spec`` with those values; ``_Bad`` names the flag
    (docs/training.md, "Checkpoints and resume")."""
    import torch

    from ..distributed.checkpoint import check_compatible
    from ..models.lm import CausalLM

    try:
        with torch.device("meta"):
            model = CausalLM(spec.model.replace(vocab_size=data.vocab_size), dispatcher=spec.layout.dispatcher)
    except ValueError as exc:
        name, _, rest = str(exc).partition(":")
        if name in _MODEL_INT + _MODEL_FLOAT:  # LMConfig's field: its flag
            raise _Bad(f"--{name.replace('_', '-')}:{rest}") from None
        raise _Bad(f"the model (--hidden-size ... flags): {exc}") from None
    _check_memory(spec, model, args, data)
    if spec.resume is None:
        return spec
    path, flag = os.fspath(spec.resume), spec.resume_flag
    try:
        check_compatible({"model": model.state_dict()}, path)
    except ValueError as exc:
        raise _Bad(f"{flag}: {str(exc).removeprefix('checkpoint_id: ')}") from None
    groups = [f"optim.param_groups.0.{k}" for k in ("initial_lr", "weight_decay")]
    saved = _resume.read_values(path, [f"train.data.{k}" for k in ("kind", "num_windows", "seq_len")] + groups,
                                _Bad, flag)
    if "train.data.kind" not in saved:
        raise _Bad(f"{flag}: expected a checkpoint of sparseops train (with train.data.kind), got {path!r}")
    try:
        data.check_state({k.rsplit(".", 1)[1]: v for k, v in saved.items() if k.startswith("train.data.")})
    except ValueError as exc:
        raise _Bad(f"{flag}: {exc} in {path!r} (--data, --seq-len)") from None
    optim = {"lr": "lr", "weight-decay": "weight_decay"}
    kept = {name: saved[key] for name, key in zip(optim, groups) if key in saved}
    _resume.take_saved(args, kept, optim, path, _Bad, flag=flag,
                       why="AdamW's settings come back from the checkpoint; leave the flag out to keep them")
    return dataclasses.replace(spec, optim=dataclasses.replace(spec.optim, **{optim[f]: v for f, v in kept.items()}))


def _check_memory(spec, model, args: argparse.Namespace, data) -> None:
    """The parameters every rank allocates (the full model, before ``parallelize`` shards it; 1/ep of the experts
    with --replicated-tokens) must fit its memory: the vocabulary of a token file read with the wrong
    ``--data-dtype`` (uint16 pairs read as uint32 ids) would otherwise fail deep in torch's allocator."""
    import torch

    from ..models.lm import expert_parameter
    share = {True: spec.layout.ep if spec.layout.data_parallel == "none" else 1, False: 1}
    nbytes = sum(p.numel() // share[expert_parameter(n)] for n, p in model.named_parameters()) * spec.dtype.itemsize
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    have = memory_bytes(int(os.environ.get("LOCAL_RANK", 0)) if cuda else None)
    if have is None or nbytes <= have:
        return
    gib = f"{nbytes / 2**30:.1f} GiB of parameters on each rank, above the {have / 2**30:.1f} GiB of memory"
    if args.vocab_size is not None:
        raise _Bad(f"--vocab-size: expected a vocabulary the model can hold, got {args.vocab_size}: {gib}")
    if args.data is not None:
        raise _Bad(f"--data: expected token ids that make a vocabulary the model can hold, got a largest id of "
                   f"{data.vocab_size - 1} (--data-dtype {spec.data_dtype}): {gib}; a file written with another "
                   "--data-dtype?")
    raise _Bad(f"the model (--hidden-size ... flags): expected parameters that fit in memory, got {gib}")


def check_outputs(args: argparse.Namespace, rank: int) -> None:
    """``--save`` (every rank) and ``--json`` (rank 0, the one that writes it) created and written to
    (:func:`._flags.outputs_problem`): the last check before any collective."""
    problem = outputs_problem(args.save, args.json if rank == 0 else None, "--save", "--json")
    if problem is not None:
        raise _Bad(problem)


def config_argv(task, model, optim) -> list[str]:
    """The flags that make ``sparseops train`` run exactly ``(task, model, optim)`` (the demo's EP rerun)."""
    argv = ["--seq-len", str(task.seq_len)]
    argv += [x for n, f in _RECALL.items() for x in (f"--recall-{f}", str(getattr(task, n)))]
    argv += [x for n in _MODEL_INT + _MODEL_FLOAT for x in (f"--{n.replace('_', '-')}", str(getattr(model, n)))]
    argv += ["--attention", model.attention]
    argv += [x for n, f in _OPTIM.items() if n != "eval_batch" or optim.eval_sequences  # else refused
             for x in (f"--{f}", repr(getattr(optim, n)))]
    return argv


def run(args: argparse.Namespace) -> int:
    try:
        env = torchrun_env()
    except ValueError as exc:
        print(f"sparseops train: {exc}", file=sys.stderr)
        return 2
    rank, world, local_rank = env if env is not None else (0, 1, 0)
    try:
        spec = build_spec(args, world)
        from ..training.loop import make_data

        try:
            data = make_data(spec)  # a bad token file fails here, before any collective
        except ValueError as exc:  # TokenFile's arguments: their flags
            name, _, rest = str(exc).partition(":")
            flag = {"path": "--data", "dtype": "--data-dtype", "seq_len": "--seq-len", "vocab_size": "--vocab-size"}
            raise _Bad(f"{flag[name]}:{rest}" if name in flag else str(exc)) from None
        spec = check_run(spec, data, args)
        check_outputs(args, rank)
    except (_Bad, ValueError) as exc:
        _group.report_launch_problem(exc, rank, local_rank)
        return 2
    import torch
    import torch.distributed as dist

    from ..training.checkpoint import LoadFailed
    from ..training.faults import TrainingStopped
    from ..training.loop import train_run

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if env is not None and rank == 0 and (warning := _flags.restart_store_warning()):
        print(warning, file=sys.stderr, flush=True)

    def on_step(step: int, loss: float) -> None:
        if spec.log_every and ((step + 1) % spec.log_every == 0 or step + 1 == spec.optim.steps):
            print(f"step {step} loss {loss:.6g}", flush=True)

    result: dict = {}
    error, status = None, 0
    try:
        if env is not None:
            _group.join(device, spec.comm_timeout, world)
        if rank == 0:
            print(_report.header(args, spec, world, device.type), flush=True)
            for notice in filter(None, (_resume.auto_resume_notice(args, spec), _resume.micro_batches_notice(spec))):
                print(notice, flush=True)
        if env is not None:  # every rank decided the resumed step from the files: the same one?
            _resume.check_same_step(args, spec)
        train_run(spec, result, device=device, data=data, on_step=on_step)
    except TrainingStopped as exc:
        error, status = str(exc), 1
        print(f"sparseops train: rank {rank}: stopped at {exc}", file=sys.stderr, flush=True)
    except (LoadFailed, _group.GroupFailed) as exc:
        error, status = str(exc), 1
        print(f"sparseops train: rank {rank}: {exc}", file=sys.stderr, flush=True)
    if rank == 0 and args.json:
        problem = write_json(Path(args.json), _report.result_json(args, spec, world, result, error))
        if problem:
            print(f"sparseops train: --json: {problem}", file=sys.stderr, flush=True)
            status = status or 1
    if rank == 0 and status == 0:
        print(f"sparseops train: done, {len(result['steps'])} steps in {result['seconds']:.1f} s"
              + (f", recall {100 * result['recall']:.1f} %" if result.get("recall") is not None else ""), flush=True)
    if dist.is_initialized():
        if status:  # the group may be broken (a peer gone): leave without its teardown, which could wait
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="sparseops train", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
