"""The settings a ``sparseops train`` checkpoint records, and a resume's flags against them (docs/training.md,
"Checkpoints and resume").

A checkpoint holds the flags that define what the run computes beyond the tensors' shapes: the model (every
``LMConfig`` flag and ``--attention``), ``--dsa-dense-steps`` (the stage of each step), the recall task or the token
file's ``--data-dtype`` (how its bytes are read: the file records none), ``--seq-len``, ``--seed`` (the token file's
order, the recall evaluation), ``--global-batch`` (the token file's position is counted in steps) and
``--micro-batches`` (the aux loss is the mean of the micro-batches') and ``--dtype``, under
``train.settings.<flag>``. On ``--resume`` a flag left out takes the checkpoint's value; one given with another
value is refused (the run would silently compute something else than the run it continues), but for
``--micro-batches``: a relaunch on fewer ranks raises ``M`` to keep each rank's memory, so a resume may change it
(the run uses the new ``M`` from the resumed step on, rank 0 says so once, its checkpoints record it); and
``--dtype``, which DCP's load casts to. Checkpoints written before the settings were recorded carry
none: only their shapes are checked. ``--auto-resume`` resumes from the ``--save`` DIR when it holds a complete
checkpoint, with the same checks (:func:`resume_source`). Every message about the resumed checkpoint names the flag
it came from (``--resume`` or ``--auto-resume``: :func:`resume_flag`), passed down as ``flag``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

#: ``train.settings.<flag>``: the entries' prefix in a checkpoint
PREFIX = "train.settings."
#: the checkpoint's kind of data: ``"recall"`` or ``"tokens"`` (``training.data``'s ``state_dict``)
DATA_KIND = "train.data.kind"


def recorded_flags(model_fields: tuple[str, ...], recall: dict[str, str]) -> dict[str, str]:
    """``{flag: argparse dest}`` of the recorded flags: the model's, the recall task's and the run's."""
    flags = {name.replace("_", "-"): f"model_{name}" for name in model_fields}
    flags["attention"] = "model_attention"
    flags["dsa-dense-steps"] = "dsa_dense_steps"
    flags.update({f"recall-{flag}": f"recall_{name}" for name, flag in recall.items()})
    flags.update({"data-dtype": "data_dtype", "seq-len": "seq_len", "seed": "seed", "global-batch": "global_batch",
                  "micro-batches": "micro_batches", "dtype": "dtype"})
    return flags


def settings(spec, model_fields: tuple[str, ...], recall: dict[str, str]) -> dict[str, object]:
    """``{flag: value}`` of the run ``spec`` (a resolved ``RunSpec``), as its checkpoints record them."""
    out: dict[str, object] = {name.replace("_", "-"): getattr(spec.model, name) for name in model_fields}
    out["attention"] = spec.model.attention
    out["dsa-dense-steps"] = spec.dsa_dense_steps
    if spec.task is not None:
        out.update({f"recall-{flag}": getattr(spec.task, name) for name, flag in recall.items()})
    if spec.data_path is not None:
        out["data-dtype"] = spec.data_dtype
    out["seq-len"] = spec.task.seq_len if spec.task is not None else spec.seq_len
    out.update({"seed": spec.optim.seed, "global-batch": spec.optim.batch_size,
                "micro-batches": spec.micro_batches, "dtype": str(spec.dtype).removeprefix("torch.")})
    return out


class _LeftOut:
    def __repr__(self) -> str:
        return "LEFT_OUT"


#: the default of a flag whose value may be None (``--rope-theta none``): left out is not None there
LEFT_OUT = _LeftOut()


def take_saved(args: argparse.Namespace, saved: dict[str, object], flags: dict[str, str], path: str,
               bad: type[Exception], *, flag: str, nullable: frozenset[str] = frozenset(),
               why: str = "the run it continues used it; leave the flag out to keep it") -> None:
    """Fill ``args``' flags left out with the checkpoint's values ``saved`` (``{flag: value}``); a flag given with
    another value raises ``bad`` naming it, with ``why`` it is refused and the ``flag`` that resumes (``--resume``
    or ``--auto-resume``). Left out: None, or :data:`LEFT_OUT` for the dests ``nullable`` (flags that may be given
    as None, whose default is :data:`LEFT_OUT`)."""
    for name, dest in flags.items():
        if name not in saved:
            continue
        given, value = getattr(args, dest), saved[name]
        if given is LEFT_OUT or (given is None and dest not in nullable):
            setattr(args, dest, value)
        elif given != value:
            raise bad(f"--{name}: expected the checkpoint's {value!r} with {flag} ({why}), got {given!r} "
                      f"(checkpoint {path!r})")


