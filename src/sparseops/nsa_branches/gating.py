"""The gated sum of the NSA branches, ``o = sum_c g[..., c] * o_c`` (docs/nsa-module.md), as one autograd node.

Spelled with torch ops, the sum makes a fresh ``[T, N1, Dv]`` tensor per product and per addition, and its
backward another per gate gradient before reducing it; each fresh tensor's pages cost more than its arithmetic
(docs/perf.md). Here the forward writes one tensor, and the backward reduces each gate's gradient
``rowsum(dO * o_c)`` by slices of tokens (``_numerics.row_dot``, in fp32, float64 for float64).
"""

from __future__ import annotations

import torch

from .. import _checks
from .._numerics import acc_dtype, row_dot


class _GatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates, *outs):
        o = outs[0] * gates[..., 0:1]
        for c in range(1, len(outs)):
            if torch.compiler.is_compiling():
                # traced, out of place (Inductor fuses the sum anyway): under torch 2.11's dynamo an in-place
                # op on the returned tensor routes its gradient to the wrong node, and every input's is 0
                # (pytorch/pytorch#180642)
                o = o + outs[c] * gates[..., c:c + 1]
            else:
                o.addcmul_(outs[c], gates[..., c:c + 1])
        ctx.save_for_backward(gates, *outs)
        return o

    @staticmethod
    def backward(ctx, do):
        gates, *outs = ctx.saved_tensors
        dg = None
        if ctx.needs_input_grad[0]:
            acc = acc_dtype(do)
            dg = torch.stack([row_dot(do, o, acc) for o in outs], dim=-1).to(gates.dtype)
        douts = [do * gates[..., c:c + 1] if ctx.needs_input_grad[1 + c] else None for c in range(len(outs))]
        return dg, *douts


def gated_sum(gates: torch.Tensor, *outs: torch.Tensor) -> torch.Tensor:
    """``sum_c gates[..., c:c+1] * outs[c]`` for ``gates [..., C]`` and C tensors ``[..., D]`` of one shape, all in
    the gates' floating dtype; differentiable in all of them."""
    gates = _checks.check_tensor("gates", gates, dtypes=_checks.FLOAT_DTYPES + (torch.float64,))
    if gates.dim() == 0 or gates.shape[-1] != len(outs):
        raise ValueError(f"gates: expected {len(outs)} columns (one per output), got shape "
                         f"{_checks.fmt_shape(gates.shape)}")
    if not outs:
        raise ValueError("outs: expected at least one output to sum, got none")
    for c, o in enumerate(outs):
        o = _checks.check_tensor(f"outs[{c}]", o, ndim=gates.dim())
        if o.shape != outs[0].shape:
            raise ValueError(f"outs[{c}]: expected the shape of outs[0] {_checks.fmt_shape(outs[0].shape)}, got "
                             f"{_checks.fmt_shape(o.shape)}")
        if o.dtype != gates.dtype:  # a mixed sum would round silently into whichever dtype wins the promotion
            raise TypeError(f"outs[{c}]: expected the dtype of gates ({str(gates.dtype).replace('torch.', '')}), "
                            f"got {str(o.dtype).replace('torch.', '')}")
    _checks.check_same_device(gates=gates, **{f"outs[{c}]": o for c, o in enumerate(outs)})
    if gates.shape[:-1] != outs[0].shape[:-1]:
        want = [*outs[0].shape[:-1], len(outs)]
        raise ValueError(f"gates: expected shape {_checks.fmt_shape(want)} (the outputs' leading dimensions), got "
                         f"{_checks.fmt_shape(gates.shape)}")
    return _GatedSum.apply(gates, *outs)
