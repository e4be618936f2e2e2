"""Expert-parallel training against the one-process run (spawned gloo processes), and the gradient norm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseops.distributed import spawn
from sparseops.models.train import (
    TrainConfig,
    _ep_worker,
    demo_setup,
    grad_norm_sq,
    train,
    train_expert_parallel,
)

from .test_lm import TINY, TINY_TASK

TIMEOUT = 240.0
#: the expert FFN a multiple of 32: no activation row ends in a SIMD loop's scalar tail (docs/moe-layer.md)
MODEL = TINY.replace(expert_ffn_size=32)
#: (ep_mode, dispatcher) of the runs that add in another order than the one-process run
OTHER_MODES = (("data", "alltoall"), ("replicated", "allgather"))


def _other_modes(rank: int, world: int, cfg: TrainConfig) -> dict:
    """Each of OTHER_MODES trained from scratch in this process group, as ``train_expert_parallel`` trains."""
    return {(mode, d): _ep_worker(rank, world, MODEL, TINY_TASK, cfg, torch.float64, mode, d, False)
            for mode, d in OTHER_MODES}


def _losses(r: dict) -> torch.Tensor:
    return torch.tensor(r["loss"], dtype=torch.float64)


@pytest.mark.distributed
def test_ep_modes_against_one_process(one_thread):
    """Float64, 2 ranks (fp32, where the compiled CPU kernels take part, is the demo test's): replicated +
    alltoall is bitwise the one-process run; the other configurations add in another order: equal to rounding."""
    cfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=1, eval_sequences=4, eval_batch=4)
    one = train(MODEL, TINY_TASK, cfg, dtype=torch.float64)
    a = _losses(one)
    assert len(a) == 4 and a[-1] < a[0]
    exact = train_expert_parallel(MODEL, TINY_TASK, cfg, 2, dtype=torch.float64, timeout=TIMEOUT)
    assert torch.equal(_losses(exact), a) and exact["recall"] == one["recall"]
    # the other configurations: one spawn runs them in turn (train_expert_parallel's worker, as it calls it)
    runs = spawn(_other_modes, 2, cfg, backend="gloo", timeout=2 * TIMEOUT, threads=1)[0]
    assert list(runs) == list(OTHER_MODES)
    for (mode, dispatcher), r in runs.items():
        torch.testing.assert_close(_losses(r), a, rtol=1e-12, atol=0, msg=f"{mode}/{dispatcher}")
        assert r["recall"] == one["recall"]


def test_grad_norm_sq_orders_terms_by_expert():
    """One process: the replicated terms, then one term per (expert parameter, expert)."""
    torch.manual_seed(0)
    rep = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    exp = [torch.zeros(4, 2, 3, requires_grad=True)]
    for p in rep + exp:
        p.grad = torch.randn_like(p, dtype=torch.float64).float()
    want = torch.stack([p.grad.pow(2).sum() for p in rep] + [g.pow(2).sum() for g in exp[0].grad.unbind(0)]).sum()
    assert torch.equal(grad_norm_sq(rep, exp), want)
    torch.testing.assert_close(grad_norm_sq(rep, exp).double(),
                               sum(p.grad.double().pow(2).sum() for p in rep + exp), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kw, match", [({"ep_mode": "tensor"}, "ep_mode: expected one of"),
                                       ({"dispatcher": "ring"}, "dispatcher: expected one of")])
def test_bad_ep_mode(kw, match):
    task, model_cfg, cfg = demo_setup(quick=True, steps=1)
    with pytest.raises(ValueError, match=match):
        train(model_cfg, task, cfg, **kw)
    with pytest.raises(ValueError, match=match):
        train_expert_parallel(model_cfg, task, cfg, 2, **kw)


BAD_TRAIN_CONFIGS = [
    # TrainConfig changes, error, the message's start
    (dict(steps=1.5), TypeError, "steps: expected an int, got float"),
    (dict(steps=True), TypeError, "steps: expected an int, got bool"),
    (dict(batch_size=0), ValueError, "batch_size: expected >= 1, got 0"),
    (dict(eval_batch=0), ValueError, "eval_batch: expected >= 1, got 0"),  # was a ZeroDivisionError after training
    (dict(seed=1.5), TypeError, "seed: expected an int, got float"),
    (dict(lr=-1.0), ValueError, "lr: expected a float >= 0, got -1.0"),
    (dict(clip=-1.0), ValueError, "clip: expected a float > 0, got -1.0"),  # was accepted: the gradients flipped
    (dict(clip=float("nan")), ValueError, "clip: expected a finite float, got nan"),  # was accepted: NaN steps
]


@pytest.mark.parametrize("changes, error, start", BAD_TRAIN_CONFIGS, ids=[str(c[0]) for c in BAD_TRAIN_CONFIGS])
def test_bad_train_config_names_the_field(changes, error, start):
    task, model_cfg, cfg = demo_setup(quick=True, steps=1)
    bad = dataclasses.replace(cfg, **changes)
    with pytest.raises(error) as info:
        train(model_cfg, task, bad)
    assert str(info.value).startswith(start), str(info.value)
    with pytest.raises(error) as info:  # before any process is spawned
        train_expert_parallel(model_cfg, task, bad, 2)
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize("kw, match", [({"task": None}, "^task: expected a RecallTask, got NoneType"),
                                       ({"cfg": {}}, "^cfg: expected a TrainConfig, got dict"),
                                       ({"on_step": 1}, "^on_step: expected None or a callable, got int"),
                                       ({"compile": "yes"}, "^compile: expected a bool, got str")])
def test_bad_train_arguments(kw, match):
    task, model_cfg, cfg = demo_setup(quick=True, steps=1)
    args = {"task": task, "cfg": cfg} | kw
    with pytest.raises(TypeError, match=match):
        train(model_cfg, args.pop("task"), args.pop("cfg"), **args)


@pytest.mark.parametrize("dtype, error, match", [
    # was accepted: the loss NaN from the second step (AdamW's eps is 0 in float16)
    (torch.float16, ValueError, r"^dtype: expected one of \{float32, float64, bfloat16\}, got float16 \(float16 "
                                r"needs a gradient scaler; train has none\)$"),
    (None, ValueError, r"^dtype: expected one of \{float32, float64, bfloat16\}, got float16 \(torch's default "
                       r"dtype\) \(float16"),
    # CausalLM's TypeError in one process; under EP they failed in each spawned rank
    (torch.int64, TypeError, r"^dtype: expected one of \{float32, float64, bfloat16\}, got int64$"),
    ("float32", TypeError, r"^dtype: expected a torch.dtype, got str \('float32'\)$"),
])
def test_bad_train_dtype(dtype, error, match):
    task, model_cfg, cfg = demo_setup(quick=True, steps=1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if dtype is None else default)
    try:
        with pytest.raises(error, match=match):
            train(model_cfg, task, cfg, dtype=dtype)
        with pytest.raises(error, match=match):  # before any process is spawned
            train_expert_parallel(model_cfg, task, cfg, 2, dtype=dtype)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("kw, error, match", [({"steps": -1}, ValueError, "^steps: expected >= 0, got -1"),
                                              ({"steps": 1.5}, TypeError, "^steps: expected an int, got float"),
                                              ({"quick": 1}, TypeError, "^quick: expected a bool, got int")])
def test_bad_demo_setup(kw, error, match):
    with pytest.raises(error, match=match):
        demo_setup(**kw)
