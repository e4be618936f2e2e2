"""parallelize, materialize, clip_grad_norm_ and DCP checkpoints without the spawned training runs: refused
checkpoints, bad layouts, options and clip arguments named before any collective, the layout groups' timeout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparseops.distributed import ParallelDims, clip_grad_norm_, materialize, parallelize, spawn
from sparseops.distributed import checkpoint as ckpt

from .parallel_net import model as _model

pytestmark = pytest.mark.distributed


def test_a_checkpoint_of_a_larger_model_is_refused(tmp_path):
    """A model with a block fewer than the checkpoint's: ValueError naming the entries it lacks, nothing loaded
    (DCP loads the keys the loading state has and leaves the rest: a silent partial load)."""
    big = _model()
    ckpt.save(tmp_path / "big", big)
    small = _model()
    del small.blocks[1]
    before = {k: v.clone() for k, v in small.state_dict().items()}
    with pytest.raises(ValueError, match=r"expected no entry the model lacks in the checkpoint .*, got \d+: "
                                         r"'model\.blocks\.1\..*\(a checkpoint of a larger model\)"):
        ckpt.load(tmp_path / "big", small)
    assert all(torch.equal(v, before[k]) for k, v in small.state_dict().items())
    with pytest.raises(TypeError, match=r"whole: expected a tuple of top-level names \(str\), got 'model'"):
        ckpt.check_compatible({"model": small.state_dict()}, tmp_path / "big", whole="model")


def test_load_with_an_optimizer_of_a_checkpoint_without_one(tmp_path):
    """ckpt.load(path, model, opt) of a model-only checkpoint: ValueError naming the optimizer key, before anything
    is read (DCP's planner raised a CheckpointException, a BaseException, a traceback deep in DCP)."""
    model = _model()
    ckpt.save(tmp_path / "model_only", model)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match=r"expected the key 'optim\.state\..*' .*no such key \(a checkpoint saved "
                                         r"without an optimizer\?\)"):
        ckpt.load(tmp_path / "model_only", other, opt)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # nothing loaded
    ckpt.load(tmp_path / "model_only", other)  # the model alone loads
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())


def test_materialize_in_one_process():
    """Without a process group: a meta-built model gets the full state dict and fresh non-persistent buffers."""
    with torch.device("meta"):
        model = _model()
    ref = _model()
    materialize(model, "cpu", ref.state_dict())
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(model, kind)()), dict(getattr(ref, kind)())
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), kind


def test_dims_bad_input_without_a_process_group():
    with pytest.raises(ValueError, match="ep"):
        ParallelDims(dp_shard=3, ep=2)
    with pytest.raises(ValueError, match="dp_replicate"):
        ParallelDims(dp_replicate=0)
    with pytest.raises(TypeError, match="ep"):
        ParallelDims(ep=2.0)
    with pytest.raises(ValueError, match="dp_replicate"):
        ParallelDims(dp_replicate=3).resolve(4)
    with pytest.raises(ValueError, match="ep"):
        ParallelDims(ep=4).resolve(2)
    assert ParallelDims(dp_replicate=2, ep=2).resolve(8) == ParallelDims(2, 4, 2)
    assert ParallelDims(dp_replicate=2, ep=2).resolve(8).efsdp == 2
    with pytest.raises(RuntimeError, match="process group"):
        parallelize(_model(), ParallelDims())
    with pytest.raises(ValueError, match="ddp_options"):
        parallelize(_model(), ParallelDims(), ddp_options={"static_graph": True})  # with fsdp
    with pytest.raises(ValueError, match="ddp_options"):
        parallelize(_model(), ParallelDims(), data_parallel="ddp", ddp_options={"device_ids": [0]})
    with pytest.raises(TypeError, match="find_unused_parameters"):
        parallelize(_model(), ParallelDims(), data_parallel="ddp", ddp_options={"find_unused_parameters": 1})
    with pytest.raises(ValueError, match="device"):
        materialize(nn.Linear(2, 2), "meta")
    with pytest.raises(TypeError, match="state_dict"):
        materialize(nn.Linear(2, 2), "cpu", [])
    with pytest.raises(ValueError, match="state_dict"):
        materialize(nn.Linear(2, 2), "cpu", from_rank0=True)


def _with_grad() -> nn.Parameter:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    return p