def read_values(path: str, keys: list[str], bad: type[Exception], flag: str) -> dict:
    """``training.checkpoint.read_values`` of the checkpoint resumed by ``flag`` (its files checked by
    :func:`take_settings` first): entries that do not read raise ``bad`` naming ``flag``."""
    from ..training import checkpoint

    try:
        return checkpoint.read_values(path, keys)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise bad(f"{flag}: expected a readable checkpoint, got {path!r}, whose entries do not read "
                  f"({type(exc).__name__}): a damaged checkpoint") from None


def take_settings(args: argparse.Namespace, path: str, model_fields: tuple[str, ...], recall: dict[str, str],
                  bad: type[Exception], flag: str) -> int | None:
    """The flags left out take the checkpoint's recorded values; one given with another value raises ``bad``, but
    ``--micro-batches`` and ``--dtype``, which may change. The first look at the checkpoint: ``read_metadata``'s
    checks (a ``.metadata`` that reads, shards that hold its bytes) make a damaged one ``bad`` naming the file.
    ``flag``: the one the checkpoint came from (``--resume`` or ``--auto-resume``), named in the messages.
    Returns the checkpoint's ``M`` (None: not recorded)."""
    from ..distributed.checkpoint import read_metadata

    try:
        read_metadata(path)
    except ValueError as exc:
        raise bad(f"{flag}: {str(exc).removeprefix('checkpoint_id: ')}") from None
    flags = recorded_flags(model_fields, recall)
    # a token file: the recall task's settings are not this run's; the recall task: the token file's are not (its
    # kind is checked)
    drop = ("recall-",) if args.data is not None else ("data-",)
    flags = {f: d for f, d in flags.items() if not f.startswith(drop)}
    values = read_values(path, [PREFIX + f for f in flags] + [DATA_KIND], bad, flag)
    _check_data_kind(values.get(DATA_KIND), args.data, path, bad, flag)
    saved = {k.removeprefix(PREFIX): v for k, v in values.items() if k.startswith(PREFIX)}
    micro = saved.pop("micro-batches", None)
    if args.micro_batches is None:
        args.micro_batches = micro
    dtype = saved.pop("dtype", None)  # may change too: DCP casts the saved values to the run's dtype
    if args.dtype is None:
        args.dtype = dtype
    take_saved(args, saved, flags, path, bad, nullable=frozenset({"model_rope_theta"}), flag=flag)
    return micro


def _check_data_kind(kind: object, data: str | None, path: str, bad: type[Exception], flag: str) -> None:
    """``--data`` against the checkpoint's kind of data (``train.data.kind``: ``"tokens"`` or ``"recall"``; None:
    not a ``sparseops train`` checkpoint, refused later): checked before the recorded settings, whose refusals
    (the recall task's ``--seq-len``, the vocabulary's shape) would name another flag than the one left out."""
    if kind == "tokens" and data is None:
        raise bad(f"--data: expected the token file the checkpoint's run trained on with {flag}, got none (the "
                  f"recall task; checkpoint {path!r})")
    if kind == "recall" and data is not None:
        raise bad(f"--data: expected no --data with {flag} of a checkpoint of the recall task, got {data!r} "
                  f"(checkpoint {path!r})")


def micro_batches_problem(batch: int, ranks: int, micro: int, given: int | None, saved: int | None,
                          flag: str | None) -> str:
    """The refusal of ``M = micro`` that does not divide the ``batch / ranks`` sequences of each data-parallel rank:
    ``given`` is the flag (None: left out), ``saved`` the checkpoint's ``M`` resumed by ``flag`` (None: no resume,
    or not recorded)."""
    problem = (f"--micro-batches: expected a divisor of --global-batch / the data-parallel ranks = {batch} / {ranks} "
               f"= {batch // ranks}, got {micro}")
    if saved is None or given == saved:
        return problem
    if given is None:
        return f"{problem} (the checkpoint's, which {flag} keeps: give --micro-batches to change it)"
    return f"{problem} (the checkpoint's was {saved})"


