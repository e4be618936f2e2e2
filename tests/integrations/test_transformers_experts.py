"""experts_implementation="sparseops" in whole transformers models: logits and every gradient against eager.

Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS and Qwen2-MoE as tiny models built from their config classes (no
downloads), every parameter random (transformers builds some routers as zeros: top-k would tie), float64 and
fp32; 16-bit at the experts module against the float64 eager oracle; save/load; the fallback warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")

import transformers  # noqa: E402

from sparseops.testing import assert_close  # noqa: E402

from .transformers_cases import eager_forward, routing, run_experts  # noqa: E402

ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", {**ATTN, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
                                     "num_experts": 6, "num_experts_per_tok": 3, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {**ATTN, "hidden_size": 32, "intermediate_size": 12, "num_local_experts": 5,
                                  "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", {"hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
                                         "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                                         "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 2,
                                         "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                         "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                         "v_head_dim": 8}),
    "gpt_oss": ("GptOssConfig", {**ATTN, "hidden_size": 32, "intermediate_size": 12, "num_local_experts": 5,
                                 "num_experts_per_tok": 2, "sliding_window": 4}),
    "qwen2_moe": ("Qwen2MoeConfig", {**ATTN, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
                                     "shared_expert_intermediate_size": 20, "num_experts": 6,
                                     "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
}


@pytest.fixture(scope="module", autouse=True)
def _register():
    import sparseops.integrations.transformers  # noqa: F401


def tiny_model(family: str, impl: str = "eager", dtype=torch.float64, seed=0):
    name, kw = CONFIGS[family]
    cfg = getattr(transformers, name)(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    return model.to(dtype)


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(type(m).forward, "__wrapped__") and hasattr(m, "has_gate")]


def run_model(model, impl: str, ids):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_model_logits_and_every_gradient_match_eager(family):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model = tiny_model(family)
    assert _experts_modules(model), f"{family}: no experts module"
    ref_logits, ref_grads = run_model(model, "eager", ids)
    for dtype in (torch.float64, torch.float32):
        m = copy.deepcopy(model).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            logits, grads = run_model(m, "sparseops", ids)
        assert all(e.config._experts_implementation == "sparseops" for e in _experts_modules(m))
        assert_close(logits, ref_logits, dtype, f"{family} {dtype} logits")
        for name, ref in ref_grads.items():
            if ref is None:
                continue
            assert grads[name] is not None, f"{name}: no gradient"
            assert_close(grads[name], ref, dtype, f"{family} {dtype} grad {name}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_eager_gradients(reentrant):
    """transformers' activation checkpointing (each decoder layer's forward run again in the backward): the
    sparseops experts' loss and every gradient equal eager's without checkpointing, in float64."""
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    model = tiny_model("qwen3_moe").train()
    ref_logits, ref_grads = run_model(copy.deepcopy(model), "eager", ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    logits, grads = run_model(model, "sparseops", ids)
    assert_close(logits, ref_logits, torch.float64, "logits")
    for name, ref in ref_grads.items():
        assert_close(grads[name], ref, torch.float64, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_16_bit_experts_match_the_float64_eager_oracle(family, dtype):
    model = tiny_model(family)
    ex = _experts_modules(model)[-1]
    H = ex.down_proj.shape[2 if ex.is_transposed else 1]
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    idx, w = routing(13, ex.num_experts, 2)
    y_ref, g_ref = run_experts(ex, eager_forward(ex), x, idx, w)
    m = copy.deepcopy(ex).to(dtype)
    m.config._experts_implementation = "sparseops"
    y, grads = run_experts(m, m, x.to(dtype), idx, w.to(dtype))
    assert y.dtype == dtype
    assert_close(y, y_ref, dtype, "output")
    for name, ref in g_ref.items():
        assert_close(grads[name], ref, dtype, f"grad {name}")


def test_weights_names_and_checkpoints_stay_transformers(tmp_path):
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    eager = tiny_model("qwen3_moe", dtype=torch.float32)
    ours = tiny_model("qwen3_moe", "sparseops", dtype=torch.float32)
    assert list(ours.state_dict()) == list(eager.state_dict())
    ours.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="sparseops")
    loaded_eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    with torch.no_grad():
        assert_close(back(input_ids=ids).logits, loaded_eager.double()(input_ids=ids).logits, torch.float32, "logits")
    assert all(e.config._experts_implementation == "sparseops" for e in _experts_modules(back))


def _mixtral_call():
    """A tiny Mixtral's first experts module on the sparseops path and a call's ``(x, top_k_index, weights)``."""
    ex = _experts_modules(tiny_model("mixtral"))[0]
    ex.config._experts_implementation = "sparseops"
    return ex, torch.randn(5, 32, dtype=torch.float64), *routing(5, ex.num_experts, 2)


def test_negative_expert_ids_name_top_k_index():
    ex, x, idx, w = _mixtral_call()
    idx[3, 1] = -2
    with pytest.raises(ValueError, match=r"top_k_index: expected expert ids >= 0, got 1 negative \(min -2\)"):
        ex(x, idx, w)


def test_an_unsupported_call_falls_back_to_eager_with_one_warning():
    from sparseops.integrations import transformers_experts

    ex, x, idx, w = _mixtral_call()
    ref = eager_forward(ex)(x, idx, w)
    transformers_experts._WARNED.clear()
    w3 = w.unsqueeze(0)  # a shape this path does not take: [1, T, K]
    with pytest.warns(RuntimeWarning, match=r'experts_implementation="sparseops": MixtralExperts runs its eager '
                                            r'forward: top_k_weights does not have top_k_index'):
        with pytest.raises(IndexError):  # eager itself rejects it: the fallback ran eager, not a silent answer
            ex(x, idx, w3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the same reason warns once
        with pytest.raises(IndexError):
            ex(x, idx, w3)
    assert_close(ex(x, idx, w), ref, torch.float64, "supported call")


def test_a_subclass_overriding_forward_falls_back_to_the_decorated_eager_forward():
    # Ergo's ErgoExperts subclasses its decorated projections and calls super().forward: the fallback runs the
    # decorated class's eager forward, not the subclass's (which leads back into sparseops: it recursed forever)
    from sparseops.integrations import transformers_experts

    class TaggedParameter(torch.nn.Parameter):  # what quantization / offload libraries put in place
        pass

    model = tiny_model("mixtral")
    ex = _experts_modules(model)[0]
    base = type(ex)

    class ScaledExperts(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2.0 * super().forward(hidden_states, top_k_index, top_k_weights)

    ex.__class__ = ScaledExperts
    x = torch.randn(5, 32, dtype=torch.float64)
    idx, w = routing(5, ex.num_experts, 2)
    ex.config._experts_implementation = "eager"
    ref = ex(x, idx, w)
    ex.config._experts_implementation = "sparseops"
    assert_close(ex(x, idx, w), ref, torch.float64, "sparseops path")
    ex.down_proj = TaggedParameter(ex.down_proj.detach().clone())
    transformers_experts._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="down_proj is a TaggedParameter"):
        out = ex(x, idx, w)
    assert_close(out, ref, torch.float64, "fallback")


def test_quantized_weights_fall_back_with_the_reason():
    from sparseops.integrations import transformers_experts

    model = tiny_model("qwen3_moe")
    ex = _experts_modules(model)[0]
    reason = transformers_experts.unsupported_reason(ex, torch.zeros(3, 32, dtype=torch.float64),
                                                     torch.zeros(3, 2, dtype=torch.int64),
                                                     torch.zeros(3, 2, dtype=torch.float64), {})
    assert reason is None
    ex.down_proj = torch.nn.Parameter(ex.down_proj.detach().to(torch.int8), requires_grad=False)
    reason = transformers_experts.unsupported_reason(ex, torch.zeros(3, 32, dtype=torch.float64),
                                                     torch.zeros(3, 2, dtype=torch.int64),
                                                     torch.zeros(3, 2, dtype=torch.float64), {})
    assert reason == "down_proj has dtype torch.int8 (quantized weights)"


def test_registered_in_both_registries():
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from sparseops.integrations.transformers_ep import SparseopsAllGatherEP, SparseopsEP

    assert "sparseops" in ALL_EXPERTS_FUNCTIONS
    reg = EPImplementationInterface()
    assert reg["sparseops"] is SparseopsEP and reg["sparseops_allgather"] is SparseopsAllGatherEP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_silu_gate_matches_the_float64_gate(dtype):
    # R * 2F above the fused kernels' threshold: the compiled CPU pass, forward and backward
    from sparseops.integrations.transformers_experts import _fusable, _SiluGate

    g = torch.Generator().manual_seed(6)
    h = torch.randn(600, 256, generator=g, dtype=torch.float64)
    gy = torch.randn(600, 128, generator=g, dtype=torch.float64)
    hd = h.to(dtype).requires_grad_(True)
    assert _fusable(hd)
    y = _SiluGate.apply(hd)
    y.backward(gy.to(dtype))
    href = hd.detach().double().requires_grad_(True)
    ref = torch.nn.functional.silu(href[:, :128]) * href[:, 128:]
    ref.backward(gy)
    assert_close(y, ref, dtype, "gate")
    assert_close(hd.grad, href.grad, dtype, "gate grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_silu_gate_compiles_fullgraph(dtype):
    """Dynamo traces the gate inside a compiled experts module (after the counts' host sync). In fp32 and float64
    its last cast would return the product itself, and torch 2.11's dynamo gives an autograd.Function whose
    output is also another traced tensor of its forward a gradient of 0 (pytorch/pytorch#180642,
    docs/internals.md)."""
    import torch._dynamo

    from sparseops.integrations.transformers_experts import _SiluGate

    g = torch.Generator().manual_seed(6)
    h = torch.randn(7, 8, generator=g, dtype=torch.float64)
    gy = torch.randn(7, 4, generator=g, dtype=torch.float64)
    hd = h.to(dtype, copy=True).requires_grad_(True)
    torch._dynamo.reset()
    y = torch.compile(_SiluGate.apply, fullgraph=True, backend="eager")(hd)
    y.backward(gy.to(dtype))
    torch._dynamo.reset()
    href = h.clone().requires_grad_(True)
    ref = torch.nn.functional.silu(href[:, :4]) * href[:, 4:]
    ref.backward(gy)
    assert_close(y, ref, dtype, "gate")
    assert_close(hd.grad, href.grad, dtype, "gate grad")


def test_import_sparseops_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, sparseops, sparseops.nn, sparseops.distributed; "
            "sparseops.moe_token_permute_with_ep; assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_inference_mode_and_a_call_with_no_tokens():
    """Under ``torch.inference_mode()`` the model's logits are eager's; an experts call with no tokens (``[0, H]``)
    returns ``[0, H]`` and, in training, zero gradients for every expert weight (each parameter always gets one)."""
    model = tiny_model("qwen3_moe")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        logits = {}
        for impl in ("eager", "sparseops"):
            model.set_experts_implementation(impl)
            logits[impl] = model(input_ids=ids).logits
    assert_close(logits["sparseops"], logits["eager"], torch.float64, "logits under inference_mode")
    model.set_experts_implementation("sparseops")
    experts = _experts_modules(model)[0]
    H, K = model.config.hidden_size, model.config.num_experts_per_tok
    x = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    experts.zero_grad(set_to_none=True)
    y = experts(x, torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K, dtype=torch.float64))
    assert y.shape == (0, H)
    y.sum().backward()
    for n, p in experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), n
