"""parallelize and DCP checkpoints: spawned gloo runs of an NSA + MoE model against the one-process float64 oracle.

Each run takes AdamW steps with gradient clipping and update_expert_bias on the global batch split over the
ranks; its losses, every parameter's gradient at the first step and every parameter and balancing bias at the
end must be the one-process run's (the whole global batch in one process), never another parallel run's. A run
that resumes from a checkpoint written at another layout must end where the uninterrupted one-process run
ends. One spawn per world size runs every check of that size (process start-up dominates the time).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from sparseops.distributed import ParallelDims, clip_grad_norm_, materialize, parallelize, spawn
from sparseops.distributed import checkpoint as ckpt
from sparseops.nn import MoELayer, update_expert_bias
from sparseops.testing import TRAINING_TOLERANCE

from .parallel_net import BATCH, SAVE_AT, SEED, SEQ, STEPS, E, H, V
from .parallel_net import model as _model

pytestmark = pytest.mark.distributed

TIMEOUT = 300.0


def _batch(step: int, rank: int, world: int, micro: int = 1, m: int = 0, split: int | None = None):
    """This rank's equal share of micro-batch ``m`` of ``micro`` of the global batch of ``step`` (a function of
    the seed and the step only). Micro-batch m holds the m-th piece of each of ``split`` ranks' shares
    (``split``: the world size of the parallel run it is compared with; default ``world``)."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    split = world if split is None else split
    per, pm = BATCH // split, BATCH // split // micro
    rows = [q * per + m * pm + i for q in range(split) for i in range(pm)]
    mine = tokens[rows[rank * len(rows) // world:(rank + 1) * len(rows) // world]]
    n = mine.shape[0]
    return mine[:, :-1].reshape(-1), mine[:, 1:].reshape(-1), (torch.arange(n + 1) * SEQ).tolist()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rank: int, world: int, load=None, save=None, micro: int = 1, split: int | None = None) -> dict:
    """Steps ``[0, STEPS)`` (from SAVE_AT when loading a checkpoint written after SAVE_AT steps), each step
    accumulating the gradients of ``micro`` micro-batches (``split``: see :func:`_batch`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    start = 0
    if load is not None:
        ckpt.load(load, model, opt)
        start = SAVE_AT
    losses, grads = [None] * start, None
    for step in range(start, STEPS):
        loss = 0.0
        for m in range(micro):
            tokens, targets, cu = _batch(step, rank, world, micro, m, split)
            logits, aux = model(tokens, cu)
            part = (F.cross_entropy(logits, targets) + aux) / micro
            part.backward()
            loss = loss + part.detach()
        if step == 0:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, rate=1e-2)
        value = loss.clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(float(value) / world)
        if save is not None and step + 1 == SAVE_AT:
            ckpt.save(save, model, opt)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return {"loss": losses, "grads": grads, "params": params, "bias": bias}


def _check(run: dict, oracle: dict, what: str) -> None:
    for kind in ("grads", "params", "bias"):
        if run[kind] is None:
            continue
        assert run[kind].keys() == oracle[kind].keys(), what
        # relative to each tensor's own size, unless that is rounding noise: a gradient that is zero in exact
        # arithmetic (the compressors' key bias shifts all scores of a query alike) compares against 1e-6 of
        # the RMS of all the tensors of its kind
        floor = 1e-6 * _rms(torch.cat([t.reshape(-1) for t in oracle[kind].values()]))
        for name, ref in oracle[kind].items():
            err = _rms(run[kind][name] - ref) / max(_rms(ref), floor)
            assert err <= TRAINING_TOLERANCE, f"{what}: {kind} {name}: relative error {err:.2e}"
    for a, b in zip(run["loss"], oracle["loss"], strict=True):
        if a is not None:
            assert abs(a - b) <= TRAINING_TOLERANCE * abs(b), f"{what}: losses {run['loss']} vs {oracle['loss']}"


def _rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0


# -- the layer alone: a rank with no tokens ----------------------------------------------------------------------

class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED + 1)
        self.moe = MoELayer(H, 6, E, 2, shared_ffn_size=4, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                            dtype=torch.float64)

    def forward(self, x):
        return self.moe(x)


def _layer_inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(7, H, generator=g, dtype=torch.float64), torch.randn(7, H, generator=g, dtype=torch.float64)


def _layer_grads(layer, x, g, world: int, total: int) -> tuple[float, dict]:
    """Rank loss ``(world / total) * sum(y * g) + aux``: its mean over the ranks is the one-process loss."""
    y, aux = layer(x)
    loss = (y * g).sum() * (world / total) + aux.loss
    loss.backward()
    return float(aux.loss), {n: _full(p.grad).clone() for n, p in layer.named_parameters()}


# -- the W = 2 spawn ---------------------------------------------------------------------------------------------

def _raw_ep(rank: int, path: str) -> dict:
    """A layer built with a raw ep_group: its state_dict holds all E experts once, DDP around it raises."""
    out = {}
    torch.manual_seed(SEED)
    layer = MoELayer(H, 6, E, 2, ep_group=dist.group.WORLD, dtype=torch.float64)
    torch.manual_seed(10 + rank)
    layer.experts.reset_parameters()  # each rank's experts are its own
    mine = layer.experts.w1.detach().clone()
    state = layer.state_dict()
    out["saved_shape"] = list(state["experts.w1"].shape)
    dcp.save(state, checkpoint_id=path)
    torch.manual_seed(99)
    other = MoELayer(H, 6, E, 2, ep_group=dist.group.WORLD, dtype=torch.float64)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    out["restored_own"] = torch.equal(other.experts.w1, mine)
    # model and optimizer through sparseops.distributed.checkpoint: the moments at the global shape too
    model = _Wrap(other)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    y = model(torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)))
    y.sum().backward()
    opt.step()
    moment = opt.state[other.experts.w1]["exp_avg"].clone()
    ckpt.save(f"{path}_opt", model, opt)
    fresh = _Wrap(MoELayer(H, 6, E, 2, ep_group=dist.group.WORLD, dtype=torch.float64))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load(f"{path}_opt", fresh, fresh_opt)
    out["restored_moment"] = torch.equal(fresh_opt.state[fresh.layer.experts.w1]["exp_avg"], moment)
    out["restored_opt_own"] = torch.equal(fresh.layer.experts.w1, other.experts.w1)
    if rank == 0:
        meta = dcp.FileSystemReader(f"{path}_opt").read_metadata().state_dict_metadata
        out["moment_shape"] = list(meta["optim.state.layer.experts.w1.exp_avg"].size)
    before = other.experts.w1.detach().clone()
    try:  # at construction, before DDP's broadcast: every rank keeps its own experts
        nn.parallel.DistributedDataParallel(_Wrap(other))
        out["ddp"] = "no error"
    except ValueError as e:
        out["ddp"] = str(e)
    out["ddp_kept_experts"] = torch.equal(other.experts.w1, before)
    return out


class _Wrap(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def _faults() -> dict:
    """Bad input raises before any collective; fully_shard of a submodule of the layer works."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, make in (("world", lambda: parallelize(_model(), ParallelDims(dp_shard=4))),
                       ("ep_E", lambda: parallelize(_model(num_experts=3), ParallelDims(ep=2))),
                       ("data_parallel", lambda: parallelize(_model(), ParallelDims(), data_parallel="zero"))):
        try:
            make()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    model = parallelize(_model(), ParallelDims(ep=2))
    try:
        parallelize(model, ParallelDims(ep=2))
        out["twice"] = "no error"
    except ValueError as e:
        out["twice"] = str(e)
    try:
        nn.parallel.DistributedDataParallel(model)
        out["ddp_twice"] = "no error"
    except ValueError as e:
        out["ddp_twice"] = str(e)
    # a model the user already wrapped or sharded: parallelize would swap the experts under DDP's hooks (a
    # RuntimeError at the second step) or feed DTensors to DTensor.from_local
    for name, wrap in (("wrapped_ddp", nn.parallel.DistributedDataParallel),
                       ("wrapped_fsdp", lambda m: fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),))))):
        try:
            parallelize(wrap(_model()), ParallelDims(ep=2), data_parallel="ddp")
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    # the crash: fully_shard of the router alone, then the layer
    layer, plain = _Layer(), _Layer()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(layer.moe.router, mesh=mesh)
    fully_shard(layer, mesh=mesh)
    x, _ = _layer_inputs()
    out["router_fsdp"] = torch.equal(layer(x)[0], plain(x)[0])
    return out


