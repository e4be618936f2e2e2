"""Meta-device initialisation of the modules of sparseops.nn and sparseops.models: build on ``meta``, ``to_empty``,
then every module's ``reset_parameters()`` and ``reset_buffers()``; every parameter and buffer gets a value, and
where the modules' order is the order ``__init__`` draws in, the values of a fresh build with the same seed."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.lm import CausalLM, LMConfig
from sparseops.nn import DeepSeekSparseAttention, GroupedExperts, MoELayer, NativeSparseAttention, TopKRouter

NSA = dict(num_heads=4, num_kv_heads=2, head_dim=16, compress_block_size=16, compress_stride=16,
           select_block_size=16, select_count=3, window_size=8)
LM = LMConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn_size=16,
              num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3)

# id; constructor; whether reset in module order draws as __init__ does (else: every value set, init formulas)
CASES = [
    ("moe-bias-shared", lambda **kw: MoELayer(32, 64, 4, 2, shared_ffn_size=16, expert_bias=True, **kw), True),
    ("router-bias", lambda **kw: TopKRouter(32, 8, 2, expert_bias=True, **kw), True),
    ("experts-gelu", lambda **kw: GroupedExperts(3, 16, 8, "gelu", **kw), True),
    ("dsa", lambda **kw: DeepSeekSparseAttention(32, 4, 1, 8, topk=4, index_heads=2, index_head_dim=8, **kw), True),
    ("nsa-mean", lambda **kw: NativeSparseAttention(32, compressor="mean", **NSA, **kw), True),
    # the compressor's pos_emb is drawn after its linears in __init__, before them by the module walk
    ("nsa-mlp", lambda **kw: NativeSparseAttention(32, compressor="mlp", **NSA, **kw), False),
    ("lm-dsa", lambda **kw: CausalLM(LM.replace(attention="dsa", dsa_topk=4), **kw), True),
    ("lm-nsa", lambda **kw: CausalLM(LM, **kw), False),
]


def _materialize(ctor, seed):
    m = ctor(device="meta")
    m.to_empty(device="cpu")
    with torch.no_grad():  # poison: a tensor no reset writes fails below
        for t in [*m.parameters(), *m.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else -12345)
    torch.manual_seed(seed)
    for mod in m.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
        if hasattr(mod, "reset_buffers"):
            mod.reset_buffers()
    return m


def _tensors(m):
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reset_after_to_empty_gives_a_fresh_build(case):
    _, ctor, same_order = case
    torch.manual_seed(3)
    fresh = ctor()
    m = _materialize(ctor, 3)
    for mod in m.modules():  # every module that owns a persistent tensor can reset it
        own = [*mod.parameters(recurse=False)]
        own += [b for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set]
        assert not own or hasattr(mod, "reset_parameters"), type(mod).__name__
    got, want = _tensors(m), _tensors(fresh)
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert bool((t == t).all()) and not bool((t == -12345).all()), f"{name} left unset"
        if same_order:
            assert torch.equal(t, want[name]), name
        elif "pos_emb" in name:  # N(0, 0.02^2)
            assert 0.015 < t.std().item() < 0.025, name
        elif name.endswith("expert_bias"):
            assert not t.any(), name
        elif name == "embed.weight":  # N(0, 1 / hidden_size), as CausalLM draws it
            assert 0.9 < t.std().item() * LM.hidden_size ** 0.5 < 1.1, name
        else:
            assert t.shape == want[name].shape and t.dtype == want[name].dtype, name


def test_router_reset_parameters_zeroes_the_expert_bias():
    r = TopKRouter(8, 4, 2, expert_bias=True)
    with torch.no_grad():
        r.expert_bias.fill_(0.5)
    r.reset_parameters()
    assert torch.equal(r.expert_bias, torch.zeros(4))
