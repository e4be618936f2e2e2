"""The demo LM: shapes, tied head, the window-only ablation, packing (expert-parallel training: test_train.py)."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.lm import CausalLM, LMConfig, expert_parameter, load_full_state
from sparseops.models.recall import RecallTask
from sparseops.models.train import TrainConfig, lr_at

#: a model small enough for float64 tests: 2 layers (dense, MoE), windows and blocks of 16
TINY = LMConfig(vocab_size=24, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16,
                num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3)
TINY_TASK = RecallTask(seq_len=80, num_pairs=4, num_queries=8, num_keys=8, num_values=8, num_filler=8)


def _model(cfg=TINY, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return CausalLM(cfg, dtype=dtype)


def test_shapes_tied_head_and_aux():
    m = _model()
    tokens = torch.randint(0, TINY.vocab_size, (70,))
    logits, aux = m(tokens, [0, 30, 70])
    assert logits.shape == (70, TINY.vocab_size) and logits.dtype == torch.float64
    assert aux.ndim == 0 and aux.item() > 0  # the MoE layer's load-balance loss
    assert not any("head" in n for n, _ in m.named_parameters())  # the head is the embedding
    assert isinstance(m.blocks[0].ffn, torch.nn.Module) and not hasattr(m.blocks[0].ffn, "router")
    assert hasattr(m.blocks[1].ffn, "router")


def test_window_only_same_parameters_gates_zero():
    nsa, win = _model(), _model(TINY.replace(window_only=True))
    assert [(n, p.shape) for n, p in nsa.named_parameters()] == [(n, p.shape) for n, p in win.named_parameters()]
    x = torch.randn(40, TINY.hidden_size, dtype=torch.float64)
    _, info = win.blocks[1].attn(x, [0, 40], return_info=True)
    assert (info["gates"][..., :2] == 0).all() and (info["gates"][..., 2] > 0).all()


def test_packing_equals_each_sequence_alone():
    m = _model()
    tokens = torch.randint(0, TINY.vocab_size, (75,))
    packed, _ = m(tokens, [0, 33, 75])
    first, _ = m(tokens[:33], [0, 33])
    second, _ = m(tokens[33:], [0, 42])
    torch.testing.assert_close(packed, torch.cat([first, second]), rtol=1e-12, atol=1e-12)


def test_causal():
    m = _model()
    tokens = torch.randint(0, TINY.vocab_size, (64,))
    changed = tokens.clone()
    changed[40:] = (changed[40:] + 1) % TINY.vocab_size
    a, _ = m(tokens)
    b, _ = m(changed)
    assert torch.equal(a[:40], b[:40]) and not torch.equal(a[40:], b[40:])


def test_expert_parameters_and_load_full_state():
    m = _model()
    names = [n for n, _ in m.named_parameters() if expert_parameter(n)]
    assert names == ["blocks.1.ffn.experts.w1", "blocks.1.ffn.experts.w3", "blocks.1.ffn.experts.w2"]
    other = _model(seed=1)
    load_full_state(other, m.state_dict())
    for (n, p), (_, q) in zip(m.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # warm-up, cosine at its top
    assert lr_at(9, cfg) == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 9 / 100)).item()))
    assert lr_at(50, cfg) == pytest.approx(0.5)
    assert max(lr_at(i, cfg) for i in range(100)) <= 1.0