def _meta(rank: int, world: int, path: str) -> dict:
    """Built on meta, parallelized, materialized: from rank 0's seeded full model, or from a checkpoint."""
    out = {}
    with torch.device("meta"):
        model = parallelize(_model(), ParallelDims(ep=2))
    full = _model().state_dict() if rank == 0 else None  # only rank 0 ever holds the full model
    out["meta"] = _train(materialize(model, "cpu", full, from_rank0=True), rank, world)
    with torch.device("meta"):
        model = parallelize(_model(), ParallelDims(ep=2))
    out["meta_every_rank"] = _train(materialize(model, "cpu", _model().state_dict()), rank, world)
    with torch.device("meta"):
        model = parallelize(_model(), ParallelDims(ep=2))
    out["meta_resume"] = _train(materialize(model, "cpu"), rank, world, load=f"{path}/w2_fsdp_ep2")
    with torch.device("meta"):
        model = _model()
    try:
        parallelize(model, ParallelDims(ep=2), data_parallel="ddp")
        out["meta_ddp"] = "no error"
    except ValueError as e:
        out["meta_ddp"] = str(e)
    return out


def _warned(fn) -> tuple:
    """``fn()`` and the warnings it raised or torch.distributed logged (DTensor's go to its own logger)."""
    import logging
    import warnings

    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logs = [logging.getLogger(n) for n in ("torch.distributed", "torch.distributed.tensor")]  # no propagation
    for log in logs:
        log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        for log in logs:
            log.removeHandler(handler)
    return out, seen + [str(w.message) for w in caught]


