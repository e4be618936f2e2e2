"""Grouped expert FFNs: one autograd function over all experts, rows of expert e in one consecutive block.

Two GEMM paths behind one contract (docs/moe-layer.md, "Experts"): ``"loop"``, a ``torch.mm`` per non-empty
expert on its contiguous row block, written into preallocated outputs (public API, the fastest on the CPU),
and ``"grouped"``, ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm`` on older torch), one kernel
for all experts where the device has one. ``"auto"`` takes grouped on CUDA for 16-bit weights when it
is available, else the loop. Under ``torch.compile`` grouped runs where grouped_mm's fake kernel takes the
operands (bf16, aligned strides), the loop elsewhere. The choice lives in :data:`SETTINGS`
(``SETTINGS.override(gemm="loop")``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _autograd, _compile
from .._checks import check_has_data, check_int, check_param_dtype, check_tensor
from .._numerics import acc_dtype, autocast_cast, autocast_dtype
from .._settings import Settings
from ..moe.torch_impl import _empty_rows

ACTIVATIONS = ("swiglu", "gelu")
GEMMS = ("auto", "loop", "grouped")


@dataclasses.dataclass(frozen=True)
class ExpertSettings:
    #: ``"auto"``, ``"loop"`` or ``"grouped"`` (see the module docstring)
    gemm: str = "auto"


SETTINGS = Settings(ExpertSettings())


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer; large CPU ones are recycled blocks (moe.md, "CPU performance": no page faults).
    A 2-D one is not a view: the experts' output is one, and FSDP2 warns of a module output that is a view (an
    in-place op on it would drop FSDP's pre-backward hook)."""
    shape = tuple(shape)
    n = 1
    for d in shape[:-1]:
        n *= d
    rows = _empty_rows(n, shape[-1], like.dtype, like.device)
    return rows if len(shape) == 2 else rows.view(shape)


def _grouped_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped(x: torch.Tensor, w: torch.Tensor) -> bool:
    mode = SETTINGS.get().gemm
    if mode not in GEMMS:
        raise ValueError(f"ExpertSettings.gemm: expected one of {GEMMS}, got {mode!r}")
    if mode == "loop" or _grouped_fn() is None or x.dtype == torch.float64:
        return False
    if mode == "grouped":
        return True
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _fake_ok(t: torch.Tensor) -> bool:
    """Whether grouped_mm's fake kernel (torch/_meta_registrations.py) takes ``t``: bf16, one of its last two
    strides 1 and the other a multiple of 16 bytes and at least the size it steps over."""
    if t.dtype != torch.bfloat16 or t.dim() not in (2, 3):
        return False
    (s0, s1), (n0, n1) = t.stride()[-2:], t.shape[-2:]
    return (s0 == 1 and s1 >= max(1, n0) and s1 % 8 == 0) or (s1 == 1 and s0 >= max(1, n1) and s0 % 8 == 0)


def _grouped(a: torch.Tensor, b: torch.Tensor, offs) -> torch.Tensor | None:
    """``grouped_mm(a, b, offs=offs)``, or None where it has no kernel for these operands. Traced by dynamo
    it runs on fake tensors, whose kernel takes fewer operands than the eager ones (bf16 only, 16-byte aligned
    strides, where the CPU kernel also runs fp32): those are decided before the call, since dynamo's error
    cannot be caught in the traced code."""
    if torch.compiler.is_compiling():
        return _grouped_fn()(a, b, offs=offs) if _fake_ok(a) and _fake_ok(b) else None
    try:
        return _grouped_fn()(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):  # a device or dtype without a grouped kernel
        return None


