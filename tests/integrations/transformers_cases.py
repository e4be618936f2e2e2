"""Tiny transformers MoE pieces built locally (no downloads), every parameter randomised."""

from __future__ import annotations

import copy
import importlib
import inspect

import torch
from torch.overrides import TorchFunctionMode

SMALL = {"hidden": 16, "ffn": 12, "experts": 5}


#: the config attributes the experts modules read, set whatever their default (None, a list per layer, ...)
_KNOWN = {"num_experts": "experts", "num_local_experts": "experts", "n_routed_experts": "experts",
          "hidden_size": "hidden", "intermediate_size": "ffn", "moe_intermediate_size": "ffn"}


def _shrink(cfg) -> None:
    for key, size in _KNOWN.items():
        if hasattr(cfg, key):
            try:
                setattr(cfg, key, SMALL[size])
            except Exception:  # a validated field of another type (Ernie-VL: a list per modality)
                pass
    for key, value in list(vars(cfg).items()):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
            continue
        k = key.lower()
        if "expert" in k and not any(s in k for s in ("per_tok", "shared", "topk", "top_k", "group")):
            setattr(cfg, key, SMALL["experts"])
        elif k.endswith("hidden_size") or k in ("d_model", "hidden_dim"):
            setattr(cfg, key, SMALL["hidden"])
        elif "intermediate" in k or "ffn" in k or k.endswith("expert_dim"):
            setattr(cfg, key, SMALL["ffn"])


#: a per-layer SwiGLU clamp (Step3p7, BailingHybrid: ``gate.clamp(max=l)``, ``up.clamp(-l, l)`` in their
#: ``_apply_gate``) set low enough that the sweep's random activations (about 2 in size) are clipped
SWIGLU_LIMIT = 1.0


