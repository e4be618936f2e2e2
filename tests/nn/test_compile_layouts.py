"""NativeSparseAttention, DeepSeekSparseAttention and the demo LM (with each) under ``torch.compile`` (``aot_eager``: dynamo's graphs and AOT autograd's
backward, no C++ build) with ``cu_seqlens`` tensors whose packing changes every call: no new graph once dynamo has
made the sizes dynamic, the eager values (forward, every gradient) within the float64 tolerance, one graph break
per layer, the eager region's (docs/nsa-module.md and docs/dsa.md, "`torch.compile`")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseops.models.lm import CausalLM, LMConfig
from sparseops.nn import DeepSeekSparseAttention, NativeSparseAttention
from sparseops.testing import assert_close

#: the first graph; then B changes (cu_seqlens' length goes dynamic); then T changes (T goes dynamic)
WARMUP = ([0, 20, 40], [0, 7, 25, 40], [0, 12, 36])
#: new packings, each of them compiled nothing more: lengths 1 and 0, one sequence, the largest T, the smallest; each
#: has a sequence of 2 compressed blocks or more, 12 tokens for the layer, 16 for the LM (with one block, the
#: compressed keys' gradients are 0 up to rounding)
LAYOUTS = ([0, 1, 1, 30, 40], [0, 17, 36], [0, 44], [0, 33, 40, 52], [0, 9, 28])
#: test_lm.py's tiny model with compressed blocks of 8 tokens, both layers MoE (one block graph serves both)
TINY = LMConfig(vocab_size=24, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16,
                num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3, compress_block_size=8,
                compress_stride=8, dense_layers=0)


def _grads(module, *inputs):
    return [t.grad for t in inputs if t.requires_grad] + [p.grad for p in module.parameters() if p.grad is not None]


def _run(module, step, layouts, eager_islands):
    """``step(fn, cu) -> (outputs, inputs)`` through the compiled ``module`` (``cu`` an int32 tensor) and eager
    (``cu`` a list) for each layout: the values compared, the graph count after each compiled call."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="aot_eager")
    graphs = []
    for cu in layouts:
        module.zero_grad(set_to_none=True)
        outs, inputs = step(compiled, torch.tensor(cu, dtype=torch.int32))
        graphs.append(counters["stats"]["unique_graphs"])
        got = [o.detach() for o in outs] + _grads(module, *inputs)
        module.zero_grad(set_to_none=True)
        outs, inputs = step(module, cu)
        want = [o.detach() for o in outs] + _grads(module, *inputs)
        assert len(got) == len(want) and len(want) > len(outs)
        for i, (g, w) in enumerate(zip(got, want)):
            if w.dtype == torch.int32:
                assert torch.equal(g, w), f"{cu}: output {i}"
            else:
                assert_close(g, w, torch.float64, name=f"{cu}: value {i}")
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    warm = len(WARMUP)
    assert graphs[warm:] == [graphs[warm - 1]] * (len(layouts) - warm), graphs  # no new graph after the warm-up
    assert len(breaks) == len(eager_islands), breaks
    assert all(any(f in b and "skip" in b.lower() for b in breaks) for f in eager_islands), breaks


def test_nsa_compiled_with_changing_layouts():
    torch.manual_seed(0)
    m = NativeSparseAttention(16, 2, 1, 8, compress_block_size=8, compress_stride=4, select_block_size=16,
                              select_count=3, local_blocks=1, window_size=12, rope_theta=1e4, dtype=torch.float64)

    def step(fn, cu):
        T = cu[-1] if isinstance(cu, list) else int(cu[-1])
        x = torch.randn(T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(T)).requires_grad_()
        y, info = fn(x, cu, return_info=True)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        return [y, info["topk_indices"], info["gates"], info["o_cmp"], info["o_slc"], info["o_win"]], [x]

    _run(m, step, WARMUP + LAYOUTS, ["_branches_eager"])


def test_dsa_compiled_with_changing_layouts():
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(16, 2, 1, 8, topk=5, index_heads=2, index_head_dim=8, rope_theta=1e4,
                                dtype=torch.float64)

    def step(fn, cu):
        T = cu[-1] if isinstance(cu, list) else int(cu[-1])
        x = torch.randn(T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(T)).requires_grad_()
        y, info = fn(x, cu, return_info=True)
        ((y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum() + info["indexer_loss"]).backward()
        return [y, info["indices"], info["scores"], info["indexer_loss"]], [x]

    _run(m, step, WARMUP + LAYOUTS, ["_attend_eager"])


@pytest.mark.parametrize("attention", ["nsa", "dsa"])
def test_lm_compiled_with_changing_layouts(attention):
    """The LM passes the tensor through to its layers: two new packings after the warm-up (the layers' tests
    cover the rest)."""
    torch.manual_seed(0)
    m = CausalLM(dataclasses.replace(TINY, attention=attention), dtype=torch.float64)

    def step(fn, cu):
        T = cu[-1] if isinstance(cu, list) else int(cu[-1])
        tokens = torch.randint(0, TINY.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        logits, aux = fn(tokens, cu)
        (logits.logsumexp(-1).mean() + aux).backward()
        return [logits, aux], []

    island = "_branches_eager" if attention == "nsa" else "_attend_eager"
    _run(m, step, WARMUP + LAYOUTS[2:4], [island, "_moe_eager"])


@pytest.mark.parametrize("bad", [torch.tensor([0, 20, 41], dtype=torch.int32), torch.tensor([0, 30, 20, 40])],
                         ids=["last-not-T", "decreasing"])
def test_compiled_bad_cu_seqlens_raises(bad):
    """The eager region checks the tensor's lengths as eager does."""
    import torch._dynamo

    torch._dynamo.reset()
    m = NativeSparseAttention(16, 2, 1, 8, compress_block_size=16, compress_stride=16, select_block_size=16,
                              select_count=3, window_size=12, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens: expected"):
        torch.compile(m, backend="eager")(torch.zeros(40, 16, dtype=torch.float64), bad)
    torch._dynamo.reset()
