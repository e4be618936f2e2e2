"""Tiny transformers MoE pieces built locally (no downloads), every parameter randomised."""

from __future__ import annotations

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


def build_experts(cls, configs, dtype=torch.float64, seed=0):
    """The experts module of ``cls`` from the first of ``configs`` it builds from, shrunk, parameters random."""
    errors = []
    for config_cls in configs:
        try:
            cfg = config_cls()
            _shrink(cfg)
            init = getattr(cls.__init__, "__wrapped__", cls.__init__)
            extra = {"intermediate_size": SMALL["ffn"]} if "intermediate_size" in inspect.signature(init).parameters else {}
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
