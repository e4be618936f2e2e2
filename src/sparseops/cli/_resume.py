"""The settings a ``sparseops train`` checkpoint records, and a resume's flags against them (docs/training.md,
"Checkpoints and resume").

A checkpoint holds the flags that define what the run computes beyond the tensors' shapes: the model (every
``LMConfig`` flag and ``--attention``), ``--dsa-dense-steps`` (the stage of each step), the recall task,
``--seq-len``, ``--seed`` (the token file's order, the recall evaluation), ``--global-batch`` (the token file's
position is counted in steps) and ``--micro-batches`` (the aux loss is the mean of the micro-batches'), under
``train.settings.<flag>``. On ``--resume`` a flag left out takes the checkpoint's value; one given with another
value is refused (the run would silently compute something else than the run it continues). Checkpoints
written before the settings were recorded carry none: only their shapes are checked.
"""

from __future__ import annotations

import argparse

#: ``train.settings.<flag>``: the entries' prefix in a checkpoint
PREFIX = "train.settings."


def recorded_flags(model_fields: tuple[str, ...], recall: dict[str, str]) -> dict[str, str]:
    """``{flag: argparse dest}`` of the recorded flags: the model's, the recall task's and the run's."""
    flags = {name.replace("_", "-"): f"model_{name}" for name in model_fields}
    flags["attention"] = "model_attention"
    flags["dsa-dense-steps"] = "dsa_dense_steps"
    flags.update({f"recall-{flag}": f"recall_{name}" for name, flag in recall.items()})
    flags.update({"seq-len": "seq_len", "seed": "seed", "global-batch": "global_batch",
                  "micro-batches": "micro_batches"})
    return flags


def settings(spec, model_fields: tuple[str, ...], recall: dict[str, str]) -> dict[str, object]:
    """``{flag: value}`` of the run ``spec`` (a resolved ``RunSpec``), as its checkpoints record them."""
    out: dict[str, object] = {name.replace("_", "-"): getattr(spec.model, name) for name in model_fields}
    out["attention"] = spec.model.attention
    out["dsa-dense-steps"] = spec.dsa_dense_steps
    if spec.task is not None:
        out.update({f"recall-{flag}": getattr(spec.task, name) for name, flag in recall.items()})
    out["seq-len"] = spec.task.seq_len if spec.task is not None else spec.seq_len
    out.update({"seed": spec.optim.seed, "global-batch": spec.optim.batch_size,
                "micro-batches": spec.micro_batches})
    return out


class _LeftOut:
    def __repr__(self) -> str:
        return "LEFT_OUT"


#: the default of a flag whose value may be None (``--rope-theta none``): left out is not None there
LEFT_OUT = _LeftOut()


def take_saved(args: argparse.Namespace, saved: dict[str, object], flags: dict[str, str], path: str,
               bad: type[Exception], nullable: frozenset[str] = frozenset(),
               why: str = "the run it continues used it; leave the flag out to keep it") -> None:
    """Fill ``args``' flags left out with the checkpoint's values ``saved`` (``{flag: value}``); a flag given with
    another value raises ``bad`` naming it, with ``why`` it is refused. Left out: None, or :data:`LEFT_OUT` for the
    dests ``nullable`` (flags that may be given as None, whose default is :data:`LEFT_OUT`)."""
    for flag, dest in flags.items():
        if flag not in saved:
            continue
        given, value = getattr(args, dest), saved[flag]
        if given is LEFT_OUT or (given is None and dest not in nullable):
            setattr(args, dest, value)
        elif given != value:
            raise bad(f"--{flag}: expected the checkpoint's {value!r} with --resume ({why}), got {given!r} "
                      f"(checkpoint {path!r})")