def _worker2(rank: int, world: int, path: str) -> dict:
    ep1, warned = _warned(lambda: _train(parallelize(_model(), ParallelDims(ep=1)), rank, world))
    out = {"fsdp": _train(parallelize(_model(), ParallelDims(ep=2)), rank, world, save=f"{path}/w2_fsdp_ep2"),
           "ddp": _train(parallelize(_model(), ParallelDims(ep=2), data_parallel="ddp"), rank, world),
           "ep1": ep1, "ep1_warned": warned,
           "accumulate": _train(parallelize(_model(), ParallelDims(ep=2)), rank, world, micro=2),
           "accumulate_ddp": _train(parallelize(_model(), ParallelDims(ep=2), data_parallel="ddp",
                                                ddp_options={"find_unused_parameters": True, "bucket_cap_mb": 0.01}),
                                    rank, world, micro=2)}
    x, g = _layer_inputs()
    mine = slice(0, 7) if rank == 0 else slice(7, 7)  # rank 1 has no tokens
    layer = parallelize(_Layer(), ParallelDims(ep=2))
    out["layer"] = _layer_grads(layer, x[mine], g[mine], world, 7)
    out["raw"] = _raw_ep(rank, f"{path}/raw")
    out["faults"] = _faults()
    out.update(_meta(rank, world, path))
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def oracle() -> dict:
    return _train(_model(), 0, 1)


@pytest.fixture(scope="module")
def w2(ckpt_dir) -> list:
    return spawn(_worker2, 2, ckpt_dir, timeout=TIMEOUT)


