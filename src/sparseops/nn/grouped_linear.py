"""A differentiable grouped linear layer: expert e's weight applied to its consecutive block of rows.

``out[rows of e] = x[rows of e] @ w[e]^T (+ bias[e])`` for weights stored ``[E, N, C]`` (``nn.Linear``'s layout
per expert), or ``x[rows of e] @ w[e] (+ bias[e])`` for weights stored ``[E, C, N]`` (``transposed=True``).
The GEMMs are the grouped experts' own (:mod:`sparseops.nn.experts`: a ``torch.mm`` per non-empty expert, or
one ``grouped_mm``, chosen by ``ExpertSettings.gemm``), run on the weight as stored: no copy, views only.
An expert with no rows costs nothing and gets zero gradients (never None). docs/transformers.md shows where
the transformers experts backend uses it.
"""

from __future__ import annotations

import torch

from .. import _autograd
from .._checks import check_tensor
from .._numerics import acc_dtype, autocast_cast
from .experts import _empty, _mm_rows, _mm_weight_grad, _use_grouped, check_counts


def _offsets(counts: list[int], device, grouped: bool):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32) if grouped else None


def _bias_rows(bias: torch.Tensor, counts: list[int], R: int) -> torch.Tensor:
    """`[R, N]`: row i holds the bias of the expert that owns row i."""
    reps = torch.tensor(counts, device=bias.device)
    return bias.repeat_interleave(reps, dim=0, output_size=R)


def _bias_grad(g: torch.Tensor, counts: list[int], E: int, dtype: torch.dtype) -> torch.Tensor:
    """``gb[e] = sum of g[rows of e]`` in fp32 (float64 for float64), rounded once; zeros for empty experts."""
    acc = acc_dtype(g)
    gb = torch.zeros(E, g.shape[1], dtype=acc, device=g.device)
    s = 0
    for e, c in enumerate(counts):
        if c:
            torch.sum(g[s:s + c], dim=0, dtype=acc, out=gb[e])
        s += c
    return gb.to(dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, counts, transposed, grouped):
        R = x.shape[0]
        offs = _offsets(counts, x.device, grouped)
        w_nc = w.transpose(-2, -1) if transposed else w  # [E, N, C], a view
        out = _mm_rows(x, w_nc, counts, offs, _empty((R, w_nc.shape[1]), x), grouped)
        if bias is not None:
            if torch.compiler.is_compiling():
                # traced, out of place: under torch 2.11's dynamo an in-place op on the returned tensor leaves
                # every input's gradient wrong (pytorch/pytorch#180642; nsa_branches/gating.py)
                out = out + _bias_rows(bias, counts, R)
            else:
                out.add_(_bias_rows(bias, counts, R))
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.offs, ctx.transposed, ctx.grouped = counts, offs, transposed, grouped
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @_autograd.once_differentiable("grouped_linear")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        counts, offs, transposed, grouped = ctx.counts, ctx.offs, ctx.transposed, ctx.grouped
        g = g.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            # gx[rows of e] = g[rows of e] @ w_nc[e]: _mm_rows multiplies by the transpose of what it gets
            w_cn = w if transposed else w.transpose(-2, -1)  # [E, C, N]
            gx = _mm_rows(g, w_cn, counts, offs, _empty(x.shape, g), grouped)
        if ctx.needs_input_grad[1]:
            if transposed:  # gw[e] = x[rows of e]^T @ g[rows of e], `[E, C, N]` as stored
                gw = _mm_weight_grad(x, g, counts, offs, grouped, w.shape)
            else:
                gw = _mm_weight_grad(g, x, counts, offs, grouped, w.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = _bias_grad(g, counts, w.shape[0], ctx.bias_dtype)
        return gx, gw, gb, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts, *, transposed: bool = False,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Apply expert e's linear map to its block of expert-sorted rows; differentiable in x, w and bias.

    ``out[r] = x[r] @ w[e]^T + bias[e]`` (``transposed=False``, w `[E, N, C]`) or ``x[r] @ w[e] + bias[e]``
    (``transposed=True``, w `[E, C, N]`), where e owns row r: rows ``[sum(counts[:e]), sum(counts[:e+1]))``.
    Products accumulate in fp32 (float64 for float64) and are rounded once to x's dtype; the bias is added
    after that rounding (transformers' order). The weight gradient of an expert with no rows is zero.

    Example: counts ``[2, 0, 1]``: rows 0-1 use w[0], row 2 uses w[2]; ``w.grad[1]`` is zeros.

    Under ``torch.autocast`` it casts as ``F.linear`` does: x, w and bias (fp32 / fp16 / bf16; float64 is left
    as it is) to autocast's dtype, differentiably, and the result comes in that dtype.

    Args:
        x: `[R, C]` float32 / float16 / bfloat16 / float64, expert-sorted rows.
        w: `[E, N, C]` (or `[E, C, N]` with ``transposed=True``), x's dtype; any strides.
        counts: `[E]` non-negative ints (a list, or an integer tensor: a host sync) summing to R.
        transposed: the weight layout (see above).
        bias: optional `[E, N]` in x's dtype.

    Returns:
        `[R, N]` in x's dtype.

    Raises:
        TypeError, ValueError: a bad argument (the message names it, with the expected and actual value).
    """
    check_tensor("x", x)
    check_tensor("w", w)
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed: expected a bool, got {type(transposed).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [R, C], got {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: expected a floating-point dtype, got {x.dtype}")
    x, w, bias = autocast_cast(x, x, w, bias)  # as F.linear under autocast
    if w.dim() != 3:
        raise ValueError(f"w: expected shape [E, N, C] or [E, C, N] (transposed), got {list(w.shape)}")
    E, C = w.shape[0], (w.shape[1] if transposed else w.shape[2])
    N = w.shape[2] if transposed else w.shape[1]
    if x.shape[1] != C:
        layout = "[E, C, N]" if transposed else "[E, N, C]"
        raise ValueError(f"x: expected shape [R, C={C}] (w is {layout} = {list(w.shape)}), got {list(x.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected dtype {x.dtype} (x's), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected device {x.device} (x's), got {w.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"bias: expected shape [E={E}, N={N}], got {list(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias: expected dtype {x.dtype} (x's), got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias: expected device {x.device} (x's), got {bias.device}")
    counts = check_counts(counts, E, x.shape[0])
    return grouped_linear_unchecked(x, w, counts, transposed=transposed, bias=bias)


def grouped_linear_unchecked(x: torch.Tensor, w: torch.Tensor, counts: list[int], *, transposed: bool = False,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grouped_linear` without the argument checks (``counts`` already a checked list of ints)."""
    x, w, bias = autocast_cast(x, x, w, bias)
    w_nc = w.transpose(-2, -1) if transposed else w
    grouped = _use_grouped(x, w_nc)
    return _GroupedLinear.apply(x.contiguous(), w, bias, counts, transposed, grouped)
