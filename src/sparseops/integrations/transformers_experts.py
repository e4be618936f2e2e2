"""``experts_implementation="sparseops"``: the experts forward of transformers' MoE families on sparseops ops.

For an experts module decorated with transformers' ``use_experts_implementation`` (docs/transformers.md):

1. ``moe_token_permute_with_ep`` sorts the token copies by expert and keeps the window ``[0, kept)`` of the
   rows of real experts, so EP sentinel ids (``>= num_experts``) sort last and drop out: they cost nothing
   and contribute nothing, their routing weights get zero gradients;
2. :func:`sparseops.nn.grouped_linear.grouped_linear` runs the gate/up GEMM on the module's own parameter as
   stored (``gate_up_proj`` or ``up_proj``, ``[E, N, H]`` or transposed ``[E, H, N]``, with its bias);
3. the module's own ``_apply_gate`` (concatenated or interleaved halves, GPT-OSS's clamped SwiGLU ...) or,
   without a gate, its ``act_fn``, by autograd; the default gate with SiLU runs fused (fp32, rounded once);
4. the down GEMM, the optional ``post_expert_norm``;
5. ``moe_token_unpermute_with_ep`` with the routing weights: the k-sum in fp32, rounded once.

The weights, their names and the checkpoints stay transformers'. A module this path cannot run exactly runs
its eager forward, with one warning per class and reason.
"""

from __future__ import annotations

import warnings

import torch

from .. import _compile
from .._numerics import autocast_dtype
from ..moe.api import moe_token_permute_with_ep, moe_token_unpermute_with_ep
from ..nn.experts import _FUSED_MIN_ELEMENTS, _act_bwd, _act_fwd, _empty
from ..nn.grouped_linear import grouped_linear_unchecked

NAME = "sparseops"

_WARNED: set[tuple[str, str]] = set()


def _eager_forward(module):
    """The forward ``use_experts_implementation`` wrapped: that of the nearest class in the module's MRO whose own
    forward is the decorated one. A subclass may override ``forward`` and call ``super().forward`` (Ergo's
    ``ErgoExperts``): its forward leads back here, so falling back to it would recurse."""
    for cls in type(module).__mro__:
        fwd = cls.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, "__wrapped__"):
            return fwd.__wrapped__
    return type(module).forward


