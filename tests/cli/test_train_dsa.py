"""``sparseops train --attention dsa --dsa-dense-steps N`` (docs/dsa.md, "The two stages in ``sparseops train``"):
the warm-up freezes every parameter but the indexers', its losses and the sparse stage after it against a direct
computation with the layers in ``dense_warmup`` mode, resumes inside and at the end of the warm-up, and the
W = 2 layouts (FSDP, DDP, replicated tokens; torchrun subprocesses, marked distributed) against the one-process
float64 run."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from sparseops.cli import build_parser, main
from sparseops.cli.train import build_spec
from sparseops.models.recall import IGNORE_INDEX
from sparseops.models.train import build_model, lr_factor
from sparseops.nn import DeepSeekSparseAttention
from sparseops.testing import TRAINING_TOLERANCE, rel_rms_error
from sparseops.training.loop import make_data

from .test_train import (
    ARGV,
    F64,
    F64_RTOL,
    LAYOUT,
    _assert_same_checkpoint,
    _checkpoint,
    _flat,
    _json,
    _rel,
    main_one_thread,
    torchrun,
)

pytestmark = pytest.mark.usefixtures("eager_cpu_kernels")

DSA = ["--attention", "dsa", "--dsa-topk", "8", "--index-heads", "2", "--index-head-dim", "8"]
#: two warm-up steps of the four: the warm-up, the transition and two sparse steps
N = 2
#: two micro-batches per step: the warm-up and the sparse stage accumulate (their aux and indexer losses each
#: micro-batch's)
M = 2
WARM = [*DSA, "--dsa-dense-steps", str(N), "--micro-batches", str(M), *F64]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process float64 run, a checkpoint after every step."""
    root = tmp_path_factory.mktemp("dsa")
    assert main_one_thread([*ARGV, *WARM, "--save", str(root / "ck"), "--save-every", "1", "--json",
                            str(root / "one.json")]) == 0
    return root


def _indexer_names(model) -> set[str]:
    ids = {id(p) for m in model.modules() if isinstance(m, DeepSeekSparseAttention) for p in m.indexer_parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def _initial():
    """The run's spec, data and initial model (float64)."""
    spec = build_spec(build_parser().parse_args([*ARGV, *WARM]), 1)
    data = make_data(spec)
    model = build_model(spec.model.replace(vocab_size=data.vocab_size), spec.optim.seed, torch.float64,
                        torch.device("cpu"))
    return spec, data, model


def _reference():
    """The run computed directly, each step's loss the sum over its M micro-batches of their cross-entropy over the
    step's targets and their aux terms over M: the layers in ``dense_warmup`` mode for the first N steps, where the gradient of
    the reported loss is taken with respect to the indexers' parameters alone (the LM and MoE losses do not reach
    them) and one AdamW steps those; then the sparse stage, where a second AdamW, fresh, steps the rest, its
    schedule the run's from step N. Returns the losses and the final parameters."""
    spec, data, model = _initial()
    cfg = spec.optim
    layers = [m for m in model.modules() if isinstance(m, DeepSeekSparseAttention)]
    names = _indexer_names(model)
    indexer = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]

    def adamw(params, offset):
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s + offset, cfg))

    stages = [adamw(indexer, 0), adamw(rest, N)]
    losses = []
    for step in range(cfg.steps):
        warm = step < N
        for layer in layers:
            layer.dense_warmup = warm
        loss = 0.0
        for tokens, targets, cu, n in data.batches(step, micro_batches=M):
            logits, aux = model(tokens, cu.tolist())
            loss = loss + F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / n + aux / M
        losses.append(float(loss.detach()))
        params = indexer if warm else indexer + rest
        grads = torch.autograd.grad(loss, params, materialize_grads=True)
        norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        for p, g in zip(params, grads):
            p.grad = g * (cfg.clip / (norm + 1e-6)).clamp(max=1.0)
        for opt, sched in stages[:1] if warm else stages:
            opt.step()
            sched.step()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_warmup_and_sparse_stage_equal_a_direct_computation(one, tmp_path):
    """The losses of the four steps (two in the warm-up, two sparse) and the final parameters equal the direct
    computation; after the warm-up every parameter but the indexers' is bitwise the initial model's and has no
    AdamW state, the indexers' changed; at the end the AdamW step counts are 4 (indexers) and 2 (the rest)."""
    r = _json(one / "one.json")
    assert r["dsa_dense_steps"] == N and r["attention"] == "dsa" and r["steps"] == [0, 1, 2, 3]
    want_loss, want = _reference()
    assert _rel(r["loss"], want_loss) <= TRAINING_TOLERANCE, (r["loss"], want_loss)
    end = _checkpoint(one / "ck" / "step_4", tmp_path)
    for k, v in want.items():
        assert rel_rms_error(end["model"][k], v) <= TRAINING_TOLERANCE, k
    model = _initial()[2]
    initial, names = model.state_dict(), _indexer_names(model)
    warm = _checkpoint(one / "ck" / f"step_{N}", tmp_path)
    assert names and set(warm["optim"]["state"]) == names
    for k, v in initial.items():
        assert torch.equal(warm["model"][k], v) != (k in names), k
    assert {k: float(s["step"]) for k, s in end["optim"]["state"].items()} == {
        k: 4.0 if k in names else 2.0 for k in initial}


