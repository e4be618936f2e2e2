"""``sparseops train``'s launch checks: bad flags, a stray or incomplete torchrun environment, a model beyond memory
and a process group that does not form each end with a message naming the cause, before or instead of any
collective, nothing written (docs/training.md, "Checked before any collective")."""

from __future__ import annotations

import re

import pytest
import torch

from sparseops.cli import main
from sparseops.distributed.launch import free_port

from .test_train import ARGV, ARGV_DATA, _json

pytestmark = pytest.mark.usefixtures("eager_cpu_kernels")


@pytest.mark.parametrize("world, extra, match", [
    (4, ["--dp-shard", "3"], "--dp-shard: expected --dp-replicate . --dp-shard = the world size 4"),
    (4, ["--dp-replicate", "3"], "--dp-replicate: expected a divisor of the world size 4, got 3"),
    (4, ["--ep", "3"], "--ep: expected a divisor of --dp-shard = 4, got 3"),
    (4, ["--dp-replicate", "2", "--ep", "2", "--num-experts", "5"], "--ep: expected a divisor of --num-experts = 5"),
    (3, [], "--global-batch: expected a multiple of the world size 3, got 4"),
    (1, ["--resume", "{tmp}/none"], "--resume: expected a directory with a complete checkpoint"),
    (1, ["--save-every", "2"], "--save-every: expected --save DIR with it"),
    (1, ["--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (1, ["--comm-timeout", "0.0004"], r"--comm-timeout: expected a number of seconds in \[1, 604800\], got 0.0004"),
    (1, ["--comm-timeout", "1e10"], r"--comm-timeout: expected a number of seconds in \[1, 604800\], got 10000000000.0"),
    (1, ["--seq-len", "20"], "the recall task .--seq-len, --recall-.*: seq_len: expected >"),
    (1, ["--data", "{tmp}/missing.bin"], "--data: expected a token file, got .*missing.bin' .no such file."),
    (1, ["--data", "/dev/null"], "--data: expected a token file, got '/dev/null' .not a regular file."),
    (1, ["--data", "/dev/null", "--recall-pairs", "3", "--eval-sequences", "2"],
     "--recall-pairs: expected no recall-task flag with --data .*got --recall-pairs --eval-sequences"),
    (1, ["--data-dtype", "uint32"], "--data-dtype: expected --data PATH with it .the recall task reads no file., got "
                                    "--data-dtype uint32"),
    (1, ["--data", "/dev/null", "--eval-sequences", "0", "--eval-batch", "2"],  # --eval-sequences 0: no evaluation
     "--eval-batch: expected no recall-task flag with --data .next-token prediction on the file: no recall task, no "
     "recall evaluation., got --eval-batch$"),
    (1, ["--eval-sequences", "0", "--eval-batch", "2"], "--eval-batch: expected --eval-sequences above 0 with it "
                                                       r"\(0: no recall evaluation\), got --eval-batch 2 with "
                                                       "--eval-sequences 0$"),
    pytest.param(1, ["--device", "cuda"], "--device: expected a machine where torch sees CUDA for 'cuda', got none",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")),
    (2, ["--replicated-tokens", "--ep", "1", "--dp-shard", "2"], "--replicated-tokens: expected no --dp-replicate"),
    (2, ["--replicated-tokens", "--ep", "1"], "--ep: expected the world size 2 .* with --replicated-tokens, got 1"),
    (1, ["--clip", "-1"], "--clip: expected a number > 0 .and finite., got -1.0"),
    (1, ["--weight-decay", "-0.1"], "--weight-decay: expected a number >= 0 .and finite., got -0.1"),
    (1, ["--lr", "1e300"], r"--lr: expected at most 3.403e\+37 .AdamW's first step size, lr / .1 - 0.9., in the "
                           r"range of --dtype., got 1e\+300"),
    (1, ["--weight-decay", "1e300"], r"--weight-decay: expected --lr \* --weight-decay at most 3.403e\+38 .in the range "
                                     r"of --dtype., got 0.01 \* 1e\+300 = 1e\+298"),
    (4, ["--top-k", "5"], "--top-k: expected at most num_experts = 4, got 5"),
    (1, ["--seed", str(2**64)], "--seed: expected an int in .*, got 18446744073709551616"),
    (1, ["--autocast", "bfloat16", "--dtype", "float64"], "--autocast: expected --dtype float32 with it .*got --dtype float64"),
    (4, ["--dsa-dense-steps", "2"], "--dsa-dense-steps: expected --attention dsa with it .*got --attention nsa"),
    (1, ["--dsa-dense-steps", "-1"], "--dsa-dense-steps: expected an int >= 0, got -1"),
    (4, ["--attention", "dsa", "--dsa-dense-steps", "2", "--indexer-loss-coeff", "0"],
     "--dsa-dense-steps: expected --indexer-loss-coeff > 0 with it .*got --indexer-loss-coeff 0"),
    (2, ["--micro-batches", "4"], "--micro-batches: expected a divisor of --global-batch / the data-parallel ranks = "
                                  "4 / 2 = 2, got 4"),
    (2, ["--replicated-tokens", "--micro-batches", "3"], "--micro-batches: expected a divisor of --global-batch / the "
                                                         "data-parallel ranks = 4 / 1 = 4, got 3"),
    (1, ["--micro-batches", "0"], "--micro-batches: expected an int >= 1, got 0"),
], ids=["world-mismatch", "replicate-not-dividing", "ep-not-dividing-shard", "ep-not-dividing-experts",
        "batch-not-dividing", "resume-nothing", "save-every-alone", "no-steps", "timeout-under-a-ms", "timeout-overflowing", "task", "no-file", "data-a-device",
        "recall-flags-with-data", "data-dtype-without-data", "eval-batch-with-data", "eval-batch-no-evaluation",
        "no-cuda",
        "replicated-with-dp", "replicated-ep-1", "negative-clip", "negative-decay", "lr-past-float32", "decay-past-float32", "model", "seed-past-torch",
        "autocast-float64", "dense-steps-nsa", "dense-steps-negative", "dense-steps-no-indexer-loss", "micro-batches-not-dividing", "replicated-micro-batches",
        "no-micro-batches"])
def test_bad_flags_exit_2_before_any_collective(tmp_path, monkeypatch, capsys, world, extra, match):
    """torchrun's environment without a rendezvous behind it: a check after init_process_group would hang or fail
    otherwise (within the 5 s --comm-timeout, the rendezvous's timeout too); the message names the flag and nothing
    is written."""
    if world > 1:
        for k, v in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(k, v)
    extra = ["--comm-timeout", "5", *(x.replace("{tmp}", str(tmp_path)) for x in extra)]
    argv = ARGV_DATA if "--data" in extra else ARGV
    assert main([*argv, *extra, "--json", str(tmp_path / "r.json"), "--save", str(tmp_path / "ck")]
                if not {"--save-every", "--replicated-tokens"} & set(extra) else [*argv, *extra]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "ck").exists()


def test_a_group_that_does_not_form_is_named_and_launch_problems_are_reported_per_node(tmp_path, monkeypatch,
                                                                                       capsys):
    """A rank whose peers never join (one failed its launch checks on another node, or never started): exit 1
    within --comm-timeout naming the group, the address and torch's own error, not torch's traceback; rank 0 (the
    store's host, waiting for clients) writes the JSON with the error. A launch check's message comes from rank 0
    and from each other node's first rank (prefixed with its rank: it may see other files), not from every rank."""
    port = free_port()
    for k, v in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        capsys.readouterr()
        assert main([*ARGV, "--comm-timeout", "1", "--json", str(tmp_path / "r.json")]) == 1
        err = capsys.readouterr().err
        assert (f"sparseops train: rank {rank}: the process group of 2 ranks did not form at 127.0.0.1:{port} within "
                "--comm-timeout 1 s (Dist") in err
        assert err.rstrip().endswith("a rank that failed its launch checks exits 2 without joining (its message is "
                                     "in its node's output), or a rank did not start") and "Traceback" not in err
        assert (tmp_path / "r.json").exists() == (rank == 0)
    r = _json(tmp_path / "r.json")
    assert r["steps"] == [] and r["error"].startswith("the process group of 2 ranks did not form")
    monkeypatch.setenv("RANK", "1")
    for local, shown in ((1, False), (0, True)):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert main([*ARGV, "--steps", "0"]) == 2
        err = capsys.readouterr().err
        assert err == ("sparseops train: rank 1: --steps: expected an int >= 1, got 0\n" if shown else "")


@pytest.mark.parametrize("env, missing", [({"WORLD_SIZE": "2"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
                                          ({"WORLD_SIZE": "1", "RANK": "0"}, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
                                          ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a",
                                            "MASTER_PORT": "1"}, None)], ids=["world-alone", "no-master", "rank-2-of-2"])
def test_a_stray_world_size_is_named_not_torchs_traceback(tmp_path, monkeypatch, capsys, env, missing):
    """WORLD_SIZE without the rest of torchrun's environment (a stray variable): exit 2 naming the variables,
    not a KeyError or torch's env:// rendezvous traceback; nothing written."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([*ARGV, "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "sparseops train: expected torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, " in err
    assert (f"(missing: {missing}): launch with torchrun" if missing else "RANK='2', WORLD_SIZE='2'") in err
    assert list(tmp_path.iterdir()) == []


def test_a_vocabulary_beyond_memory_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    """A uint16 token file read as uint32 makes ids in the billions: the embedding the largest id + 1 sets (or a
    --vocab-size, or model flags) above the memory is exit 2 naming the flag, before any collective, not torch's
    allocator failing after the process group exists (512 GiB here, float64); the routed experts count too (every
    rank builds the full model before parallelize shards them)."""
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    ids = torch.arange(4 * 81) % 24
    ids[7] = 2**32 - 1
    ids.to(torch.uint32).numpy().tofile(tmp_path / "t.bin")
    out = ["--comm-timeout", "5", "--dtype", "float64", "--json", str(tmp_path / "r.json"), "--save",
           str(tmp_path / "ck")]
    data = [*ARGV_DATA, "--data", str(tmp_path / "t.bin"), "--data-dtype", "uint32"]
    for argv, match in ((data, r"--data: expected token ids that make a vocabulary the model can hold, got a largest "
                               r"id of 4294967295 \(--data-dtype uint32\): 512.0 GiB of parameters on each "
                               r"rank, above the [\d.]+ GiB of memory"),
                        ([*data, "--vocab-size", str(2**33)], "--vocab-size: expected a vocabulary the model can hold, "
                                                              "got 8589934592: 1024.0 GiB"),
                        ([*ARGV, "--hidden-size", str(2**33)], r"the model \(--hidden-size ... flags\): expected "
                                                               "parameters that fit in memory"),
                        # the experts count (allocated whole, then sharded): 776 GiB, of them the routers' 8 GiB
                        ([*ARGV, "--num-experts", str(2**26)],
                         r"the model .*: expected parameters that fit in memory, got 776\.\d GiB")):
        assert main([*argv, *out]) == 2
        assert re.search(match, capsys.readouterr().err)
    assert sorted(tmp_path.iterdir()) == [tmp_path / "t.bin"]