def test_w2_fsdp_and_ddp_ep2(w2, oracle):
    _check(w2[0]["fsdp"], oracle, "W=2 fsdp ep=2")
    _check(w2[0]["ddp"], oracle, "W=2 ddp ep=2")
    _check(w2[0]["ep1"], oracle, "W=2 fsdp ep=1 (experts FSDP-sharded over efsdp=2)")
    # the experts' output is no view (FSDP2 warns of one), their gradient norm one all-reduce over the flattened
    # (efsdp, ep) mesh (DTensor warns of one per dimension)
    assert [w for w in w2[0]["ep1_warned"] if "view tensor" in w or "sequential" in w] == []
    assert all(b.abs().sum() > 0 for b in oracle["bias"].values())  # the balancing moved


def test_w2_meta_device_init(w2, oracle):
    # the seeded one-process values broadcast from rank 0, the non-persistent buffers re-initialised
    _check(w2[0]["meta"], oracle, "W=2 fsdp ep=2 built on meta, materialized from rank 0's full model")
    _check(w2[0]["meta_resume"], oracle, "W=2 fsdp ep=2 built on meta, materialized from a checkpoint")
    _check(w2[0]["meta_every_rank"], oracle, "W=2 fsdp ep=2 built on meta, every rank's full state dict")
    assert "meta" in w2[0]["meta_ddp"] and "materialize" in w2[0]["meta_ddp"]


def test_w2_gradient_accumulation(w2):
    # two micro-batches per step, each one's aux loss over its own global micro-batch, as in one process
    # (each rank's expert counts of the first micro-batch must survive the second forward, also under DDP)
    oracle = _train(_model(), 0, 1, micro=2, split=2)
    _check(w2[0]["accumulate"], oracle, "W=2 fsdp ep=2, 2 micro-batches")
    _check(w2[0]["accumulate_ddp"], oracle, "W=2 ddp ep=2 (find_unused_parameters, small buckets), 2 micro-batches")


def test_w2_rank_without_tokens(w2):
    x, g = _layer_inputs()
    loss, grads = _layer_grads(_Layer(), x, g, 1, 7)
    for rank in (0, 1):
        got_loss, got = w2[rank]["layer"]
        assert abs(got_loss - loss) <= TRAINING_TOLERANCE * abs(loss)  # the global batch's aux loss everywhere
        _check({"loss": [], "grads": got, "params": None, "bias": None},
               {"loss": [], "grads": grads}, f"rank {rank} of 2, rank 1 without tokens")


def test_w2_checkpoint_metadata(ckpt_dir, w2):
    meta = dcp.FileSystemReader(f"{ckpt_dir}/w2_fsdp_ep2").read_metadata().state_dict_metadata
    for layer in (0, 1):
        for name, shape in (("w1", [E, 8, H]), ("w3", [E, 8, H]), ("w2", [E, H, 8])):
            key = f"blocks.{layer}.moe.experts.{name}"
            assert list(meta[f"model.{key}"].size) == shape
            assert list(meta[f"optim.state.{key}.exp_avg"].size) == shape
            assert list(meta[f"optim.state.{key}.exp_avg_sq"].size) == shape
    assert list(meta["model.embed.weight"].size) == [V, H]


def test_w2_raw_ep_group_and_faults(w2):
    for rank in (0, 1):
        raw = w2[rank]["raw"]
        assert raw["saved_shape"] == [E, 6, H] and raw["restored_own"]
        assert raw["restored_moment"] and raw["restored_opt_own"]
        assert "parallelize" in raw["ddp"] and raw["ddp_kept_experts"]
        f = w2[rank]["faults"]
        assert "dp_replicate * dp_shard" in f["world"] and "ep" in f["ep_E"]
        assert "data_parallel" in f["data_parallel"] and "parallelize already ran" in f["twice"]
        assert "parallelize" in f["ddp_twice"]
        assert "model: expected the plain model (parallelize applies FSDP2 / DDP itself), got one wrapped in " \
               "DistributedDataParallel" in f["wrapped_ddp"]
        assert "already sharded by fully_shard" in f["wrapped_fsdp"], f["wrapped_fsdp"]
        assert f["router_fsdp"] is True
    assert w2[0]["raw"]["moment_shape"] == [E, 6, H]