def micro_batches_notice(spec) -> str | None:
    """Rank 0's line when a resume changes ``--micro-batches`` (``spec.resumed_micro_batches``: the checkpoint's
    ``M``), else None."""
    if spec.resumed_micro_batches is None:
        return None
    step = resumed_step(spec)
    model = spec.model
    terms = ["the MoE load-balance loss"] * (model.aux_loss_coeff != 0)
    terms += ["DSA's indexer loss"] * (model.attention == "dsa" and model.indexer_loss_coeff != 0)
    what = (f"{' and '.join(terms)}, a mean over the micro-batches, another function of the weights; the "
            "cross-entropy the same up to rounding" if terms else "the loss the same up to rounding (no aux loss)")
    return (f"sparseops train: --micro-batches {spec.micro_batches} from step {step} on, the checkpoint's "
            f"{spec.resumed_micro_batches} before: {what}; this run's checkpoints record {spec.micro_batches}")


def resume_flag(args: argparse.Namespace) -> str:
    """The flag a resume comes from, which every message about its checkpoint names: ``--auto-resume`` or
    ``--resume`` (the two are refused together: :func:`resume_source`)."""
    return "--auto-resume" if args.auto_resume else "--resume"


def resume_source(args: argparse.Namespace, bad: type[Exception]) -> str | None:
    """The directory (or ``DIR/step_<s>``) the run resumes from: ``--resume``'s, or under ``--auto-resume`` the
    ``--save`` DIR when it holds a complete checkpoint; None: the run starts at step 0. Decided from the files
    alone, before any collective: every rank of a launch sees the same (docs/training.md, "Faults").

    Raises:
        bad: ``--auto-resume`` without ``--save``, or with ``--resume``.
    """
    if not args.auto_resume:
        return args.resume
    if args.save is None:
        raise bad("--auto-resume: expected --save DIR with it (the run resumes from DIR's newest complete "
                  "checkpoint when it holds one), got no --save")
    if args.resume is not None:  # which of the two would win is a guess a user should not have to make
        raise bad(f"--auto-resume: expected no --resume with it (it resumes from --save {args.save!r} when that "
                  f"holds a complete checkpoint, else starts at step 0), got --resume {args.resume!r}")
    from ..training import checkpoint

    return args.save if checkpoint.scan(args.save)[0] else None


def resumed_step(spec) -> int:
    """The step the run ``spec`` starts at: its resumed checkpoint's (``DIR/step_<s>``), 0 without one."""
    return 0 if spec.resume is None else int(Path(os.fspath(spec.resume)).name.removeprefix("step_"))


def different_steps(steps: list[int], flag: str) -> str | None:
    """The refusal of a launch whose ranks decided to resume different steps (``steps[r]``: rank ``r``'s, 0: no
    checkpoint), naming ``flag`` (``--resume`` or ``--auto-resume``) and two of the steps; None when they agree."""
    other = next((r for r, s in enumerate(steps) if s != steps[0]), None)
    if other is None:
        return None

    def start(s: int) -> str:
        return f"step {s}" if s else "step 0 (no complete checkpoint)"

    return (f"{flag}: expected every rank to resume from the same step, got {start(steps[0])} on rank 0 and "
            f"{start(steps[other])} on rank {other}: each rank picks the newest complete checkpoint from the files, "
            "and one completed or went away between the ranks' looks (another job writing there?) or the ranks see "
            "different file systems; relaunch when nothing else writes there")


def check_same_step(args: argparse.Namespace, spec) -> None:
    """After ``init_process_group``, with ``--resume`` or ``--auto-resume``: every rank's resumed step (decided from
    the files alone, before any collective) gathered over the world group (a CPU tensor: gloo), so that no rank
    loads another step than its peers (docs/training.md, "Faults").

    Raises:
        LoadFailed: the ranks decided different steps (:func:`different_steps`), on every rank.
    """
    if args.resume is None and not args.auto_resume:
        return
    import torch
    import torch.distributed as dist

    from ..training.checkpoint import LoadFailed

    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, torch.tensor([resumed_step(spec)], dtype=torch.int64))
    problem = different_steps([int(s) for s in steps], resume_flag(args))
    if problem is not None:
        raise LoadFailed(problem)


def auto_resume_notice(args: argparse.Namespace, spec) -> str | None:
    """Rank 0's line under ``--auto-resume``: which checkpoint it resumes from, or that it starts at step 0."""
    if not args.auto_resume:
        return None
    if spec.resume is not None:
        return (f"sparseops train: --auto-resume: resuming from {os.fspath(spec.resume)}, the newest complete "
                f"checkpoint of --save {args.save}")
    return f"sparseops train: --auto-resume: --save {args.save} holds no complete checkpoint: starting at step 0"
