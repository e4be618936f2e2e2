"""parallelize, materialize and DCP checkpoints without the spawned training runs: refused checkpoints, bad layouts
and options named before any collective, the layout groups' timeout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparseops.distributed import ParallelDims, materialize, parallelize, spawn
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
