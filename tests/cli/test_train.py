"""``sparseops train``: the one-process run against the demo's training, bitwise resume, bad flags before any
collective (in this process); layouts against the one-process float64 oracle, resharded resume and the faults
(torchrun subprocesses, marked distributed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparseops.cli import main
from sparseops.cli.train import config_argv
from sparseops.distributed.launch import free_port
from sparseops.models.train import TrainConfig, train
from sparseops.testing import TOLERANCES, torch_threads

from ..models.test_lm import TINY, TINY_TASK

#: the expert FFN a multiple of 32: no activation row ends in a SIMD loop's scalar tail (docs/moe-layer.md)
MODEL = TINY.replace(expert_ffn_size=32)
CFG = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=1, eval_sequences=4, eval_batch=4)
ARGV = ["train", *config_argv(TINY_TASK, MODEL, CFG), "--threads", "1", "--log-every", "1"]
#: ARGV without the recall task's flags and its evaluation's, for --data runs (which refuse them)
_PAIRS = list(zip(ARGV[1::2], ARGV[2::2]))
ARGV_DATA = ["train", *(x for f, v in _PAIRS if not f.startswith(("--recall-", "--eval-")) for x in (f, v))]


pytestmark = pytest.mark.usefixtures("eager_cpu_kernels")


def _checkpoint(path: Path, tmp_path: Path) -> dict:
    """Every tensor and value of a DCP checkpoint, read in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _assert_same_checkpoint(a: dict, b: dict, rng: bool = True) -> None:
    flat_a, flat_b = _flat(a), _flat(b)
    if not rng:
        flat_a = {k: v for k, v in flat_a.items() if ".rng." not in k}
        flat_b = {k: v for k, v in flat_b.items() if ".rng." not in k}
    assert flat_a.keys() == flat_b.keys()
    for k, v in flat_a.items():
        assert torch.equal(v, flat_b[k]) if isinstance(v, torch.Tensor) else v == flat_b[k], k


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_one_process_is_the_demo_training(tmp_path, one_thread):
    """Without torchrun: one process, every loss and the recall bitwise those of ``models.train.train``."""
    path = tmp_path / "r.json"
    assert main([*ARGV, "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    want = train(MODEL, TINY_TASK, CFG)
    assert r["loss"] == want["loss"] and r["recall"] == want["recall"]
    assert r["steps"] == [0, 1, 2, 3] and r["resumed_from"] is None and r["world_size"] == 1
    assert r["dims"] == {"dp_replicate": 1, "dp_shard": 1, "ep": 1} and r["data_parallel"] == "fsdp"
    assert r["error"] is None


def test_resume_is_bitwise_and_skips_an_incomplete_checkpoint(tmp_path, monkeypatch, capsys, one_thread):
    """Two micro-batches per step, saved every 2 steps; the last checkpoint made incomplete: the resumed run starts
    at step 2 with a warning, takes the checkpoint's --micro-batches and, with --activation-checkpointing added,
    its losses and final checkpoint (model, optimizer, scheduler, RNG, data) are bitwise the uninterrupted run's.
    Its M kept at W = 4 (B / W = 1 sequence a rank) is refused before any collective, naming the flag to change."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*ARGV, "--micro-batches", "2", "--save", str(a), "--save-every", "2", "--json",
                 str(tmp_path / "a.json")]) == 0
    whole = json.loads((tmp_path / "a.json").read_text())
    assert whole["checkpoints"] == [str(a / "step_2"), str(a / "step_4")]
    full = _checkpoint(a / "step_4", tmp_path)
    (a / "step_4" / ".metadata").unlink()  # as if the run had died while saving it
    with pytest.warns(UserWarning, match="step_4 is incomplete"):
        assert main([*ARGV, "--resume", str(a), "--activation-checkpointing", "--save", str(b), "--json",
                     str(tmp_path / "b.json")]) == 0
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["resumed_from"] == 2 and resumed["steps"] == [2, 3] and resumed["micro_batches"] == 2
    assert resumed["loss"] == whole["loss"][2:]
    _assert_same_checkpoint(_checkpoint(b / "step_4", tmp_path), full)
    for k, v in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert main([*ARGV, "--resume", str(b), "--comm-timeout", "5"]) == 2
    assert ("--micro-batches: expected a divisor of --global-batch / the data-parallel ranks = 4 / 4 = 1, got 2 (the "
            "checkpoint's, which --resume keeps: give --micro-batches to change it)") in capsys.readouterr().err


def test_token_file(tmp_path, one_thread):
    ids = torch.randint(0, 50, (4 * 81 * 3,), generator=torch.Generator().manual_seed(0))
    ids.to(torch.uint16).numpy().tofile(tmp_path / "t.bin")
    path = tmp_path / "r.json"
    assert main([*ARGV_DATA, "--data", str(tmp_path / "t.bin"), "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert len(r["loss"]) == 4 and r["loss"][-1] < r["loss"][0] and r["recall"] is None and r["data"].endswith("t.bin")


def _micro_batch_oracle(micro: list[int], clip: float) -> tuple[list[float], list[list[torch.Tensor]]]:
    """The float64 losses and gradients (clipped, as the optimizer takes them) of each step of the definition with
    ``micro[s]`` micro-batches of consecutive sequences at step ``s``, from one backward of the whole objective:
    every cross-entropy over the step's target count, plus the mean of the micro-batches' aux losses
    (docs/training.md, "One step"); the demo's clipping, AdamW and schedule."""
    import torch.nn.functional as F

    from sparseops.models.lm import expert_parameter
    from sparseops.models.recall import IGNORE_INDEX
    from sparseops.models.train import build_model, grad_norm_sq, lr_factor

    model = build_model(MODEL.replace(vocab_size=TINY_TASK.vocab_size), CFG.seed, torch.float64, "cpu")
    named = list(model.named_parameters())
    replicated, experts = ([p for n, p in named if expert_parameter(n) == e] for e in (False, True))
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr, betas=(0.9, 0.95), weight_decay=CFG.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, CFG))
    gen, L = torch.Generator().manual_seed(CFG.seed), TINY_TASK.seq_len
    losses, grads = [], []
    for m in micro:
        batch = TINY_TASK.sample(CFG.batch_size, gen)
        ce = aux = 0.0
        cu = list(range(0, CFG.batch_size // m * L + 1, L))
        for tokens, targets in zip(batch.tokens.view(m, -1), batch.targets.view(m, -1)):
            logits, part = model(tokens, cu)
            ce = ce + F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            aux = aux + part / m
        loss = ce / (CFG.batch_size * TINY_TASK.num_queries) + aux
        opt.zero_grad(set_to_none=False)
        loss.backward()
        coef = (clip / (grad_norm_sq(replicated, experts).sqrt() + 1e-6)).clamp(max=1.0)
        for p in replicated + experts:
            p.grad.mul_(coef)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses, grads


def test_micro_batches(tmp_path, monkeypatch, capsys, one_thread):
    """``--micro-batches 2`` in float64: with the aux loss off, the one-micro-batch run's losses up to rounding (the
    cross-entropy is the same sum over the step's targets; --activation-checkpointing on too, which recomputes every
    block and is bitwise the plain run in the bitwise-resume test); with it on, the definition's losses and every
    gradient the optimizer takes (the oracle above; the clip out of the way, which would hide a gradient's scale
    from Adam). The JSON records both settings. Its step-2 checkpoint resumed with ``--micro-batches 4`` (a
    relaunch on fewer ranks): the definition with M = 4 from step 2 on, a notice, M = 4 recorded for a later
    resume."""
    from sparseops.models.lm import Block
    from sparseops.testing import TRAINING_TOLERANCE, rel_rms_error

    runs, recomputed, grads = {}, [], []
    adam_step = torch.optim.AdamW.step

    def record(opt, *args, **kwargs):
        if name == "m2":
            grads.append([p.grad.clone() for p in opt.param_groups[0]["params"]])
        return adam_step(opt, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)

    def count(module, args):  # a block called inside a backward: the checkpoint's recompute (which may stop early)
        if isinstance(module, Block) and torch._C._current_graph_task_id() != -1:
            recomputed.append(name)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        for name, extra in (("m1-aux0", ["--aux-loss-coeff", "0"]),
                            ("m2-aux0", ["--aux-loss-coeff", "0", "--micro-batches", "2", "--activation-checkpointing"]),
                            ("m2", ["--micro-batches", "2", "--clip", "1e6", "--save", str(tmp_path / "ck"),
                                    "--save-every", "2"])):
            assert main([*ARGV, *F64, *extra, "--json", str(tmp_path / f"{name}.json")]) == 0
            runs[name] = _json(tmp_path / f"{name}.json")
    finally:
        hook.remove()
    assert recomputed == ["m2-aux0"] * (CFG.steps * 2 * MODEL.num_layers)  # every block, every micro-batch
    assert _rel(runs["m2-aux0"]["loss"], runs["m1-aux0"]["loss"]) <= F64_RTOL
    monkeypatch.setattr(torch.optim.AdamW, "step", adam_step)
    want_loss, want_grads = _micro_batch_oracle([2] * CFG.steps, clip=1e6)
    assert _rel(runs["m2"]["loss"], want_loss) <= F64_RTOL and len(grads) == CFG.steps
    for s, (got, want) in enumerate(zip(grads, want_grads)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert rel_rms_error(g, w) <= TRAINING_TOLERANCE, (s, i)
    assert [(r["micro_batches"], r["activation_checkpointing"]) for r in runs.values()] == [
        (1, False), (2, True), (2, False)]
    _resume_with_other_micro_batches(tmp_path, capsys, want_loss)


def _resume_with_other_micro_batches(tmp_path: Path, capsys, m2_loss: list[float]) -> None:
    """The M = 2 run's step-2 checkpoint resumed with ``--micro-batches 4``: the oracle switching M at step 2, which
    differs from the M = 2 run's losses far beyond rounding there (the aux loss is the mean over micro-batches)."""
    from sparseops.cli import build_parser
    from sparseops.cli.train import build_spec
    from sparseops.training.checkpoint import read_values

    ck = tmp_path / "resume"
    shutil.copytree(tmp_path / "ck" / "step_2", ck / "step_2")
    capsys.readouterr()
    assert main([*ARGV, *F64, "--clip", "1e6", "--resume", str(ck), "--micro-batches", "4", "--save", str(ck),
                 "--json", str(tmp_path / "m4.json")]) == 0
    r, want = _json(tmp_path / "m4.json"), _micro_batch_oracle([2, 2, 4, 4], clip=1e6)[0]
    assert r["resumed_from"] == 2 and r["micro_batches"] == 4
    assert _rel(r["loss"], want[2:]) <= F64_RTOL < 1e-3 * _rel(m2_loss[2:], want[2:])
    assert ("--micro-batches 4 from step 2 on, the checkpoint's 2 before: the MoE load-balance loss, a mean over "
            "the micro-batches, another function" in capsys.readouterr().out)
    assert read_values(ck / "step_4", ["train.settings.micro-batches"]) == {"train.settings.micro-batches": 4}
    spec = build_spec(build_parser().parse_args(["train", "--resume", str(ck)]), 1)
    assert spec.micro_batches == 4 and spec.resumed_micro_batches is None
    assert spec.dtype == torch.float64  # the checkpoint's --dtype, left out; given, it may change (DCP casts)
    assert build_spec(build_parser().parse_args(["train", "--resume", str(ck), "--dtype", "float32"]),
                      1).dtype == torch.float32
    with pytest.raises(ValueError, match=r"got --dtype float64 \(the checkpoint's, which --resume keeps\)$"):
        build_spec(build_parser().parse_args(["train", "--resume", str(ck), "--autocast", "bfloat16"]), 1)


def test_config_argv_spells_out_every_setting():
    """The demo's EP rerun passes its settings as flags: they must come back whole (rope_theta None too)."""
    import argparse
    import dataclasses

    from sparseops.cli import train as cli_train
    from sparseops.models.train import demo_setup

    task, model, cfg = demo_setup(seed=3)
    task, model = dataclasses.replace(task, num_pairs=3), model.replace(top_k=1)  # not the defaults
    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)
    spec = cli_train.build_spec(parser.parse_args(config_argv(task, model, cfg)), 1)
    assert spec.task == task and spec.model == model and spec.optim == cfg and model.rope_theta is None
    cfg = dataclasses.replace(cfg, eval_sequences=0)  # no evaluation: no --eval-batch, which would be refused
    assert cli_train.build_spec(parser.parse_args(config_argv(task, model, cfg)), 1).optim == cfg


# --- torchrun subprocesses ------------------------------------------------------------------------------------

#: seconds any one torchrun job may take (start-up is several seconds per process on 2 busy cores)
JOB_TIMEOUT = 240
#: the layout every multi-rank job here starts from: 2 ranks, FSDP, the experts split in two
LAYOUT = ["--dp-shard", "2", "--ep", "2"]
F64 = ["--dtype", "float64"]


def _env(**extra) -> dict:
    """This environment for a torchrun job: this checkout's sources first, one thread per rank, no fault
    unless ``extra`` injects one."""
    import sparseops

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(sparseops.__file__).parents[1]), env.get("PYTHONPATH", "")])
    env.pop("SPARSEOPS_TRAIN_FAULT", None)
    env.update(extra)
    return env


