"""attn_implementation="sparseops" for transformers' deepseek_v32 and glm_moe_dsa on tiny float64 models built
here (no downloads): logits and every gradient against sdpa (float64 throughout) and eager (whose softmax runs in
fp32 by design), causal and with a cache; padding; the registries; indexer_training (losses, gradients only on the
indexers, the same selection as transformers' indexer); bad calls."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")
tdsa = pytest.importorskip("sparseops.integrations.transformers_dsa")

from sparseops.dsa import index_scores  # noqa: E402
from sparseops.testing import TOLERANCES, assert_close, rel_rms_error  # noqa: E402

_COMMON = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,
               n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
               qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=5, index_head_dim=16,
               index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=128, num_attention_heads=4,
               num_key_value_heads=4)


def _model(family, seed=0):
    torch.manual_seed(seed)
    if family == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(num_hidden_layers=2, **_COMMON)
        m = transformers.DeepseekV32ForCausalLM(cfg)
    else:
        cfg = transformers.GlmMoeDsaConfig(num_hidden_layers=3, indexer_types=["full", "shared", "full"], **_COMMON)
        m = transformers.GlmMoeDsaForCausalLM(cfg)
    m = m.double()
    m.set_experts_implementation("eager")  # transformers' grouped_mm takes no float64
    return m


def _run(m, impl, ids, attention_mask=None):
    m.set_attn_implementation(impl)
    m.zero_grad()
    out = m(ids, attention_mask=attention_mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_logits_and_every_gradient_match(family):
    m = _model(family)
    ids = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(1))
    ours = _run(m, "sparseops", ids)
    for impl, dtype in (("sdpa", torch.float64), ("eager", torch.float32)):
        logits, grads = _run(m, impl, ids)
        assert_close(ours[0], logits, dtype, name=f"logits vs {impl}")
        assert grads.keys() == ours[1].keys()
        for n, g in grads.items():
            assert_close(ours[1][n], g, dtype, name=f"d{n} vs {impl}")


def test_under_autocast_as_close_to_float64_as_sdpa():
    """An fp32 model under ``torch.autocast(bf16)``: the model's RoPE leaves the query in fp32 and the keys in bf16;
    the attention takes the three in autocast's dtype, as sdpa does (the op refused the mixed dtypes), and the
    logits and every gradient are as close to the float64 model's as sdpa's under the same autocast."""
    m = _model("deepseek_v32")
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(13))
    ref_logits, ref_grads = _run(m, "sdpa", ids)
    m = m.float()
    runs = {}
    for impl in ("sdpa", "sparseops"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[impl] = _run(m, impl, ids)
    (s_logits, s_grads), (logits, grads) = runs["sdpa"], runs["sparseops"]
    assert grads.keys() == ref_grads.keys()
    for name, got, ref, theirs in [("logits", logits, ref_logits, s_logits)] + [
            (n, grads[n], r, s_grads[n]) for n, r in ref_grads.items()]:
        err, floor = rel_rms_error(got, ref), rel_rms_error(theirs, ref)
        assert err <= max(TOLERANCES[torch.bfloat16], 2 * floor), (name, err, floor)


def test_sparse_selection_is_exercised():
    """index_topk = 5 < the sequence: eager's dense attention differs, so the selection is what matches."""
    m = _model("deepseek_v32")
    ids = torch.randint(0, 40, (1, 16), generator=torch.Generator().manual_seed(2))
    ours, _ = _run(m, "sparseops", ids)
    for layer in m.model.layers:
        layer.self_attn.indexer.index_topk = 16
    dense, _ = _run(m, "sparseops", ids)
    assert (ours - dense).abs().max() > 1e-6


def test_left_padding_rows_match():
    m = _model("deepseek_v32")
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    m.set_attn_implementation("sparseops")
    with torch.no_grad():
        ours = m(ids, attention_mask=mask).logits
        m.set_attn_implementation("sdpa")
        ref = m(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert_close(ours[keep], ref[keep], torch.float64)


def test_generate_with_a_cache_matches_sdpa():
    """A batch with a left-padded row; a 4-token prompt (index_topk 5: the prefill lists every key, dense) and the
    decode steps past it (sparse)."""
    m = _model("deepseek_v32")
    ids = torch.randint(1, 40, (2, 4), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    outs = {}
    for impl in ("sparseops", "sdpa"):
        m.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = m.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=5,
                                    do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outs["sparseops"].sequences, outs["sdpa"].sequences)
    for a, b in zip(outs["sparseops"].logits, outs["sdpa"].logits):
        assert_close(a, b, torch.float64)


#: the other families whose attention passes its indexer's ``indices`` as deepseek_v32 does (hy_v4 does too, with
#: attention sinks: refused, test_bad_calls)
OTHER_DSA_FAMILIES = ["axk2", "dots3_note", "mistral_large4"]


@pytest.mark.parametrize("family", OTHER_DSA_FAMILIES)
def test_other_dsa_families_match_sdpa(family):
    from .transformers_cases import tiny_family_model

    m = tiny_family_model(family)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(14))
    runs = {}
    for impl in ("sdpa", "sparseops"):
        m.set_attn_implementation(impl)
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids).logits
        logits.pow(2).mean().backward()
        runs[impl] = logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    (logits, grads), (ref_logits, ref_grads) = runs["sparseops"], runs["sdpa"]
    assert_close(logits, ref_logits, name=f"{family} logits")
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert_close(grads[n], g, name=f"{family} d{n}")