def _params(module):
    """``(up weight, up bias, down weight, down bias)``: the module's own tensors (views of its parameters)."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    bias = getattr(module, "has_bias", False)
    return (getattr(module, up, None), getattr(module, up + "_bias", None) if bias else None,
            getattr(module, "down_proj", None), getattr(module, "down_proj_bias", None) if bias else None)


def unsupported_reason(module, hidden_states, top_k_index, top_k_weights, extra) -> str | None:
    """Why this call cannot run on the sparseops path exactly (None when it can)."""
    if extra:
        return f"the experts forward got extra arguments {sorted(extra)} this path does not know"
    if not hasattr(module, "has_gate") or not hasattr(module, "num_experts"):
        return "the module is not decorated with transformers' use_experts_implementation"
    w_up, b_up, w_down, b_down = _params(module)
    up = "gate_up_proj" if module.has_gate else "up_proj"
    for name, w in ((up, w_up), ("down_proj", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            return f"no 3-D parameter {name!r} (got {type(w).__name__})"
        if not w.dtype.is_floating_point:
            return f"{name} has dtype {w.dtype} (quantized weights)"
        if type(w) not in (torch.Tensor, torch.nn.Parameter):
            return f"{name} is a {type(w).__name__}, not a plain tensor"
    if module.has_bias and (b_up is None or b_down is None):
        return "has_bias is set but a bias parameter is missing"
    if w_up.dtype != w_down.dtype:
        return f"{up} is {w_up.dtype} and down_proj {w_down.dtype}"
    if not module.has_gate and not hasattr(module, "act_fn"):
        return "has_gate=False without an act_fn"
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        return "hidden_states is not a 2-D tensor [T, H]"
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        return f"top_k_index has shape {list(top_k_index.shape)}, not [T={hidden_states.shape[0]}, K]"
    if top_k_index.dtype not in (torch.int32, torch.int64):
        return f"top_k_index has dtype {top_k_index.dtype}"
    if top_k_weights.shape != top_k_index.shape or not top_k_weights.dtype.is_floating_point:
        return "top_k_weights does not have top_k_index's shape or is not floating point"
    if top_k_index.shape[1] > 512:
        return f"top-k {top_k_index.shape[1]} > 512 (the permute ops' limit)"
    return None


def _warn_fallback(module, reason: str) -> None:
    key = (type(module).__qualname__, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f'experts_implementation="sparseops": {type(module).__name__} runs its eager forward: {reason}',
                      RuntimeWarning, stacklevel=3)


def _is_default_silu_gate(module) -> bool:
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    return (module.has_gate and type(module)._apply_gate is _default_apply_gate
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, torch.nn.SiLU))


@_compile.kernel("silu_gate_fwd")
def _silu_gate_fwd_fused(h: torch.Tensor, out: torch.Tensor) -> None:
    F = h.shape[1] // 2
    a = h[:, :F].float()
    out.copy_((torch.nn.functional.silu(a) * h[:, F:].float()).to(out.dtype))


@_compile.kernel("silu_gate_bwd")
def _silu_gate_bwd_fused(g: torch.Tensor, h: torch.Tensor, dh: torch.Tensor) -> None:
    F = h.shape[1] // 2
    a, u, gf = h[:, :F].float(), h[:, F:].float(), g.float()
    sig = torch.sigmoid(a)
    dh[:, F:].copy_((gf * (a * sig)).to(dh.dtype))
    dh[:, :F].copy_((gf * u * (sig * (1 + a * (1 - sig)))).to(dh.dtype))


def _fusable(h: torch.Tensor) -> bool:
    return (h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and h.numel() >= 2 * _FUSED_MIN_ELEMENTS and min(h.shape) >= 2 and h.is_contiguous())


class _SiluGate(torch.autograd.Function):
    """``silu(h[:, :F]) * h[:, F:]`` in fp32 (float64 for float64), rounded once (transformers' default gate):
    one fused pass over the concatenated GEMM output on the CPU (``_compile``), the eager code elsewhere."""

    @staticmethod
    def forward(ctx, h):
        F = h.shape[1] // 2
        ctx.save_for_backward(h)
        if _fusable(h):
            out = _empty((h.shape[0], F), h)
            if _silu_gate_fwd_fused(h, out):
                return out
        return _act_fwd(h[:, :F], h[:, F:])

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        F = h.shape[1] // 2
        g = g.contiguous()
        dh = _empty(h.shape, h)
        if _fusable(h) and _silu_gate_bwd_fused(g, h, dh):
            return dh
        dh1, dh3 = _act_bwd(g, h[:, :F], h[:, F:])
        dh[:, :F], dh[:, F:] = dh1, dh3
        return dh


def _gate(module, h: torch.Tensor) -> torch.Tensor:
    if not module.has_gate:
        return module.act_fn(h)
    if _is_default_silu_gate(module) and h.shape[1] % 2 == 0:
        return _SiluGate.apply(h)
    return module._apply_gate(h)


def experts_rows(module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The module's experts on expert-sorted rows (``counts[e]`` rows of local expert e), unweighted: `[R, H]`."""
    w_up, b_up, w_down, b_down = _params(module)
    t = module.is_transposed
    h = grouped_linear_unchecked(rows, w_up, counts, transposed=t, bias=b_up)
    h = grouped_linear_unchecked(_gate(module, h), w_down, counts, transposed=t, bias=b_down)
    if getattr(module, "has_post_expert_norm", False):
        h = module.post_expert_norm(h)
    return h


def _counts(top_k_index: torch.Tensor, E: int) -> list[int]:
    """Slots per expert ``[E]``; ids ``>= E`` (EP sentinels) are not counted. The one host sync, which also
    counts the negative ids: a ``ValueError`` naming ``top_k_index`` (bincount's own error said nothing of it)."""
    counts = torch.bincount(top_k_index.reshape(-1).clamp(-1, E) + 1, minlength=E + 2).tolist()
    if counts[0]:
        raise ValueError(f"top_k_index: expected expert ids >= 0, got {counts[0]} negative "
                         f"(min {int(top_k_index.min())})")
    return counts[1:E + 1]


def sparseops_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``out[t] = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])``; ids ``>= E`` add 0.

    Args:
        module: the experts module (``self`` of the class transformers decorated).
        hidden_states: `[T, H]`, cast to the weights' dtype for the GEMMs (under ``torch.autocast``, to its).
        top_k_index: `[T, K]` int local expert ids; ids ``>= num_experts`` are EP sentinels (dropped).
        top_k_weights: `[T, K]` routing weights, any float dtype.

    Returns:
        `[T, H]` in hidden_states' dtype.
    """
    extra = dict(kwargs)
    if args:
        extra["positional"] = args
    reason = unsupported_reason(module, hidden_states, top_k_index, top_k_weights, extra)
    if reason is not None:
        _warn_fallback(module, reason)
        return _eager_forward(module)(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    E = module.num_experts
    w_up = _params(module)[0]
    x = hidden_states.to(autocast_dtype(w_up) or w_up.dtype)  # under autocast the GEMMs run in its dtype
    counts = _counts(top_k_index, E)
    kept = sum(counts)
    rows, sidx, _ = moe_token_permute_with_ep(x, top_k_index, None, [0, kept], validate=False)
    out = experts_rows(module, rows, counts)
    y = moe_token_unpermute_with_ep(out, sidx, top_k_weights, range=[0, kept], validate=False)
    return y.to(hidden_states.dtype)
