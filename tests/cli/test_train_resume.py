"""``sparseops train``'s checkpoints against its flags, in this process: a resume's flags against the checkpoint
(its recorded settings, shapes, data, AdamW's settings), damaged checkpoints and unwritable outputs before any
collective, and a save, load or JSON write that fails during the run."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from sparseops.cli import _flags, main

from ..models.test_lm import TINY_TASK
from .test_train import ARGV, ARGV_DATA, CFG, MODEL, _checkpoint, _json, main_one_thread

pytestmark = pytest.mark.usefixtures("eager_cpu_kernels")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process run's checkpoints ``ck/step_2`` and ``ck/step_4``, ``two/step_2`` alone, a token file ``t.bin``
    (uint16) and the checkpoint ``tok/step_1`` of a run on ``t32.bin``, the same ids in uint32."""
    root = tmp_path_factory.mktemp("saved")
    assert main_one_thread([*ARGV, "--save", str(root / "ck"), "--save-every", "2"]) == 0
    (root / "two").mkdir()
    shutil.copytree(root / "ck" / "step_2", root / "two" / "step_2")
    ids = torch.arange(4 * 81 * 3) % 24  # the recall task's vocabulary
    ids.to(torch.uint16).numpy().tofile(root / "t.bin")
    ids.numpy().astype("uint32").tofile(root / "t32.bin")  # read as uint16: the same vocabulary, twice the windows
    assert main_one_thread([*ARGV_DATA, "--data", str(root / "t32.bin"), "--data-dtype", "uint32", "--seq-len", "32",
                            "--steps", "1", "--save", str(root / "tok")]) == 0
    for name in ("trunc", "empty"):  # damaged copies: a truncated shard, an empty .metadata
        shutil.copytree(root / "ck" / "step_2", root / name / "step_2")
    with open(root / "trunc" / "step_2" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (root / "empty" / "step_2" / ".metadata").write_bytes(b"")
    (root / "blocked").mkdir()
    (root / "blocked" / "step_2").write_text("")
    return root


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("extra, match", [
    (["--resume", "{ck}", "--num-experts", "8"],
     r"--num-experts: expected the checkpoint's 4 with --resume \(the run it continues used it; leave the flag out "
     r"to keep it\), got 8 \(checkpoint '.*step_4'\)"),
    (["--resume", "{ck}", "--top-k", "1"], r"--top-k: expected the checkpoint's 2 with --resume .*, got 1"),
    (["--resume", "{ck}", "--rope-theta", "500"], r"--rope-theta: expected the checkpoint's 10000.0 with --resume .*, "
                                                   r"got 500.0"),
    (["--resume", "{ck}", "--rope-theta", "none"], r"--rope-theta: expected the checkpoint's 10000.0 with --resume .*, "
                                                   r"got None"),
    (["--resume", "{ck}", "--seed", "5"], r"--seed: expected the checkpoint's 0 with --resume .*, got 5"),
    (["--resume", "{ck}", "--dsa-dense-steps", "1"],
     r"--dsa-dense-steps: expected the checkpoint's 0 with --resume .*, got 1"),
    (["--resume", "{ck}", "--micro-batches", "4"], r"--micro-batches: expected a divisor of --global-batch / the "
     r"data-parallel ranks = 4 / 2 = 2, got 4 \(the checkpoint's was 1\)"),
    (["--resume", "{ck}", "--recall-pairs", "3"], r"--recall-pairs: expected the checkpoint's \d+ with --resume"),
    (["--resume", "{ck}", "--data", "{saved}/t.bin"],
     "--data: expected no --data with --resume of a checkpoint of the recall task, got '.*t.bin' .checkpoint"),
    (["--resume", "{ck}", "--data", "{saved}/t.bin", "--seq-len", "32"],  # named before the recorded --seq-len
     "--data: expected no --data with --resume of a checkpoint of the recall task"),
    (["--resume", "{saved}/tok"], "--data: expected the token file the checkpoint's run trained on with --resume, "
                                  "got none .the recall task; checkpoint '.*tok/step_1'"),
    (["--resume", "{ck}", "--lr", "0.5"],
     r"--lr: expected the checkpoint's 0.01 with --resume \(AdamW's settings come back from the checkpoint; leave the "
     r"flag out to keep them\), got 0.5 \(checkpoint '.*step_4'\)"),
    (["--resume", "{ck}", "--weight-decay", "0.1"], r"--weight-decay: expected the checkpoint's 0.0 with --resume"),
    (["--save", "{ck}"], "--save: expected a directory with no complete checkpoint after step 0 .*holding step_2, step_4"),
    (["--resume", "{saved}/two", "--save", "{ck}"], "--save: expected .* after step 2 .*holding step_4; resume"),
    (["--resume", "{ck}/step_2", "--save", "{ck}"], "--save: expected .* after step 2 .*holding step_4; resume"),
    (["--save", "{saved}/t.bin"], "--save: expected a directory that can be written, got .*t.bin' .*t.bin' is a file."),
    (["--save", "{saved}/blocked"], "--save: expected only checkpoint directories named step_<s> in .*blocked', got "
                                   "step_2, not a directory"),
    (["--json", "/dev/null"], "--json: expected a regular file path, got '/dev/null', which exists and is not a"),
    (["--json", "{saved}"], "--json: expected a file path, got .*, a directory"),
    (["--resume", "{ck}", "--steps", "3"], "--steps: expected at least the resumed step 4 .*, got 3"),
    (["--resume", "{saved}/trunc"], r"--resume: expected '.*trunc/step_2/__0_0.distcp' of at least \d+ bytes \(as the "
                                    r"checkpoint's .metadata records\), got 1000 bytes: a damaged or partial checkpoint"),
    (["--resume", "{saved}/empty"], r"--resume: expected a readable .metadata in '.*empty/step_2', got one that does "
                                    r"not read \(EOFError: .*\): a damaged checkpoint"),
    (["--auto-resume", "--save", "{ck}", "--top-k", "1"],  # a resume's checks, named with the flag given
     r"--top-k: expected the checkpoint's 2 with --auto-resume \(the run it continues used it; .*\), got 1 "
     r"\(checkpoint '.*ck/step_4'\)"),
    (["--auto-resume", "--save", "{saved}/trunc"], r"--auto-resume: expected '.*trunc/step_2/__0_0.distcp' of at least"),
    (["--auto-resume", "--save", "{ck}", "--lr", "0.5"],  # check_run's checks, after the data is read
     r"--lr: expected the checkpoint's 0.01 with --auto-resume \(AdamW's settings"),
    (["--auto-resume", "--save", "{saved}/tok"], "--data: expected the token file the checkpoint's run trained on with "
                                                 "--auto-resume, got none"),
    (["--auto-resume", "--resume", "{ck}"], r"--auto-resume: expected no --resume with it \(it resumes from --save "
                                            r"'.*out' when that holds a complete checkpoint, else starts at step 0\), "
                                            r"got --resume '.*ck'"),
], ids=["experts", "top-k", "rope", "rope-off", "seed", "dense-steps", "micro-batches", "recall-task", "data-kind", "data-kind-first", "tokens-without-data", "lr", "weight-decay", "save-over-later", "resume-save-over-later", "resume-named-save-over-later",
        "save-a-file", "save-a-file-in-the-way", "json-a-device", "json-a-directory", "steps-before-resumed", "truncated-shard",
        "empty-metadata", "auto-resume-top-k", "auto-resume-truncated-shard", "auto-resume-lr",
        "auto-resume-tokens-without-data", "auto-resume-and-resume"])
def test_resume_and_outputs_checked_before_any_collective(saved, tmp_path, monkeypatch, capsys, extra, match):
    """A checkpoint of another model, data or optimizer setting, a --save directory whose later checkpoints the
    run would write over (or a later --resume would pick), an output that cannot be written: exit 2 naming the
    flag, under torchrun's environment with no rendezvous behind it (before any collective), nothing written or
    changed (the step_4 of a run killed while saving over it in place would keep its old .metadata)."""
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    extra = [x.replace("{ck}", str(saved / "ck")).replace("{saved}", str(saved)) for x in extra]
    before = _tree(saved)
    out = [] if "--save" in extra else ["--save", str(tmp_path / "out")]
    out += [] if "--json" in extra else ["--json", str(tmp_path / "r.json")]
    argv = ARGV_DATA if "--data" in extra else ARGV
    assert main([*argv, "--ep", "2", "--comm-timeout", "5", *extra, *out]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert _tree(saved) == before and _tree(tmp_path) == []


def test_auto_resume_starts_at_step_0_then_resumes_the_newest_checkpoint(tmp_path, monkeypatch, capsys,
                                                                         one_thread):
    """One command, launched again after a death while saving step_4: the first launch (no --save DIR yet) starts
    at step 0, the second skips the incomplete step_4 with a warning and resumes from step_2 with the first's losses
    bitwise, a third (the run done) resumes at its last step and trains nothing; rank 0 says which, one line each.
    Without --save it is refused."""
    ck = tmp_path / "ck"
    argv = [*ARGV, "--save", str(ck), "--save-every", "2", "--auto-resume", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    first = _json(tmp_path / "r.json")
    assert first["resumed_from"] is None and first["steps"] == [0, 1, 2, 3]
    assert f"--auto-resume: --save {ck} holds no complete checkpoint: starting at step 0\n" in capsys.readouterr().out
    (ck / "step_4" / ".metadata").unlink()  # as if the run had died while saving it
    with pytest.warns(UserWarning, match="step_4 is incomplete"):
        assert main(argv) == 0
    again = _json(tmp_path / "r.json")
    assert again["resumed_from"] == 2 and again["steps"] == [2, 3] and again["loss"] == first["loss"][2:]
    assert again["recall"] == first["recall"]
    assert (f"--auto-resume: resuming from {ck / 'step_2'}, the newest complete checkpoint of --save {ck}\n"
            in capsys.readouterr().out)
    assert main(argv) == 0
    done = _json(tmp_path / "r.json")
    assert done["resumed_from"] == 4 and done["steps"] == [] and done["recall"] == first["recall"]
    assert f"--auto-resume: resuming from {ck / 'step_4'}" in capsys.readouterr().out
    assert main([*ARGV, "--auto-resume"]) == 2
    assert ("--auto-resume: expected --save DIR with it (the run resumes from DIR's newest complete checkpoint when "
            "it holds one), got no --save") in capsys.readouterr().err
    # torchrun --max-restarts with the store it shares with the workers by default: warned, with the way out
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in _flags.restart_store_warning()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert _flags.restart_store_warning() is None


def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_a_message(tmp_path, monkeypatch, capsys,
                                                                         one_thread):
    """The second save fails (a full disk, as DCP's writer reports it): exit 1 naming the step, the checkpoint and
    the first rank's error, the JSON written with it, the incomplete step_4 removed; step_2 stays whole."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    calls = []
    write = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    ck = tmp_path / "ck"
    assert main([*ARGV, "--save", str(ck), "--save-every", "2", "--json", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    want = f"stopped at step 3: the checkpoint {ck / 'step_4'} could not be written: rank 0: OSError: [Errno 28]"
    assert want in err, err
    r = _json(tmp_path / "r.json")
    assert r["steps"] == [0, 1, 2, 3] and r["checkpoints"] == [str(ck / "step_2")]
    assert r["error"].startswith("step 3: the checkpoint ")
    assert (ck / "step_2" / ".metadata").is_file() and not (ck / "step_4").exists()


def test_a_json_that_cannot_be_written_at_the_end_exits_1(tmp_path, monkeypatch, capsys, one_thread):
    """The launch check passed but the write at the end fails: a message naming --json, exit 1, no partial file."""
    from sparseops.cli import _flags

    real = Path.write_text

    def fail(self, *a, **k):
        if self.name.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", fail)
    assert _flags.write_json(tmp_path / "r.json", {"a": 1}).startswith("could not write")
    assert main([*ARGV, "--steps", "1", "--json", str(tmp_path / "r.json")]) == 1
    assert "--json: could not write" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_fails_to_read_after_the_launch_checks_exits_1(saved, tmp_path, monkeypatch, capsys,
                                                                         one_thread):
    """Damage the launch checks cannot see (the shard's bytes themselves): exit 1 naming --resume, the checkpoint
    and the error, the JSON written with it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    read = FileSystemReader.read_data

    def damaged(self, plan, planner):  # the tensors' bytes fail; the launch checks read values only
        if any(item.type == LoadItemType.TENSOR for item in plan.items):
            raise OSError(5, "Input/output error")
        return read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", damaged)
    assert main([*ARGV, "--resume", str(saved / "two"), "--json", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert f"--resume: the checkpoint {saved / 'two' / 'step_2'} could not be read: rank 0: OSError: [Errno 5]" in err
    assert _json(tmp_path / "r.json")["error"].startswith("--resume: the checkpoint")
    # the same checkpoint picked by --auto-resume: named with the flag given
    shutil.copytree(saved / "two", tmp_path / "two")
    assert main([*ARGV, "--auto-resume", "--save", str(tmp_path / "two")]) == 1
    assert (f"rank 0: --auto-resume: the checkpoint {tmp_path / 'two' / 'step_2'} could not be read: rank 0: OSError"
            in capsys.readouterr().err)


def test_resume_with_the_flags_left_out_continues_the_checkpoints_run(saved):
    """``--resume DIR`` alone: the model, the recall task, --seq-len, --seed and --global-batch are the recorded
    ones (the demo's defaults would build another model, or the same shapes computing something else)."""
    from sparseops.cli import build_parser
    from sparseops.cli.train import build_spec

    spec = build_spec(build_parser().parse_args(["train", "--resume", str(saved / "ck")]), 1)
    assert spec.model == MODEL.replace(vocab_size=TINY_TASK.vocab_size) and spec.task == TINY_TASK
    assert (spec.optim.seed, spec.optim.batch_size) == (CFG.seed, CFG.batch_size)
    assert spec.model != build_spec(build_parser().parse_args(["train"]), 1).model
    spec = build_spec(build_parser().parse_args(["train", "--resume", str(saved / "ck" / "step_2")]), 1)
    assert spec.resume == saved / "ck" / "step_2"  # a checkpoint named: that one, not DIR's newest (step_4)


def test_checkpoints_without_recorded_settings_are_checked_by_shape(saved, tmp_path):
    """A checkpoint written before the settings were recorded: the flags are the run's, its shapes checked."""
    from sparseops.cli import build_parser
    from sparseops.cli.train import _Bad, build_spec, check_run
    from sparseops.training.loop import make_data

    old = tmp_path / "old"
    _strip_settings(saved / "two" / "step_2", old / "step_2", tmp_path)
    args = build_parser().parse_args([*ARGV, "--resume", str(old), "--top-k", "1"])
    spec = build_spec(args, 1)
    assert spec.model.top_k == 1 and check_run(spec, make_data(spec), args).model.top_k == 1
    args = build_parser().parse_args([*ARGV, "--resume", str(old), "--hidden-size", "32"])
    spec = build_spec(args, 1)
    with pytest.raises(_Bad, match=r"--resume: expected 'model.embed.weight' of shape \[24, 32\]"):
        check_run(spec, make_data(spec), args)


def test_a_token_files_dtype_is_recorded(saved, tmp_path):
    """The file records no dtype: the checkpoint records --data-dtype. Left out, a resume takes it (uint32, where
    the default uint16 would read the same bytes as other ids: here the same vocabulary, twice the windows); given
    with another value, it is refused naming it; a checkpoint without it (written before it was recorded) takes
    the flag's, default uint16."""
    from sparseops.cli import build_parser
    from sparseops.cli.train import _Bad, build_spec, check_run
    from sparseops.training.loop import make_data

    def spec(*extra):
        args = build_parser().parse_args([*ARGV_DATA, "--data", str(saved / "t32.bin"), "--seq-len", "32", *extra])
        return args, build_spec(args, 1)

    args, resumed = spec("--resume", str(saved / "tok"))
    assert resumed.data_dtype == "uint32" and resumed.settings["data-dtype"] == "uint32"
    check_run(resumed, make_data(resumed), args)  # the checkpoint's windows
    with pytest.raises(_Bad, match=r"--data-dtype: expected the checkpoint's 'uint32' with --resume \(the run it "
                                   r"continues used it; leave the flag out to keep it\), got 'uint16' \(checkpoint "):
        spec("--resume", str(saved / "tok"), "--data-dtype", "uint16")
    old = tmp_path / "old"
    _strip_settings(saved / "tok" / "step_1", old / "step_1", tmp_path)
    assert spec("--resume", str(old))[1].data_dtype == "uint16"
    assert spec("--resume", str(old), "--data-dtype", "uint32")[1].data_dtype == "uint32"


def _strip_settings(src: Path, dst: Path, tmp_path: Path) -> None:
    """A copy of the checkpoint ``src`` without its ``train.settings.*`` entries, as DCP writes it."""
    import torch.distributed.checkpoint as dcp

    state = _checkpoint(src, tmp_path)
    del state["train"]["settings"]
    dcp.save(state, checkpoint_id=dst, no_dist=True)


def test_resume_without_optimizer_flags_keeps_the_checkpoints(saved):
    """--resume with --lr / --weight-decay left out: the checkpoint's values are the run's (not the flags'
    defaults, which would be refused as a change)."""
    from sparseops.cli import build_parser
    from sparseops.cli.train import build_spec, check_run
    from sparseops.training.loop import make_data

    argv = [*ARGV, "--resume", str(saved / "ck")]
    for flag in ("--lr", "--weight-decay"):
        i = argv.index(flag)
        del argv[i:i + 2]
    args = build_parser().parse_args(argv)
    spec = build_spec(args, 1)
    assert (spec.optim.lr, spec.optim.weight_decay) != (CFG.lr, CFG.weight_decay)  # the flags' defaults
    spec = check_run(spec, make_data(spec), args)
    assert (spec.optim.lr, spec.optim.weight_decay) == (CFG.lr, CFG.weight_decay)


def test_resume_with_other_steps_takes_the_new_schedule_from_its_first_step(saved, tmp_path, monkeypatch,
                                                                            one_thread):
    """``--steps`` may change on resume (the schedule is a function of the flags): the first resumed step's
    learning rate is the new schedule's, not the one the checkpoint's optimizer holds (its run's schedule)."""
    import dataclasses

    from sparseops.models.train import lr_at

    lrs = []
    adam_step = torch.optim.AdamW.step

    def record(opt, *args, **kwargs):
        lrs.append(opt.param_groups[0]["lr"])
        return adam_step(opt, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    assert main([*ARGV, "--resume", str(saved / "two"), "--steps", "3"]) == 0
    # the last call is step 2's, the run's one step (DCP's load steps the optimizer at lr 0 to make its state)
    assert lrs[-1] == lr_at(2, dataclasses.replace(CFG, steps=3)) != lr_at(2, CFG)


def test_a_step_out_of_memory_stops_the_run_with_a_message(tmp_path, monkeypatch, capsys, one_thread):
    """An allocation that fails in a step (CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError): exit 1
    naming the step and what to shrink, the JSON written with it, not torch's traceback."""
    from sparseops.training import loop

    real, calls = loop._forward, []

    def forward(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB") if k.get("cuda") else
                   RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                "memory: you tried to allocate 9663676416 bytes."))
        return real(*a)

    monkeypatch.setattr(loop, "_forward", forward)
    assert main([*ARGV, "--steps", "2", "--json", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert re.search(r"rank 0: stopped at step 1: RuntimeError on rank 0: .*can't allocate memory.* \(out of memory: a "
                     r"smaller --global-batch or --seq-len, more --micro-batches or ranks, or "
                     r"--activation-checkpointing\)", err), err
    r = _json(tmp_path / "r.json")
    assert r["steps"] == [0] and r["error"].startswith("step 1: RuntimeError")
    calls.clear()
    monkeypatch.setattr(loop, "_forward", lambda *a: forward(*a, cuda=True))
    assert main([*ARGV, "--steps", "2"]) == 1
    assert "stopped at step 1: OutOfMemoryError on rank 0: CUDA out of memory" in capsys.readouterr().err


def test_an_evaluation_out_of_memory_stops_the_run_with_a_message(tmp_path, monkeypatch, capsys, one_thread):
    """An allocation that fails in the recall evaluation at the end: exit 1 naming the evaluation, what to shrink
    (--eval-batch) and the checkpoint that holds the trained model, the JSON written with the steps' losses, not
    torch's traceback; the resume the message names evaluates that model at a smaller --eval-batch, training
    nothing."""
    from sparseops.training import loop

    real = loop.recall

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(loop, "recall", oom)
    ck, last = tmp_path / "ck", tmp_path / "ck" / "step_2"
    assert main([*ARGV, "--steps", "2", "--save", str(ck), "--json", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert ("rank 0: stopped at the recall evaluation after 2 steps: OutOfMemoryError on rank 0: CUDA out of memory. "
            "Tried to allocate 9.00 GiB (out of memory: a smaller --eval-batch, or --eval-sequences 0 to skip the "
            f"evaluation; the trained model is saved in {last}: --resume {last} --steps 2 with a smaller --eval-batch "
            "evaluates it without training)\n") in err, err
    r = _json(tmp_path / "r.json")
    assert r["steps"] == [0, 1] and len(r["loss"]) == 2 and r["recall"] is None
    assert r["error"].startswith("the recall evaluation after 2 steps: OutOfMemoryError on rank 0")
    monkeypatch.setattr(loop, "recall", real)
    assert main([*ARGV, "--resume", str(last), "--steps", "2", "--eval-batch", "2", "--json",
                 str(tmp_path / "r.json")]) == 0
    r = _json(tmp_path / "r.json")
    assert r["resumed_from"] == 2 and r["steps"] == [] and 0 <= r["recall"] <= 1


def test_ranks_that_decided_different_resumed_steps_are_stopped():
    """Every rank decides its checkpoint from the files before any collective: ranks that disagree (a checkpoint
    completed between their looks) are refused naming the flag and both steps; ranks that agree pass."""
    from sparseops.cli._resume import different_steps

    assert different_steps([4, 4, 4], "--resume") is None and different_steps([0], "--auto-resume") is None
    assert different_steps([0, 0, 4, 2], "--auto-resume") == (
        "--auto-resume: expected every rank to resume from the same step, got step 0 (no complete checkpoint) on rank "
        "0 and step 4 on rank 2: each rank picks the newest complete checkpoint from the files, and one completed or "
        "went away between the ranks' looks (another job writing there?) or the ranks see different file systems; "
        "relaunch when nothing else writes there")
    assert different_steps([4, 2], "--resume").startswith("--resume: expected every rank to resume from the same "
                                                          "step, got step 4 on rank 0 and step 2 on rank 1: ")


def _resume_steps(rank: int, world: int, cases: list[tuple[list[int], bool]]) -> list[str | None]:
    """``check_same_step`` on this rank of a spawned group for each case ``(steps, auto)``: rank ``r`` resuming
    ``steps[r]`` under ``--auto-resume`` (``auto``) or ``--resume``; its error, or None."""
    import argparse

    from sparseops.cli._resume import check_same_step
    from sparseops.training.checkpoint import LoadFailed

    out = []
    for steps, auto in cases:
        spec = argparse.Namespace(resume=f"ck/step_{steps[rank]}" if steps[rank] else None)
        try:
            check_same_step(argparse.Namespace(resume=None if auto else "ck", auto_resume=auto), spec)
            out.append(None)
        except LoadFailed as exc:
            out.append(str(exc))
    return out


@pytest.mark.distributed
def test_ranks_resuming_different_steps_stop_on_every_rank():
    """The gather itself, at W = 2 (one spawn, no model): every rank raises the same refusal, or none."""
    from sparseops.distributed.launch import spawn

    (differ, agree), again = spawn(_resume_steps, 2, [([0, 4], True), ([4, 4], False)], timeout=60)
    assert (differ, agree) == tuple(again) and agree is None
    assert differ.startswith("--auto-resume: expected every rank to resume from the same step, got step 0 (no "
                             "complete checkpoint) on rank 0 and step 4 on rank 1")