def build_experts(cls, configs, dtype=torch.float64, seed=0):
    """The experts module of ``cls`` from the first of ``configs`` it builds from, shrunk, parameters random;
    built as layer 0 where the class takes a ``layer_idx`` (per-layer settings such as SwiGLU limits)."""
    errors = []
    for config_cls in configs:
        try:
            cfg = config_cls()
            _shrink(cfg)
            if hasattr(cfg, "swiglu_limits"):
                cfg.swiglu_limits = [SWIGLU_LIMIT] * max(1, getattr(cfg, "num_hidden_layers", 1))
            init = getattr(cls.__init__, "__wrapped__", cls.__init__)
            params = inspect.signature(init).parameters
            extra = {"intermediate_size": SMALL["ffn"]} if "intermediate_size" in params else {}
            if "layer_idx" in params:
                extra["layer_idx"] = 0
            module = cls(cfg, **extra)
        except Exception as exc:  # not this config class
            errors.append(f"{config_cls.__name__}: {type(exc).__name__}: {exc}")
            continue
        big = [n for n, p in module.named_parameters() if p.numel() > 20000]
        if big:
            errors.append(f"{config_cls.__name__}: parameters {big} not shrunk")
            continue
        module.to(dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        cfg._experts_implementation = "eager"
        return module
    raise RuntimeError(f"{cls.__name__}: no config builds it: {errors}")


def routing(T: int, E: int, K: int, seed=1, dtype=torch.float64):
    """Distinct expert ids per token (random scores' top-k: no ties) and random positive weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(dtype) + 0.1
    return idx, w


def experts_families() -> list[str]:
    """The model families whose modeling file decorates an experts class (a scan of the sources, no import)."""
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("transformers.models").submodule_search_locations[0])
    return sorted(p.parent.name for p in root.glob("*/modeling_*.py")
                  if p.name == f"modeling_{p.parent.name}.py" and "@use_experts_implementation" in p.read_text())


def family_experts(family: str) -> list[tuple[type, list[type]]]:
    """``(experts class, config classes of the module)`` for each decorated experts class of ``family``."""
    from transformers import PreTrainedConfig

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    configs = [c for c in vars(mod).values() if inspect.isclass(c) and issubclass(c, PreTrainedConfig)]
    return [(cls, configs) for cls in vars(mod).values()
            if inspect.isclass(cls) and cls.__module__ == mod.__name__ and hasattr(cls, "_apply_gate")
            and hasattr(getattr(cls, "forward", None), "__wrapped__")]


def eager_forward(module):
    fwd = type(module).forward
    return fwd.__wrapped__.__get__(module)


def run_experts(module, fn, x, idx, w):
    """``fn(x, idx, w)`` and the gradients of a random projection of it wrt x, w and every parameter."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = fn(x, idx, w)
    g = torch.Generator().manual_seed(7)
    proj = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    (y * proj).sum().backward()
    grads = {"hidden_states": x.grad, "top_k_weights": w.grad}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return y.detach(), grads


class _Float32Seen(TorchFunctionMode):
    """Records whether any op returns a float32 tensor (a float64 forward that does so computes in fp32)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.seen = True
        return out


def eager_computes_in_fp32(module, x, idx, w) -> bool:
    """Whether the eager forward of a float64 ``module`` makes float32 tensors on the way (a ``.float()`` in the
    act_fn, an fp32 accumulator): then its float64 output is only fp32-exact, and so is any comparison with it."""
    mode = _Float32Seen()
    with torch.no_grad(), mode:
        eager_forward(module)(x, idx, w)
    return mode.seen


# Whole tiny models of every family (tests/integrations/test_transformers_models.py)

#: fields set on the family's config class and every sub-config class that has them (a 2-layer, hidden-32 model)
_MODEL_FIELDS = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 128, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "mlp_only_layers": [],
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    # MLA / DSA indexers
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2, "index_kpool": 2,
    # linear attention, Mamba
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 16,
    "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 16,
    "use_mamba_kernels": False,
    # Gemma-4 style per-layer inputs
    "top_k_experts": 2, "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8,
    # vision / audio towers (unused by text-only inputs, kept small)
    "num_layers": 2, "depth": 1, "num_heads": 4, "out_hidden_size": 32, "text_hidden_size": 32,
    "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 16, "d_model": 16, "output_dim": 32,
    "downsample_hidden_size": 8, "deepstack_visual_indexes": [0], "projector_hidden_size": 16,
}
_MODEL_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")

_FULL2 = ["full_attention", "full_attention"]
#: per-family fixes on top of _MODEL_FIELDS: at least one MoE layer in two, valid rope sections for the tiny
#: heads, no linear-attention layer where it needs flash-linear-attention's Triton kernels (no CPU path)
MODEL_FIXES = {
    "bailing_hybrid": {"layer_types": _FULL2, "swiglu_limits": [0.05, 0.05]},  # the clamp clips some activations
    "beam": {"mlp_layer_types": ["dense", "sparse"]},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "diffusion_gemma": {"text_config": {"enable_moe_block": True}},
    "ernie4_5_vl_moe": {"text_config": {"moe_intermediate_size": [12, 12], "rope_parameters": {
        "rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]}}},
    "gemma4": {"enable_moe_block": True},
    "glm4v_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.5}}},
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0, "head_dim": 0, "mlp_layer_types": ["dense", "sparse"],
                                  "layer_types": ["indexed_attention", "indexed_attention"]}},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "hy_v4_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [2, 1, 1]}}},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0},
    "kimi_linear": {"layer_types": _FULL2},
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 2},  # NVFP4 rounds keys and values in blocks of 16
    "lara_mini": {"layer_types": _FULL2},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "mistral_large4": {"text_config": {"max_position_embeddings": 1048576}},  # the YaRN factor's ratio
    "muse_spark": {"audio_config": {"num_hidden_layers": 4, "hidden_sizes": [8, 8, 8, 8], "out_hidden_size": 32},
                   "text_config": {"moe_hidden_size": 32}},
    "qwen3_5_moe": {"layer_types": _FULL2},
    "qwen3_next": {"layer_types": _FULL2},
    "qwen4_exp": {"layer_types": ["indexed_attention", "indexed_attention"], "indexer_n_heads": 2,
                  "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8, "indexer_compress_ratio": 2,
                  "hc_lowrank": 8},
    "step3p7": {"text_config": {"mlp_layer_types": ["dense", "sparse"], "swiglu_limits": [0.5, 0.5],
                                "sliding_window": 8}},  # its masks are built for sliding layers too
    "zaya": {"num_experts_per_tok": 1},  # the only value ZAYA takes
}
#: the model class when it is not the family's first *ForCausalLM / *ForConditionalGeneration / ...
MODEL_CLASS = {"qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}


def _model_kwargs(config_cls) -> dict:
    import transformers

    fields = getattr(config_cls, "__dataclass_fields__", {})
    kw = {k: v for k, v in _MODEL_FIELDS.items() if k in fields}
    for k in fields:
        if k in _MODEL_EXPERTS:
            kw[k] = 6
        elif "intermediate" in k and k not in kw:
            kw[k] = 40 if k == "intermediate_size" else 12
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # MLA: one kv head per head
    for name, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if name not in fields:
            continue
        if sub is transformers.AutoConfig:  # a tower of another family: its default model type, shrunk
            model_type = getattr((getattr(config_cls, "sub_configs_defaults", None) or {}).get(name), "model_type", None)
            if model_type is not None:
                kw[name] = {"model_type": model_type, **_model_kwargs(transformers.CONFIG_MAPPING[model_type])}
        else:
            kw[name] = _model_kwargs(sub)
    return kw


def _merge(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = _merge(d[k], v) if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def model_class(family: str):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if family in MODEL_CLASS:
        return getattr(mod, MODEL_CLASS[family])
    names = [n for n, c in vars(mod).items() if inspect.isclass(c) and c.__module__ == mod.__name__]
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "ForBlockDiffusion", "ForTokenClassification"):
        found = [n for n in names if n.endswith(suffix) and "PreTrained" not in n]
        if found:
            return getattr(mod, found[0])
    raise RuntimeError(f"{family}: no model class")


def tiny_family_model(family: str, seed: int = 0):
    """A 2-layer float64 model of ``family`` with eager experts, every parameter random (``* 0.2``).

    Modules a family keeps in fp32 (``_keep_in_fp32_modules``, e.g. routers) stay fp32, as ``from_pretrained``
    leaves them."""
    cls = model_class(family)
    kw = _merge(_model_kwargs(cls.config_class), copy.deepcopy(MODEL_FIXES.get(family, {})))
    model = cls._from_config(cls.config_class(**kw), experts_implementation="eager", dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    return model.eval()


def experts_modules(model) -> list:
    """The modules of a decorated experts class, or of a subclass of one that wraps its forward (ErgoExperts
    repeats each token per route, then calls the decorated forward)."""
    def decorated(cls):
        return any(hasattr(c.__dict__.get("forward"), "__wrapped__") for c in cls.__mro__)

    return [m for m in model.modules() if decorated(type(m)) and hasattr(m, "has_gate")]
