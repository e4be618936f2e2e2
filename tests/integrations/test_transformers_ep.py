"""ep_implementation="sparseops" under transformers' own DistributedConfig (EP = 2 with FSDP = 2, and with TP = 2).

Spawned processes load a tiny float64 Qwen3-MoE checkpoint with ``DistributedConfig(ep_size=2, fsdp_size=2,
ep_implementation=...)``; rank r runs batch r. The oracle is one process running both batches, float64, eager
experts: each rank's logits must equal the oracle's for its batch, and every full gradient (dense ones
FSDP-reduced, expert ones gathered over EP) the oracle's gradient of the mean loss (the expert ones scaled by
transformers' convention, ``EXPERT_SCALE``, which its own all_to_all shows in the same run).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")
pytest.importorskip("accelerate", reason="needs the sparseops[transformers] extra")

from sparseops.distributed import spawn  # noqa: E402
from sparseops.testing import assert_close  # noqa: E402

from .test_transformers_experts import tiny_model  # noqa: E402
from .transformers_cases import experts_families, tiny_family_model  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT = 240.0
#: (experts_implementation, ep_implementation); transformers' own all_to_all runs alongside as the witness of
#: its gradient convention
IMPLS = [("sparseops", "sparseops"), ("sparseops", "sparseops_allgather"), ("eager", "sparseops"),
         ("eager", "all_to_all"), ("sparseops", "sparseops", "compiled")]
#: transformers' convention under DistributedConfig(ep_size=2, fsdp_size=2): the expert weights' gradients are
#: the dense ones' (the mean over the data-parallel ranks' losses) divided by 2 more; its all_to_all agrees
EXPERT_SCALE = 0.5


def _batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (1, n), generator=g) for n in (9, 6)]  # uneven token counts per rank


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, world_size, path, impls, tp=False):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    import transformers
    from transformers.distributed import DistributedConfig

    import sparseops.integrations.transformers  # noqa: F401

    warnings.filterwarnings("error", message='experts_implementation="sparseops"')  # a fallback fails the test
    from sparseops.integrations import transformers_ep

    plan, traced = transformers_ep.gather_plan, []

    def watched(*args):  # records whether dynamo is tracing the exchange
        traced.append(torch.compiler.is_compiling())
        return plan(*args)

    transformers_ep.gather_plan = watched
    ids = _batches()[0 if tp else rank]
    out = {}
    for experts_impl, ep_impl, *compiled in impls:
        sizes = {"tp_size": 2} if tp else {"fsdp_size": 2}
        cfg = DistributedConfig(ep_size=2, ep_implementation=ep_impl, **sizes)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation=experts_impl, distributed_config=cfg, dtype=torch.float64)
        # compiled: dynamo's graphs run as they are (backend "eager"); the exchange stays an eager island
        res = (torch.compile(model, backend="eager") if compiled else model)(input_ids=ids, labels=ids)
        res.loss.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        out[(experts_impl, ep_impl, *compiled)] = (_full(res.logits).detach(), res.loss.detach(), grads)
    out["traced"] = traced
    return out


def _oracle(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager",
                                                              dtype=torch.float64)
    logits, losses = [], []
    for ids in _batches():
        res = model(input_ids=ids, labels=ids)
        logits.append(res.logits.detach())
        losses.append(res.loss)
    return model, logits, losses



def test_ep2_fsdp2_matches_one_process(tmp_path):
    tiny_model("qwen3_moe", dtype=torch.float64).save_pretrained(tmp_path)
    results = spawn(_worker, 2, str(tmp_path), IMPLS, timeout=TIMEOUT, threads=1)
    model, logits, losses = _oracle(str(tmp_path))
    # FSDP averages the dense gradients over the 2 data-parallel ranks; the experts get every rank's tokens
    torch.autograd.backward(sum(losses) / 2)
    ref = {n: p.grad for n, p in model.named_parameters()}
    # each sparseops exchange of the two layers ran once per model, never traced by dynamo
    exchanges = 2 * sum(ep.startswith("sparseops") for _, ep, *_ in IMPLS)
    for res in results:
        assert res["traced"] == [False] * exchanges, res["traced"]
    for key in IMPLS:
        for rank, res in enumerate(results):
            got_logits, got_loss, grads = res[key]
            assert_close(got_logits, logits[rank], torch.float64, f"{key} rank {rank} logits")
            assert_close(got_loss, losses[rank].detach(), torch.float64, f"{key} rank {rank} loss")
            for name, g in ref.items():
                assert grads[name] is not None, f"{key}: no gradient for {name}"
                if ".experts." in name:
                    g = g * EXPERT_SCALE
                assert_close(grads[name], g, torch.float64, f"{key} rank {rank} grad {name}")



def _save_tiny(family, path):
    if family == "qwen3_moe":
        tiny_model(family, dtype=torch.float64).save_pretrained(path)
        return
    if family not in experts_families():
        pytest.skip(f"transformers {transformers.__version__} has no {family} models")
    tiny_family_model(family).save_pretrained(path)


# ergo: its experts class overrides the decorated forward (a per-expert RMSNorm of each route before the
# weighted sum), so the EP implementation must run that forward, not the bare grouped GEMMs
@pytest.mark.parametrize("family", ["qwen3_moe", "ergo"])
def test_ep2_tp2_shared_batch_matches_one_process(tmp_path, family):
    # tp_size = ep_size = 2: both ranks hold the same batch; each runs its slice of the tokens (split_rows)
    _save_tiny(family, tmp_path)
    impls = [("sparseops", "sparseops"), ("eager", "all_to_all")]
    results = spawn(_worker, 2, str(tmp_path), impls, True, timeout=TIMEOUT, threads=1)
    model, logits, losses = _oracle(str(tmp_path))
    losses[0].backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    # ergo rounds to fp32 inside a float64 model (its RMSNorms, the per-expert norm, the fp32 lm_head), so
    # the split of the tokens over the ranks moves its gradients by fp32 roundings (its own all_to_all too)
    tol = torch.float32 if family == "ergo" else torch.float64
    for key in impls:
        for rank, res in enumerate(results):
            got_logits, got_loss, grads = res[key]
            assert_close(got_logits, logits[0], tol, f"{key} rank {rank} logits")
            for name, g in ref.items():
                assert_close(grads[name], g, tol, f"{key} rank {rank} grad {name}")
