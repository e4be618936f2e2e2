"""The demo LM's bad input: every LMConfig field checked when the model is built, the message starting with the
field's name (``sparseops train`` maps it to the flag), the layers' own errors renamed to the field they come from,
and the tokens' rank, dtype and range."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.lm import CausalLM, LMConfig
from sparseops.testing import assert_close

TINY = LMConfig(vocab_size=24, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16,
                num_experts=4, top_k=2, expert_ffn_size=8, window_size=16, select_count=3)

BAD_CONFIGS = [
    # field changes, error, the message's start
    (dict(vocab_size=0), ValueError, "vocab_size: expected an int >= 1, got 0"),
    (dict(hidden_size=0), ValueError, "hidden_size: expected an int >= 1, got 0"),  # was a ZeroDivisionError
    (dict(num_layers=0), ValueError, "num_layers: expected an int >= 1, got 0"),
    (dict(num_layers=-1), ValueError, "num_layers: expected an int >= 1, got -1"),
    (dict(ffn_size=0), ValueError, "ffn_size: expected an int >= 1, got 0"),  # was a ZeroDivisionError
    (dict(expert_ffn_size=0), ValueError, "expert_ffn_size: expected an int >= 1, got 0"),
    (dict(num_heads=0), ValueError, "num_heads: expected an int >= 1, got 0"),
    (dict(num_experts=0), ValueError, "num_experts: expected an int >= 1, got 0"),
    (dict(window_size=0), ValueError, "window_size: expected an int >= 1, got 0"),
    (dict(dsa_topk=0), ValueError, "dsa_topk: expected an int >= 1, got 0"),
    (dict(dense_layers=-1), ValueError, "dense_layers: expected an int in [0, num_layers = 2], got -1"),
    (dict(dense_layers=3), ValueError, "dense_layers: expected an int in [0, num_layers = 2], got 3"),
    (dict(hidden_size=16.0), TypeError, "hidden_size: expected an int, got float"),
    (dict(top_k=True), TypeError, "top_k: expected an int, got bool"),
    (dict(aux_loss_coeff=-1.0), ValueError, "aux_loss_coeff: expected a float >= 0"),
    (dict(indexer_loss_coeff=float("nan")), ValueError, "indexer_loss_coeff: expected a finite float"),
    (dict(attention="flash"), ValueError, "attention: expected one of"),
    # the layers' own checks, the message renamed from the layer's argument to the field
    (dict(attention="dsa", dsa_topk=4096), ValueError, "dsa_topk: expected <= 2048, got 4096"),
    (dict(num_experts=4, top_k=5), ValueError, "top_k:"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads:"),
]


@pytest.mark.parametrize("changes, error, start", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
def test_bad_config_names_the_field(changes, error, start):
    with pytest.raises(error) as info:
        CausalLM(TINY.replace(**changes), device="meta")
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize("dtype, match", [(torch.int32, "^dtype: expected None or one of .*got int32"),
                                          ("float32", "^dtype: expected None or a torch.dtype, got str")])
def test_bad_dtype_names_dtype(dtype, match):
    with pytest.raises(TypeError, match=match):
        CausalLM(TINY, device="meta", dtype=dtype)


def test_layer_errors_are_renamed_at_the_boundary(monkeypatch):
    """An error of the MoE layer about its ffn_size is about LMConfig.expert_ffn_size (``--expert-ffn-size``)."""
    from sparseops.models import lm

    def moe(*_, **__):
        raise ValueError("ffn_size: expected a multiple of 8, got 12")

    monkeypatch.setattr(lm, "MoELayer", moe)
    with pytest.raises(ValueError, match=r"^expert_ffn_size: expected a multiple of 8, got 12$"):
        CausalLM(TINY, device="meta")


BAD_TOKENS = [
    # tokens, error, message
    (torch.randint(0, 24, (2, 20)), ValueError, r"^tokens: expected a 1-D tensor .* got 2-D with shape \[2, 20\]"),
    (torch.rand(20), TypeError, r"^tokens: expected dtype in \{int32, int64\}, got float32"),
    ([1, 2, 3], TypeError, r"^tokens: expected a torch.Tensor, got list"),
    (torch.tensor([0, 1, 24]), ValueError, r"^tokens: expected ids in \[0, vocab_size = 24\), got 24 at \[2\]"),
    (torch.tensor([0, -1, 3]), ValueError, r"^tokens: expected ids in \[0, vocab_size = 24\), got -1 at \[1\]"),
]


@pytest.mark.parametrize("tokens, error, match", BAD_TOKENS, ids=["2-D", "float", "list", "id-past-vocab", "negative"])
def test_bad_tokens_name_tokens(tokens, error, match):
    torch.manual_seed(0)
    m = CausalLM(TINY)
    with pytest.raises(error, match=match):
        m(tokens)
    assert m(torch.randint(0, 24, (20,), dtype=torch.int32))[0].shape == (20, 24)  # int32 ids are accepted


def test_token_range_check_is_skipped_under_compile():
    """As the library's other data checks: no host sync while torch.compile traces (one graph)."""
    torch.manual_seed(0)
    m = CausalLM(TINY.replace(window_only=True, dense_layers=2))
    tokens = torch.randint(0, 24, (20,))
    want = m(tokens)[0]
    got = torch.compile(m, fullgraph=True)(tokens)[0]
    assert_close(got, want, torch.float32)