@pytest.mark.parametrize("step", [1, N], ids=["inside-the-warmup", "at-its-end"])
def test_resume_in_the_warmup_is_bitwise(one, tmp_path, one_thread, step):
    """Resumed from the checkpoint after step 1 (inside the warm-up) and after step N (its end: the frozen
    parameters have no AdamW state yet, the next step trains them): the losses and the final checkpoint are
    bitwise the uninterrupted run's."""
    ck = tmp_path / "ck"
    shutil.copytree(one / "ck" / f"step_{step}", ck / f"step_{step}")
    assert main([*ARGV, *DSA, *F64, "--resume", str(ck), "--save", str(ck), "--json", str(tmp_path / "r.json")]) == 0
    r, whole = _json(tmp_path / "r.json"), _json(one / "one.json")
    assert r["resumed_from"] == step and r["dsa_dense_steps"] == N and r["loss"] == whole["loss"][step:]
    _assert_same_checkpoint(_checkpoint(ck / "step_4", tmp_path), _checkpoint(one / "ck" / "step_4", tmp_path))


def _assert_close_checkpoint(a: dict, b: dict) -> None:
    """The model and the optimizer state of two checkpoints within the training tolerance."""
    flat_a, flat_b = (_flat({"model": c["model"], "optim": c["optim"]["state"]}) for c in (a, b))
    assert flat_a.keys() == flat_b.keys()
    for k, v in flat_a.items():
        assert (rel_rms_error(v, flat_b[k]) <= TRAINING_TOLERANCE if v.is_floating_point() and v.dim()
                else torch.equal(v, flat_b[k])), k