def _mm_rows(x: torch.Tensor, w: torch.Tensor, counts: list[int], offs, out: torch.Tensor | None,
             grouped: bool) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ w[e].T`` for every expert (w `[E, N, C]`, x `[R, C]`, out `[R, N]`)."""
    y = _grouped(x, w.transpose(-2, -1), offs) if grouped else None
    if y is not None:
        return y
    if out is None:
        out = _empty((x.shape[0], w.shape[1]), x)
    s = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(x[s:s + c], w[e].T, out=out[s:s + c])
        s += c
    return out


def _mm_weight_grad(g: torch.Tensor, x: torch.Tensor, counts: list[int], offs, grouped: bool,
                    shape: torch.Size) -> torch.Tensor:
    """``gw[e] = g[rows of e].T @ x[rows of e]`` `[E, N, C]`; zeros for an expert with no rows."""
    gw = _grouped(g.T, x, offs) if grouped else None
    if gw is not None:
        return gw
    gw = _empty(shape, g)
    s = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(g[s:s + c].T, x[s:s + c], out=gw[e])
        else:
            gw[e].zero_()
        s += c
    return gw


#: the fused SwiGLU kernels are taken from this many elements of h1 on (smaller calls are as fast eager)
_FUSED_MIN_ELEMENTS = 1 << 16


def _fusable(*ts: torch.Tensor) -> bool:
    t = ts[0]
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and t.numel() >= _FUSED_MIN_ELEMENTS and min(t.shape) >= 2 and all(u.is_contiguous() for u in ts))


@_compile.kernel("swiglu_fwd")
def _swiglu_fwd_fused(h1: torch.Tensor, h3: torch.Tensor, out: torch.Tensor) -> None:
    a = h1.float()
    out.copy_((F.silu(a) * h3.float()).to(out.dtype))


@_compile.kernel("swiglu_bwd")
def _swiglu_bwd_fused(da: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor, dh1: torch.Tensor,
                      dh3: torch.Tensor) -> None:
    a, g = h1.float(), da.float()
    sig = torch.sigmoid(a)
    dh3.copy_((g * (a * sig)).to(dh3.dtype))
    dh1.copy_((g * h3.float() * (sig * (1 + a * (1 - sig)))).to(dh1.dtype))


def _act_fwd(h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
    """``silu(h1) * h3`` or ``gelu(h1)`` in fp32 (float64 for float64), rounded once to h1's dtype.

    SwiGLU on CPU tensors runs one fused pass (``_compile``) when no gradient is recorded through it."""
    if h3 is not None and not torch.is_grad_enabled() and _fusable(h1, h3):
        out = _empty(h1.shape, h1)
        if _swiglu_fwd_fused(h1, h3, out):
            return out
    acc = acc_dtype(h1)
    a = h1.to(acc)
    out = F.gelu(a) if h3 is None else F.silu(a) * h3.to(acc)
    # no .to() that would return ``out`` itself (fp32, float64): _SiluGate returns this, and under torch 2.11's
    # dynamo an autograd.Function whose output is also another traced tensor of its forward gets wrong
    # gradients (pytorch/pytorch#180642, docs/internals.md)
    return out if out.dtype == h1.dtype else out.to(h1.dtype)


def _act_bwd(da: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor | None):
    """Gradients of :func:`_act_fwd` wrt h1 (and h3), in fp32, rounded once."""
    if h3 is not None and _fusable(da, h1, h3):
        dh1, dh3 = _empty(h1.shape, h1), _empty(h3.shape, h3)
        if _swiglu_bwd_fused(da, h1, h3, dh1, dh3):
            return dh1, dh3
    acc = acc_dtype(h1)
    a, g = h1.to(acc), da.to(acc)
    sig = torch.sigmoid(a)
    if h3 is None:
        pdf = torch.exp(-0.5 * a * a) * 0.3989422804014327
        cdf = 0.5 * (1.0 + torch.erf(a * 0.7071067811865476))
        return (g * (cdf + a * pdf)).to(h1.dtype), None
    dh3 = (g * (a * sig)).to(h1.dtype)
    dh1 = (g * h3.to(acc) * (sig * (1 + a * (1 - sig)))).to(h1.dtype)
    return dh1, dh3


class _GroupedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2, counts, grouped):
        R = x.shape[0]
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32) if grouped else None
        h1 = _mm_rows(x, w1, counts, offs, _empty((R, w1.shape[1]), x), grouped)
        h3 = None if w3 is None else _mm_rows(x, w3, counts, offs, _empty((R, w3.shape[1]), x), grouped)
        a = _act_fwd(h1, h3)
        out = _mm_rows(a, w2, counts, offs, _empty((R, w2.shape[1]), x), grouped)
        ctx.save_for_backward(x, w1, w3, w2, h1, h3, a)
        ctx.counts, ctx.offs, ctx.grouped = counts, offs, grouped
        return out

    @staticmethod
    @_autograd.once_differentiable("GroupedExperts")
    def backward(ctx, gout):
        x, w1, w3, w2, h1, h3, a = ctx.saved_tensors
        counts, offs, grouped = ctx.counts, ctx.offs, ctx.grouped
        gout = gout.contiguous()
        gw2 = _mm_weight_grad(gout, a, counts, offs, grouped, w2.shape)
        # da[rows of e] = gout[rows of e] @ w2[e]: w2[e].T.T, so pass w2 transposed per expert
        da = _mm_rows(gout, w2.transpose(-2, -1), counts, offs, _empty(a.shape, gout), grouped)
        dh1, dh3 = _act_bwd(da, h1, h3)
        del a, da
        gw1 = _mm_weight_grad(dh1, x, counts, offs, grouped, w1.shape)
        gw3 = None if w3 is None else _mm_weight_grad(dh3, x, counts, offs, grouped, w3.shape)
        gx = _mm_rows(dh1, w1.transpose(-2, -1), counts, offs, _empty(x.shape, x), grouped)
        if w3 is not None:
            if grouped:
                gx = gx + _mm_rows(dh3, w3.transpose(-2, -1), counts, offs, None, True)
            else:  # addmm adds the second product before the one rounding to x's dtype
                s = 0
                for e, c in enumerate(counts):
                    if c:
                        gx[s:s + c].addmm_(dh3[s:s + c], w3[e])
                    s += c
        return gx, gw1, gw3, gw2, None, None


def check_rows_dtype(x: torch.Tensor, w: torch.Tensor) -> None:
    """``x`` in the experts' weight dtype, or in an enclosing autocast's (TypeError naming both otherwise)."""
    cdt = autocast_dtype(w)
    if x.dtype != w.dtype and x.dtype != cdt:
        also = "" if cdt is None else f" or {cdt} (the enclosing autocast's)"
        raise TypeError(f"x: expected dtype {w.dtype} (the experts' weights){also}, got {x.dtype}")


def check_counts(tokens_per_expert, E: int, R: int) -> list[int]:
    """``tokens_per_expert`` as a list of E non-negative ints summing to R (ValueError/TypeError otherwise)."""
    name = "tokens_per_expert"
    if isinstance(tokens_per_expert, torch.Tensor):
        if tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor or a list of ints, got {tokens_per_expert.dtype}")
        if tokens_per_expert.dim() != 1:
            raise ValueError(f"{name}: expected shape [E={E}], got {list(tokens_per_expert.shape)}")
        check_has_data(name, tokens_per_expert)
        counts = tokens_per_expert.tolist()
    elif isinstance(tokens_per_expert, Sequence):
        counts = list(tokens_per_expert)
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, int):
                raise TypeError(f"{name}: expected ints, got {type(c).__name__} in {counts!r}")
    else:
        raise TypeError(f"{name}: expected a list of ints or an int tensor, got {type(tokens_per_expert).__name__}")
    if len(counts) != E:
        raise ValueError(f"{name}: expected {E} counts (one per expert), got {len(counts)}")
    if any(c < 0 for c in counts):
        raise ValueError(f"{name}: expected counts >= 0, got {counts}")
    if sum(counts) != R:
        raise ValueError(f"{name}: expected counts summing to the rows of x (R = {R}), got sum {sum(counts)}")
    return [int(c) for c in counts]


class GroupedExperts(nn.Module):
    """``num_experts`` FFN experts applied to expert-sorted rows, as grouped GEMMs.

    Expert e on a row ``x``: ``swiglu``: ``(silu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T``; ``gelu`` (exact erf):
    ``gelu(x w1[e]^T) w2[e]^T``. Matmuls accumulate in fp32; the activation runs in fp32 and is rounded once.
    An expert with no rows costs nothing and its weights get zero gradients (never None).

    Args:
        num_experts: E (the experts held by this module: the local experts under expert parallelism).
        hidden_size: H. ffn_size: F. activation: ``"swiglu"`` or ``"gelu"``.

    Parameters: ``w1 [E, F, H]``, ``w3 [E, F, H]`` (swiglu only), ``w2 [E, H, F]``.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, activation: str = "swiglu", *,
                 device=None, dtype=None):
        super().__init__()
        E = check_int("num_experts", num_experts, lo=0)
        H = check_int("hidden_size", hidden_size, lo=1)
        Fs = check_int("ffn_size", ffn_size, lo=1)
        check_param_dtype(dtype)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.num_experts, self.hidden_size, self.ffn_size, self.activation = E, H, Fs, activation
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(E, Fs, H, **kw))
        self.w3 = nn.Parameter(torch.empty(E, Fs, H, **kw)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(E, H, Fs, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.hidden_size ** -0.5)
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=self.hidden_size ** -0.5)
        nn.init.normal_(self.w2, std=self.ffn_size ** -0.5)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, "
                f"activation={self.activation!r}")

    def forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """Apply expert e to its block of rows.

        Args:
            x: `[R, H]` expert-sorted rows (the rows of expert e follow those of experts < e), float dtype of
                the weights or, under ``torch.autocast``, its dtype.
            tokens_per_expert: `[E]` ints (list or integer tensor, a host sync) summing to R.

        Returns:
            `[R, H]` in x's dtype; under ``torch.autocast`` in its dtype (the GEMMs run in it).
        """
        check_tensor("x", x)
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected shape [R, H={self.hidden_size}], got {list(x.shape)}")
        check_rows_dtype(x, self.w1)
        if x.device != self.w1.device:
            raise ValueError(f"x: expected device {self.w1.device} (the experts' weights), got {x.device}")
        counts = check_counts(tokens_per_expert, self.num_experts, x.shape[0])
        return self.apply_counts(x, counts)

    def apply_counts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`forward` without the argument checks (``counts`` already a checked list).

        Under ``torch.autocast`` the GEMMs run in its dtype, as ``F.linear`` would: x and the weights are cast
        (differentiably: the weights' gradients arrive in their own dtype)."""
        w1, w3, w2 = (local_tensor(w) for w in (self.w1, self.w3, self.w2))
        x, w1, w3, w2 = autocast_cast(w1, x, w1, w3, w2)
        grouped = _use_grouped(x, w1)
        return _GroupedFFN.apply(x.contiguous(), w1, w3, w2, counts, grouped)


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor parameter (``to_local``: differentiable), any other tensor unchanged.

    Under :func:`sparseops.distributed.parallelize` the experts' parameters are DTensors of the global shape
    ``[E, ...]`` sharded over the ``ep`` mesh dimension (docs/training.md); the GEMMs run on the local
    experts. Without a loaded ``torch.distributed.tensor`` no DTensor exists, so nothing is imported here."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if t is not None and dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.to_local()
    return t
