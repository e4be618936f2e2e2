"""The demo LM trained under ``torch.compile`` (``train(..., compile=True)``) against eager: the per-step losses
within the tolerance of docs/demo.md ("`--compile`"), one graph break per MoE layer call (and per DSA top-k),
no recompile after the first step."""

from __future__ import annotations

import functools

import pytest
import torch

from sparseops.models.lm import LMConfig
from sparseops.models.recall import RecallTask
from sparseops.models.train import TrainConfig, train

#: test_lm.py's tiny model and task
TINY = LMConfig(vocab_size=24, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16,
                num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3)
TINY_TASK = RecallTask(seq_len=80, num_pairs=4, num_queries=8, num_keys=8, num_values=8, num_filler=8)
CFG = TrainConfig(steps=4, batch_size=2, lr=1e-2, warmup=1, eval_sequences=2, eval_batch=2)


def _compiled_run(monkeypatch, model_cfg, dtype, backend=None):
    """``train(compile=True)`` from a fresh dynamo state; the losses and dynamo's counters after each step."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    if backend is not None:
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with inductor_config.patch(compile_threads=1):
        out = train(model_cfg, TINY_TASK, CFG, dtype=dtype, compile=True,
                    on_step=lambda *_: graphs.append(counters["stats"]["unique_graphs"]))
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    return out, graphs, breaks


def _check(compiled, graphs, breaks, eager, rtol, eager_islands=("_moe_eager",)):
    a, b = torch.tensor(eager["loss"], dtype=torch.float64), torch.tensor(compiled["loss"], dtype=torch.float64)
    assert len(a) == CFG.steps and torch.isfinite(a).all() and len(set(eager["loss"])) == CFG.steps
    torch.testing.assert_close(b, a, rtol=rtol, atol=0)
    assert graphs[0] > 0 and graphs[-1] == graphs[0]  # every graph is built in the first step, none after it
    # the only breaks: the eager islands (the MoE layer's; DSA's top-k), each a skip of its function
    assert len(breaks) == len(eager_islands), breaks
    assert all(any(f in b and "skip" in b.lower() for b in breaks) for f in eager_islands), breaks


def test_compiled_training_matches_eager_fp32_inductor(monkeypatch):
    """Inductor, fp32, the window-only ablation with both layers MoE (one block graph serves both): the full model
    builds about twice the C++ kernels, over a minute on two cores; the float64 test below traces it."""
    cfg = TINY.replace(window_only=True, dense_layers=0)
    eager = train(cfg, TINY_TASK, CFG, dtype=torch.float32)
    _check(*_compiled_run(monkeypatch, cfg, torch.float32), eager, rtol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_nsa_training_matches_eager_float64(monkeypatch, backend):
    """All three NSA branches, float64: dynamo's graphs and AOT autograd's backward, without Inductor's C++
    build (a minute on two cores)."""
    eager = train(TINY, TINY_TASK, CFG, dtype=torch.float64)
    _check(*_compiled_run(monkeypatch, TINY, torch.float64, backend), eager, rtol=1e-12)


def test_compiled_dsa_training_matches_eager_float64(monkeypatch):
    """DeepSeek Sparse Attention: its indexer's exact top-k runs eager inside the compiled model (it reads the
    visible key counts on the host), a skip like the MoE layer's, not a Tensor.item() break."""
    cfg = TINY.replace(attention="dsa", dsa_topk=8, index_heads=2, index_head_dim=8)
    eager = train(cfg, TINY_TASK, CFG, dtype=torch.float64)
    _check(*_compiled_run(monkeypatch, cfg, torch.float64, "aot_eager"), eager, rtol=1e-12,
           eager_islands=("_moe_eager", "indexer_topk"))