def _launch(agent_args: list[str], train_args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *agent_args, "-m", "sparseops",
                             *train_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], str]:
    out = []
    try:
        for p in procs:
            out.append(p.communicate(timeout=JOB_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], "\n".join(out)


def torchrun(nproc: int, train_args: list[str], agent: tuple[str, ...] = (), **env) -> tuple[int, str, float]:
    """``torchrun --standalone --nproc-per-node nproc *agent -m sparseops train ...``: exit status, output,
    seconds."""
    t0 = time.monotonic()
    rcs, out = _wait([_launch(["--standalone", "--nproc-per-node", str(nproc), *agent], ["train", *train_args],
                              _env(**env))])
    return rcs[0], out, time.monotonic() - t0


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def main_one_thread(argv: list[str]) -> int:
    """``sparseops train`` in this process on one torch thread (the EP ranks' count: module fixtures, which the
    ``one_thread`` fixture cannot serve)."""
    with torch_threads(1):
        return main(argv)


def _rel(a: list[float], b: list[float]) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    return float(((a - b).abs() / b.abs()).max())


#: the W = 2 runs agree with the one-process float64 run to rounding (docs/training.md, "Gradients")
F64_RTOL = 1e-9


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The one-process float64 run (4 steps) and the W = 2 run of the same flags, launched as two torchrun agents
    of one rank each (``--nnodes 2``, c10d rendezvous on 127.0.0.1), checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("train")
    assert main_one_thread([*ARGV, *F64, "--save", str(root / "one"), "--json", str(root / "one.json")]) == 0
    port = free_port()
    agent = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", f"sparseops-{port}"]
    args = [*ARGV[1:], *F64, *LAYOUT, "--save", str(root / "two"), "--save-every", "2", "--json",
            str(root / "two.json")]
    rcs, out = _wait([_launch(agent, ["train", *args], _env()) for _ in range(2)])
    assert rcs == [0, 0], out
    return root


@pytest.mark.distributed
def test_two_nodes_match_the_float64_oracle(oracle):
    one, two = _json(oracle / "one.json"), _json(oracle / "two.json")
    assert two["world_size"] == 2 and two["dims"] == {"dp_replicate": 1, "dp_shard": 2, "ep": 2}
    assert two["data_parallel"] == "fsdp" and two["steps"] == [0, 1, 2, 3]
    assert _rel(two["loss"], one["loss"]) <= F64_RTOL and two["recall"] == one["recall"]
    assert (oracle / "two" / "step_2" / ".metadata").is_file() and (oracle / "two" / "step_4" / ".metadata").is_file()


@pytest.mark.distributed
def test_resharded_resume(oracle, tmp_path, one_thread):
    """The W = 2 (ep 2) checkpoint of step 2 resumed in one process (ep 1) and at W = 4 (HSDP-like DDP layout,
    dp_replicate 2 x dp_shard 2, ep 2): the oracle's losses to rounding; at W = 4 a NaN injected into rank 3's
    loss at step 3 then stops every rank before the optimizer step, naming the step and the rank."""
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(oracle / "two" / "step_2", ck / "step_2")
    want = _json(oracle / "one.json")["loss"]
    assert main([*ARGV, *F64, "--resume", str(ck), "--json", str(tmp_path / "r1.json")]) == 0
    r1 = _json(tmp_path / "r1.json")
    assert r1["resumed_from"] == 2 and r1["steps"] == [2, 3] and _rel(r1["loss"], want[2:]) <= F64_RTOL
    rc, out, _ = torchrun(4, [*ARGV[1:], *F64, "--dp-replicate", "2", "--ep", "2", "--ddp", "--resume", str(ck),
                              "--json", str(tmp_path / "r4.json")], SPARSEOPS_TRAIN_FAULT="nan:rank=3:step=3")
    assert rc != 0
    r4 = _json(tmp_path / "r4.json")
    assert r4["world_size"] == 4 and r4["data_parallel"] == "ddp" and r4["resumed_from"] == 2
    assert r4["steps"] == [2] and _rel(r4["loss"], want[2:3]) <= F64_RTOL
    assert r4["error"].startswith("step 3: non-finite loss on rank(s) [3]")
    assert out.count("stopped at step 3: non-finite loss on rank(s) [3]") == 4, out  # every rank, before the step


@pytest.mark.distributed
def test_killed_rank_restarted_by_torchrun_resumes_bitwise(oracle, tmp_path):
    """One command, ``torchrun --max-restarts 1 ... --auto-resume``: rank 1 killed (SIGKILL) at step 3 of the first
    attempt, torchrun restarts the group, which resumes from step 2 of its --save DIR and finishes; the losses and
    final checkpoint are bitwise those of the uninterrupted run at the same layout."""
    ck = tmp_path / "ck"
    args = [*ARGV[1:], *F64, *LAYOUT, "--save", str(ck), "--save-every", "2", "--auto-resume", "--json",
            str(tmp_path / "r.json")]
    rc, out, _ = torchrun(2, args, ("--max-restarts", "1"), SPARSEOPS_TRAIN_FAULT="kill:rank=1:step=3:restart=0",
                          TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert rc == 0, out
    assert out.count("starting at step 0") == 1 and f"--auto-resume: resuming from {ck / 'step_2'}" in out, out
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in out, out  # no warning: each attempt has its own store
    r, whole = _json(tmp_path / "r.json"), _json(oracle / "two.json")
    assert r["resumed_from"] == 2 and r["steps"] == [2, 3] and r["loss"] == whole["loss"][2:]
    _assert_same_checkpoint(_checkpoint(ck / "step_4", tmp_path), _checkpoint(oracle / "two" / "step_4", tmp_path))


@pytest.mark.distributed
def test_hung_rank_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 stops responding at step 1: rank 0's next collective times out after --comm-timeout, it exits
    naming the step, torchrun ends the rest; the job ends in start-up + timeout + a bound, not in the 300 s
    default."""
    timeout = 5
    rc, out, seconds = torchrun(2, [*ARGV[1:], *LAYOUT, "--comm-timeout", str(timeout)],
                                SPARSEOPS_TRAIN_FAULT="hang:rank=1:step=1")
    assert rc != 0
    assert "rank 0: stopped at step 1: RuntimeError on rank 0: " in out and "Timed out" in out, out
    assert seconds < timeout + 60, seconds


@pytest.mark.distributed
def test_autocast_bf16_at_w2_matches_the_one_process_autocast_run(tmp_path, one_thread):
    """``--autocast bfloat16`` (fp32 parameters, the forward under autocast): the W = 2 run (FSDP, ep 2) gives the
    one-process autocast run's losses within the bf16 tolerance and much closer to them than to the fp32 run's
    (autocast did run, at every rank alike, also in the recompute of ``--activation-checkpointing``); the JSON
    records it."""
    runs = {}
    for name, extra in (("fp32", []), ("bf16", ["--autocast", "bfloat16"])):
        assert main([*ARGV, *extra, "--json", str(tmp_path / f"{name}.json")]) == 0
        runs[name] = _json(tmp_path / f"{name}.json")
    rc, out, _ = torchrun(2, [*ARGV[1:], "--autocast", "bfloat16", *LAYOUT, "--activation-checkpointing", "--json",
                              str(tmp_path / "two.json")])
    assert rc == 0, out
    two, one = _json(tmp_path / "two.json"), runs["bf16"]
    assert one["autocast"] == two["autocast"] == "bfloat16" and runs["fp32"]["autocast"] is None
    assert _rel(two["loss"], one["loss"]) <= TOLERANCES[torch.bfloat16], (two["loss"], one["loss"])
    # closer to the one-process autocast run than that run is to the fp32 run (docs/training.md, "Mixed
    # precision"): the bf16 tolerance alone would also pass the fp32 run's losses
    assert 3 * _rel(two["loss"], one["loss"]) < _rel(runs["fp32"]["loss"], one["loss"])
    assert "float32 under autocast bfloat16" in out
