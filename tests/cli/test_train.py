"""``sparseops train``: the one-process run against the demo's training, bitwise resume, bad flags before any
collective (in this process); layouts against the one-process float64 oracle, resharded resume and the faults
(torchrun subprocesses, marked distributed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sparseops.cli import main
from sparseops.cli.train import config_argv
from sparseops.models.train import TrainConfig, train

from ..models.test_lm import TINY, TINY_TASK

#: the expert FFN a multiple of 32: no activation row ends in a SIMD loop's scalar tail (docs/moe-layer.md)
MODEL = TINY.replace(expert_ffn_size=32)
CFG = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=1, eval_sequences=4, eval_batch=4)
ARGV = ["train", *config_argv(TINY_TASK, MODEL, CFG), "--threads", "1", "--log-every", "1"]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


def test_resume_is_bitwise_and_skips_an_incomplete_checkpoint(tmp_path, one_thread):
    """Saved every 2 steps; the last checkpoint made incomplete: the resumed run starts at step 2 with a
    warning and its losses and final checkpoint (model, optimizer, scheduler, RNG, data) are bitwise the
    uninterrupted run's."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*ARGV, "--save", str(a), "--save-every", "2", "--json", str(tmp_path / "a.json")]) == 0
    whole = json.loads((tmp_path / "a.json").read_text())
    assert whole["checkpoints"] == [str(a / "step_2"), str(a / "step_4")]
    full = _checkpoint(a / "step_4", tmp_path)
    (a / "step_4" / ".metadata").unlink()  # as if the run had died while saving it
    with pytest.warns(UserWarning, match="step_4 is incomplete"):
        assert main([*ARGV, "--resume", str(a), "--save", str(b), "--json", str(tmp_path / "b.json")]) == 0
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["resumed_from"] == 2 and resumed["steps"] == [2, 3]
    assert resumed["loss"] == whole["loss"][2:]
    _assert_same_checkpoint(_checkpoint(b / "step_4", tmp_path), full)


def test_token_file(tmp_path, one_thread):
    ids = torch.randint(0, 50, (4 * 81 * 3,), generator=torch.Generator().manual_seed(0))
    ids.to(torch.uint16).numpy().tofile(tmp_path / "t.bin")
    path = tmp_path / "r.json"
    assert main([*ARGV, "--data", str(tmp_path / "t.bin"), "--eval-sequences", "0", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert len(r["loss"]) == 4 and r["loss"][-1] < r["loss"][0] and r["recall"] is None and r["data"].endswith("t.bin")


@pytest.mark.parametrize("world, extra, match", [
    (4, ["--dp-shard", "3"], "--dp-shard: expected --dp-replicate . --dp-shard = the world size 4"),
    (4, ["--dp-replicate", "3"], "--dp-replicate: expected a divisor of the world size 4, got 3"),
    (4, ["--ep", "3"], "--ep: expected a divisor of --dp-shard = 4, got 3"),
    (4, ["--dp-replicate", "2", "--ep", "2", "--num-experts", "5"], "--ep: expected a divisor of --num-experts = 5"),
    (3, [], "--global-batch: expected a multiple of the world size 3, got 4"),
    (1, ["--resume", "{tmp}/none"], "--resume: expected a directory with a complete checkpoint"),
    (1, ["--save-every", "2"], "--save-every: expected --save DIR with it"),
    (1, ["--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (1, ["--comm-timeout", "0"], "--comm-timeout: expected a number of seconds > 0"),
    (1, ["--seq-len", "20"], "the recall task .--seq-len, --recall-.*: seq_len: expected >"),
    (1, ["--data", "{tmp}/missing.bin"], "path: expected a token file"),
], ids=["world-mismatch", "replicate-not-dividing", "ep-not-dividing-shard", "ep-not-dividing-experts",
        "batch-not-dividing", "resume-nothing", "save-every-alone", "no-steps", "no-timeout", "task", "no-file"])
def test_bad_flags_exit_2_before_any_collective(tmp_path, monkeypatch, capsys, world, extra, match):
    """torchrun's environment without a rendezvous behind it: a check after init_process_group would hang or fail
    otherwise (within the 5 s --comm-timeout, the rendezvous's timeout too); the message names the flag and nothing
    is written."""
    if world > 1:
        for k, v in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(k, v)
    extra = ["--comm-timeout", "5", *(x.replace("{tmp}", str(tmp_path)) for x in extra)]
    assert main([*ARGV, *extra, "--json", str(tmp_path / "r.json"), "--save", str(tmp_path / "ck")]
                if "--save-every" not in extra else [*ARGV, *extra]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "ck").exists()