# -- the W = 4 spawn: FSDP with efsdp = 2, HSDP 2 x 2, and a resumed run at ep = 4 ---------------------------------

def _worker4(rank: int, world: int, path: str) -> dict:
    return {"fsdp": _train(parallelize(_model(), ParallelDims(ep=2)), rank, world),
            "hsdp": _train(parallelize(_model(), ParallelDims(dp_replicate=2, ep=2)), rank, world,
                           save=f"{path}/w4_hsdp"),
            "resume": _train(parallelize(_model(), ParallelDims(ep=4), data_parallel="ddp"), rank, world,
                             load=f"{path}/w2_fsdp_ep2"),
            "meta_hsdp": _train(_meta_hsdp(rank), rank, world)}


def _meta_hsdp(rank: int) -> nn.Module:
    """HSDP 2 x 2, ep = 2 (the experts FSDP-sharded over dp_replicate) built on meta, rank 0's values."""
    with torch.device("meta"):
        model = parallelize(_model(), ParallelDims(dp_replicate=2, ep=2))
    return materialize(model, "cpu", _model().state_dict() if rank == 0 else None, from_rank0=True)


@pytest.fixture(scope="module")
def w4(ckpt_dir, w2) -> list:
    return spawn(_worker4, 4, ckpt_dir, timeout=TIMEOUT)


def test_w4_fsdp_hsdp_and_resume_from_w2(w4, oracle):
    _check(w4[0]["fsdp"], oracle, "W=4 fsdp ep=2 (efsdp=2)")
    _check(w4[0]["hsdp"], oracle, "W=4 hsdp 2x2 ep=2")
    _check(w4[0]["resume"], oracle, "W=4 ddp ep=4 from W=2 fsdp ep=2")
    _check(w4[0]["meta_hsdp"], oracle, "W=4 hsdp 2x2 ep=2 built on meta, materialized from rank 0")


def test_one_process_resume_and_incompatible(ckpt_dir, w4, oracle):
    for name in ("w2_fsdp_ep2", "w4_hsdp"):
        _check(_train(_model(), 0, 1, load=f"{ckpt_dir}/{name}"), oracle, f"one process from {name}")
    model = _model(expert_ffn=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"blocks\.0\.moe\.experts\.w1.*\[4, 4, 16\].*\[4, 8, 16\]"):
        ckpt.load(f"{ckpt_dir}/w2_fsdp_ep2", model)
    state = {"model": model.state_dict()}
    with pytest.raises(BaseException, match=r"Size mismatch.*experts\.w1"):  # DCP's own check, before reading
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/w2_fsdp_ep2")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded
    with pytest.raises(ValueError, match="complete DCP checkpoint"):
        ckpt.load(f"{ckpt_dir}/nowhere", _model())


def test_raw_ep_group_checkpoint_loads_in_one_process(ckpt_dir, w2):
    """The raw ep_group layer's checkpoint (ep = 2) holds both ranks' experts: a one-process layer gets all E."""
    from sparseops.nn import GroupedExperts

    blocks = []
    for rank in (0, 1):  # each rank's experts, as _raw_ep drew them
        experts = GroupedExperts(E // 2, H, 6, dtype=torch.float64)
        torch.manual_seed(10 + rank)
        experts.reset_parameters()
        blocks.append(experts.w1.detach())
    layer = MoELayer(H, 6, E, 2, dtype=torch.float64)
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/raw")
    layer.load_state_dict(state)
    assert torch.equal(layer.experts.w1, torch.cat(blocks))