@pytest.mark.distributed
def test_two_ranks_fsdp_and_ddp_match_the_one_process_run(one, tmp_path, one_thread):
    """W = 2, ep 2, float64, two micro-batches a step, the indexer loss a per-rank mean averaged over the ranks: FSDP
    from step 0 with ``--activation-checkpointing`` gives the one-process losses and recall, its warm-up checkpoint
    the frozen parameters bitwise; DDP resumed from its checkpoint inside the warm-up (DDP finds the frozen
    parameters unused, then trains them) gives the one-process losses, parameters and optimizer state, until a NaN
    in rank 1's first micro-batch of step 3 stops both ranks after the step's last forward, before the optimizer
    step, naming the step and the rank; the FSDP checkpoint at the warm-up's end resumed in one process (the
    optimizer state of parameters that have not stepped, resharded) the same losses."""
    want = _json(one / "one.json")
    rc, out, _ = torchrun(2, [*ARGV[1:], *WARM, *LAYOUT, "--activation-checkpointing", "--save", str(tmp_path / "two"),
                              "--save-every", "1", "--json", str(tmp_path / "two.json")])
    assert rc == 0, out
    two = _json(tmp_path / "two.json")
    assert two["world_size"] == 2 and two["dsa_dense_steps"] == N
    assert (two["micro_batches"], two["activation_checkpointing"]) == (M, True)
    assert _rel(two["loss"], want["loss"]) <= F64_RTOL and two["recall"] == want["recall"]
    frozen_one, frozen_two = (_checkpoint(d / f"step_{N}", tmp_path)["model"] for d in (one / "ck", tmp_path / "two"))
    names = _indexer_names(_initial()[2])
    for k, v in frozen_one.items():  # the frozen ones bitwise the initial model's
        assert (rel_rms_error(frozen_two[k], v) <= TRAINING_TOLERANCE if k in names else torch.equal(frozen_two[k], v)), k
    for name, step in (("ddp", 1), ("one", N)):
        shutil.copytree(tmp_path / "two" / f"step_{step}", tmp_path / name / f"step_{step}")
    rc, out, _ = torchrun(2, [*ARGV[1:], *DSA, *F64, *LAYOUT, "--ddp", "--resume", str(tmp_path / "ddp"), "--save",
                              str(tmp_path / "ddp"), "--save-every", "1", "--json", str(tmp_path / "ddp.json")],
                          SPARSEOPS_TRAIN_FAULT="nan:rank=1:step=3")
    assert rc != 0
    ddp = _json(tmp_path / "ddp.json")
    assert ddp["data_parallel"] == "ddp" and ddp["resumed_from"] == 1 and ddp["dsa_dense_steps"] == N
    assert ddp["micro_batches"] == M and ddp["steps"] == [1, 2]
    assert _rel(ddp["loss"], want["loss"][1:3]) <= F64_RTOL
    assert ddp["error"].startswith("step 3: non-finite loss on rank(s) [1]")
    assert out.count("stopped at step 3: non-finite loss on rank(s) [1]") == 2, out
    _assert_close_checkpoint(_checkpoint(tmp_path / "ddp" / "step_3", tmp_path),
                             _checkpoint(one / "ck" / "step_3", tmp_path))
    assert main([*ARGV, *DSA, *F64, "--resume", str(tmp_path / "one"), "--json", str(tmp_path / "r.json")]) == 0
    assert _rel(_json(tmp_path / "r.json")["loss"], want["loss"][N:]) <= F64_RTOL


@pytest.mark.distributed
def test_replicated_tokens_is_bitwise_the_one_process_run(one, tmp_path):
    """``--replicated-tokens`` (the demo's exact EP mode) at W = 2 through the warm-up and the sparse stage: every
    rank runs the whole batch, the MoE layers split its tokens; every float64 loss and the recall bitwise the
    one-process run's (with ``--activation-checkpointing``: the recompute repeats each MoE layer's collectives in
    the sparse steps' backward; in the warm-up's, which reaches the indexers alone, none runs on any rank). The
    NSA model's replicated run is the demo's EP rerun (tests/cli/test_demo.py)."""
    rc, out, _ = torchrun(2, [*ARGV[1:], *WARM, "--ep", "2", "--replicated-tokens", "--activation-checkpointing",
                              "--json", str(tmp_path / "r.json")])
    assert rc == 0, out
    r, want = _json(tmp_path / "r.json"), _json(one / "one.json")
    assert r["dims"] == {"dp_replicate": 1, "dp_shard": 1, "ep": 2} and r["data_parallel"] == "none"
    assert (r["dsa_dense_steps"], r["micro_batches"]) == (N, M)
    assert r["loss"] == want["loss"] and r["recall"] == want["recall"]