#: before, each of these was taken or failed in torch's code, as the comment says
BAD_CLIP_ARGS = [
    # id, (parameters (None: a parameter with a gradient), max_norm, norm_type), error, the message's start
    ("parameters-int", (1, 1.0, 2.0), TypeError,  # "'int' object is not iterable"
     "parameters: expected a Tensor or an iterable of Tensors, got int"),
    ("parameters-of-ints", ([1], 1.0, 2.0), TypeError,  # "'int' object has no attribute 'grad'"
     "parameters[0]: expected a torch.Tensor, got int"),
    ("max_norm-negative", (None, -1.0, 2.0), ValueError,  # every gradient flipped
     "max_norm: expected a float >= 0, got -1.0"),
    ("max_norm-nan", (None, float("nan"), 2.0), ValueError,  # NaN gradients
     "max_norm: expected a float >= 0, got nan"),
    ("max_norm-bool", (None, True, 2.0), TypeError, "max_norm: expected a float >= 0, got bool"),  # clipped to 1
    ("max_norm-str", (None, "1", 2.0), TypeError,  # "unsupported operand type(s) for /"
     "max_norm: expected a float >= 0, got str"),
    ("norm_type-nan", (None, 1.0, float("nan")), ValueError,  # a NaN norm, NaN gradients
     "norm_type: expected a float > 0 or 'inf', got nan"),
    ("norm_type-0", (None, 1.0, 0), ValueError,  # a count of nonzero gradients, not a norm
     "norm_type: expected a float > 0 or 'inf', got 0"),
    ("norm_type-negative", (None, 1.0, -1.0), ValueError, "norm_type: expected a float > 0 or 'inf', got -1.0"),
    ("norm_type-bool", (None, 1.0, True), TypeError,  # taken as a 1-norm
     "norm_type: expected a float > 0 or 'inf', got bool"),
    ("norm_type-str", (None, 1.0, "x"), TypeError,  # "could not convert string to float"
     "norm_type: expected a float > 0 or 'inf', got str"),
]


@pytest.mark.parametrize("args, error, start", [c[1:] for c in BAD_CLIP_ARGS], ids=[c[0] for c in BAD_CLIP_ARGS])
def test_clip_grad_norm_bad_input_names_the_argument(args, error, start):
    """Refused before any gradient is touched (in one process; the checks come before every collective)."""
    p = _with_grad()
    with pytest.raises(error) as info:
        clip_grad_norm_([p] if args[0] is None else args[0], *args[1:])
    assert str(info.value).startswith(start), str(info.value)
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("parameters, max_norm, norm_type", [
    ("tensor", 1.0, 2.0),  # a single Tensor, as torch takes it
    ("list", 1.0, float("inf")), ("list", 1.0, "inf"),  # torch's inf norm, also spelled 'inf'
    ("list", float("inf"), 2.0), ("list", 0, 1),  # no clipping; every gradient to 0
])
def test_clip_grad_norm_takes_what_torch_takes(parameters, max_norm, norm_type):
    ours, theirs = _with_grad(), _with_grad()
    want = torch.nn.utils.clip_grad_norm_(theirs if parameters == "tensor" else [theirs], max_norm, norm_type)
    got = clip_grad_norm_(ours if parameters == "tensor" else [ours], max_norm, norm_type)
    assert torch.equal(got, want) and torch.equal(ours.grad, theirs.grad)


def _stalled(rank: int, world: int) -> str:
    """Rank 1 never joins a collective on a layout group: rank 0's wait ends after the layout's timeout."""
    import time

    dims = ParallelDims(ep=2).build("cpu", timeout=1.5)
    group = dims.mesh("expert", "cpu").get_group("ep")
    if rank == 1:
        time.sleep(5)
        return "skipped"
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        return "no error"
    except RuntimeError:
        return f"raised after {time.monotonic() - start:.1f} s"


def test_w2_layout_groups_time_out():
    got = spawn(_stalled, 2, timeout=60.0)[0]
    assert got.startswith("raised after") and float(got.split()[2]) < 5, got


def test_parallelize_names_an_fsdp2_too_old(monkeypatch):
    # torch < 2.8: FSDP2 without set_force_sum_reduction_for_comms; refused before any group or collective
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2.10 \(FSDP2's "
                                           r"FSDPModule.set_force_sum_reduction_for_comms\), got torch"):
        parallelize(nn.Linear(2, 2), ParallelDims(dp_shard=1))
    assert not dist.is_initialized()


def test_a_torch_whose_mesh_groups_drop_the_timeout_is_refused(monkeypatch):
    # torch 2.9: init_device_mesh takes backend_override, but its groups keep the default timeout (30 minutes)
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1"))
    for call, who in ((lambda: parallelize(nn.Linear(2, 2), ParallelDims(dp_shard=1)), "parallelize"),
                      (lambda: ParallelDims(dp_shard=1).build("cpu", timeout=5), "ParallelDims.build")):
        with pytest.raises(RuntimeError, match=rf"^{who}: needs torch >= 2.10 \(mesh groups that take their "
                                               r"options' timeout\), got torch 2.9.1$"):
            call()
    assert not dist.is_initialized()
