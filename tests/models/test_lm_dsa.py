"""The demo LM with attention="dsa": DeepSeekSparseAttention layers, the indexer loss in the aux loss, packing,
causality, a few training steps; the NSA default is unchanged (test_lm.py)."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.lm import CausalLM, LMConfig
from sparseops.nn import DeepSeekSparseAttention

DSA = LMConfig(vocab_size=24, hidden_size=16, num_heads=4, num_kv_heads=1, head_dim=8, ffn_size=16,
               num_experts=4, top_k=2, expert_ffn_size=8, attention="dsa", dsa_topk=6, index_heads=2,
               index_head_dim=4)


def _model(cfg=DSA, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return CausalLM(cfg, dtype=dtype)


def test_dsa_layers_and_the_indexer_loss_in_aux():
    m = _model()
    assert all(isinstance(b.attn, DeepSeekSparseAttention) for b in m.blocks)
    tokens = torch.randint(0, DSA.vocab_size, (50,))
    logits, aux = m(tokens, [0, 20, 50])
    assert logits.shape == (50, DSA.vocab_size)
    _, aux0 = _model(DSA.replace(indexer_loss_coeff=0.0))(tokens, [0, 20, 50])
    assert aux.item() > aux0.item()  # the indexers' KL losses are added
    aux.backward()
    assert m.blocks[0].attn.index_q_proj.weight.grad.abs().sum() > 0


def test_packing_and_causal():
    m = _model()
    tokens = torch.randint(0, DSA.vocab_size, (45,))
    packed, _ = m(tokens, [0, 17, 45])
    first, _ = m(tokens[:17])
    second, _ = m(tokens[17:])
    torch.testing.assert_close(packed, torch.cat([first, second]), rtol=1e-12, atol=1e-12)
    changed = tokens.clone()
    changed[30:] = (changed[30:] + 1) % DSA.vocab_size
    a, _ = m(changed, [0, 17, 45])
    assert torch.equal(a[:30], packed[:30])


def test_a_few_training_steps_lower_the_loss():
    m = _model(dtype=torch.float32, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2)
    tokens = torch.arange(64) % 8  # a periodic sequence: learnable
    losses = []
    for _ in range(8):
        logits, aux = m(tokens[:-1])
        ce = torch.nn.functional.cross_entropy(logits, tokens[1:])
        opt.zero_grad()
        (ce + aux).backward()
        opt.step()
        losses.append(ce.item())
    assert losses[-1] < losses[0]


def test_bad_attention_name():
    with pytest.raises(ValueError, match="attention"):
        CausalLM(DSA.replace(attention="mla"))