def test_registered_in_both_registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[tdsa.NAME] is tdsa.dsa_attention
    assert tdsa.NAME in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_training_losses_train_only_the_indexers(family):
    m = _model(family)
    m.set_attn_implementation("sparseops")
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(5))
    with tdsa.indexer_training(m) as losses:
        out = m(ids, labels=ids)
    n_indexers = sum(1 for mod in m.modules() if isinstance(getattr(mod, "indexer", None), torch.nn.Module))
    assert len(losses) == n_indexers >= 2 and all(torch.isfinite(x) and x > 0 for x in losses)
    m.zero_grad()
    sum(losses).backward()
    grads = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".indexer." in n for n in grads)
    assert out.loss.requires_grad  # the LM loss is untouched


def test_indexer_training_under_activation_checkpointing():
    """transformers' activation checkpointing, reentrant or not, with the backward inside the context: the same
    losses and every gradient as without it (the losses are computed after the checkpointed layers, whose
    recomputation in the backward adds none; inside them a reentrant checkpoint's no_grad forward left the
    indexers without gradients, a non-reentrant one saw fewer tensors saved in the recomputation)."""
    m = _model("glm_moe_dsa").train()
    m.set_attn_implementation("sparseops")
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(11))
    runs = []
    for kwargs in (None, {"use_reentrant": False}, {"use_reentrant": True}):
        mm = copy.deepcopy(m)
        if kwargs is not None:
            mm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        with tdsa.indexer_training(mm) as losses:
            out = mm(ids, labels=ids)
            (out.loss + sum(losses)).backward()
        runs.append(([x.detach() for x in losses], {n: p.grad for n, p in mm.named_parameters() if p.grad is not None}))
    (ref_losses, ref_grads), *checkpointed = runs
    assert len(ref_losses) == 2 and any(".indexer." in n for n in ref_grads)
    for losses, grads in checkpointed:
        assert len(losses) == len(ref_losses)
        for a, b in zip(losses, ref_losses):
            assert_close(a, b, name="indexer loss")
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            assert_close(grads[n], g, name=f"d{n}")


def test_indexer_training_refuses_a_padded_batch_and_another_attention():
    """Its losses treat every token as real: a padded batch is a ValueError naming attention_mask, not a loss over
    the pads; an all-ones mask is the unpadded batch. A model on another attention is a ValueError too."""
    m = _model("deepseek_v32")
    m.set_attn_implementation("sparseops")
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(ids)
    for dense in (False, True):
        with tdsa.indexer_training(m, dense=dense) as losses:
            m(ids, attention_mask=mask)
        assert len(losses) == 2
    mask[1, :3] = 0
    for dense in (False, True):
        with pytest.raises(ValueError, match="attention_mask: indexer_training expects unpadded batches"):
            with tdsa.indexer_training(m, dense=dense):
                m(ids, attention_mask=mask)
    m.set_attn_implementation("sdpa")  # its attention records nothing: an error, not an empty list of losses
    with pytest.raises(ValueError, match=r"attn_implementation: indexer_training needs attn_implementation='sparseops'"
                                         r" .*got 2 layer\(s\) with an indexer run with \['sdpa'\]"):
        with tdsa.indexer_training(m):
            m(ids)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_inputs_select_what_transformers_selects(family):
    m = _model(family)
    m.set_attn_implementation("sparseops")
    attn = m.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda mod, a, kw: seen.update(kw), with_kwargs=True)
    ids = torch.randint(0, 40, (1, 14), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        m(ids)
    hook.remove()
    hs, pe = seen["hidden_states"], seen["position_embeddings"]
    S = hs.shape[1]
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hs))
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None]
        theirs = attn.indexer(hs, q_resid, pe, causal, None)[0]  # [S, topk]
        inputs = tdsa.indexer_inputs(attn, hs, pe)
        ours, _ = tdsa.indexer_topk(*inputs, attn.indexer.index_topk)
        dense = index_scores(*inputs)
    # relu makes exact ties (at 0) common, which torch.topk breaks arbitrarily: compare the selected scores
    for s in range(S):
        want = sorted(dense[s, [int(i) for i in theirs[s] if i <= s]].tolist())
        got = sorted(dense[s, [int(i) for i in ours[s] if i >= 0]].tolist())
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_bad_calls():
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="indices"):
        tdsa.dsa_attention(None, q, k, k, None)
    idx = torch.zeros(1, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="dropout"):
        tdsa.dsa_attention(None, q, k, k, None, dropout=0.1, indices=idx)
    with pytest.raises(ValueError, match="indices"):
        tdsa.dsa_attention(None, q, k, k, None, indices=idx[:, :3])
    # arguments that change the math (HY-V4 passes its attention sinks as s_aux): refused, never ignored
    for name, arg in (("s_aux", torch.zeros(2)), ("sliding_window", 3), ("softcap", 30.0), ("is_causal", False)):
        with pytest.raises(ValueError, match=f"{name}: attn_implementation='sparseops' computes causal softmax"):
            tdsa.dsa_attention(None, q, k, k, None, indices=idx, **{name: arg})
    out, _ = tdsa.dsa_attention(None, q, k, k, None, indices=idx, s_aux=None, sliding_window=None, use_cache=True,
                                position_ids=torch.arange(4)[None], is_causal=True,
                                num_items_in_batch=torch.tensor(8), output_hidden_states=True)  # the Trainer's
    assert out.shape == (1, 4, 2, 8)
    wide = torch.zeros(1, 4, tdsa.MAX_TOPK + 1, dtype=torch.int32)  # an index_topk past the limit, short of T
    long_k = torch.randn(1, 2, tdsa.MAX_TOPK + 2, 8)
    with pytest.raises(ValueError, match=r"indices: expected at most 2048 keys per query .*index_topk.*got 2049"):
        tdsa.dsa_attention(None, q, long_k, long_k, None, indices=wide)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dense_warmup_is_sdpa_and_the_dense_loss_the_listed_one(family):
    """index_topk at least the sequence length (every key listed): the attention is the model's sdpa (logits and
    every gradient), and indexer_training(dense=True)'s losses and indexer gradients equal the listed-keys ones."""
    m = _model(family)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(9))
    for mod in m.modules():
        if isinstance(getattr(mod, "indexer", None), torch.nn.Module):
            mod.indexer.index_topk = 64
            with torch.no_grad():  # a peaked indexer: a KL of order 1, not the cancellation of a near match
                mod.indexer.weights_proj.weight.mul_(30.0)
    ours = _run(m, "sparseops", ids)
    logits, grads = _run(m, "sdpa", ids)
    assert_close(ours[0], logits, name="logits vs sdpa")
    for n, g in grads.items():
        assert_close(ours[1][n], g, name=f"d{n} vs sdpa")
    m.set_attn_implementation("sparseops")
    got = []
    for dense in (True, False):
        m.zero_grad()
        with tdsa.indexer_training(m, dense=dense) as losses:
            m(ids)
        sum(losses).backward()
        got.append((losses, {n: p.grad.clone() for n, p in m.named_parameters() if ".indexer." in n}))
    (dense_losses, dense_grads), (listed_losses, listed_grads) = got
    assert len(dense_losses) == len(listed_losses) >= 2
    for a, b in zip(dense_losses, listed_losses):
        assert_close(a, b, name="indexer loss")
    for n, g in dense_grads.items():
        assert_close(g, listed_grads[n], name=f"d{n}")
    with pytest.raises(TypeError, match="dense: expected a bool"):
        tdsa.indexer_training(m, dense=1)


def test_every_key_past_the_limit_is_dense():
    """2100 keys listed for 2100 queries (a warm-up's index_topk past 2048): transformers' sdpa, not refused."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 2100, 8, generator=g, dtype=torch.float64) for _ in range(3))
    every = torch.arange(2100, dtype=torch.int32).expand(1, 2100, 2100)
    out, _ = tdsa.dsa_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, indices=every)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)
    assert_close(out, want, name="out")


def test_docs_indexer_training_recipe():
    """docs/dsa.md's two stages on a tiny model: the warm-up lowers the indexer loss, changes only the indexers;
    the sparse stage trains everything."""
    m = _model("deepseek_v32", seed=7).float()
    m.set_attn_implementation("sparseops")
    cfg = m.config
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(8))
    indexers = [mod.indexer for mod in m.modules() if isinstance(getattr(mod, "indexer", None), torch.nn.Module)]
    index_params = [p for ix in indexers for p in ix.parameters()]
    with torch.no_grad():  # a peaked indexer, far from the near-uniform attention of a fresh model
        for ix in indexers:
            ix.weights_proj.weight.mul_(30.0)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for ix in indexers:
        ix.index_topk = ids.shape[1]
    m.requires_grad_(False)
    for p in index_params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(index_params, lr=1e-2)
    warm = []
    for _ in range(8):
        with tdsa.indexer_training(m, dense=True) as losses:
            m(ids)
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
        warm.append(sum(losses).item())
    assert warm[-1] < warm[0]
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".indexer." in n for n in changed)
    for ix in indexers:
        ix.index_topk = cfg.index_topk
    m.requires_grad_(True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with tdsa.indexer_training(m) as losses:
        out = m(ids, labels=ids)
    opt.zero_grad()
    (out.loss + sum(losses)).backward()
    opt.step()
    assert m.lm_head.weight.grad is not None and indexers[0].wk.weight.grad is not None
