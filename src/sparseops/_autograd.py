"""The grad ops are not differentiable a second time; this makes them say so only where it matters.

A grad op (``moe_token_*_grad``, ``nsa_selected_attention_grad``, and the backward of the differentiable ops)
called on tensors that require grad gets an autograd formula whose backward is ``sparseops::no_double_backward``:
given an all-zero cotangent it returns zeros (the exact vector-Jacobian product of any function with a zero
cotangent), otherwise it raises a ``RuntimeError`` naming the op. Without a formula, ``torch.compile`` (AOT
autograd traces the backward of every output that requires grad) would fail at compile time even when nothing
backpropagates through the op; eager calls fail only when a backward reaches it. The check reads the cotangents (a
device sync on GPU), only on this path.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("sparseops::no_double_backward", mutates_args=())
def _no_double_backward(op: str, cotangents: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    for c in cotangents:
        if c.numel() and bool(c.ne(0).any()):  # NaN is != 0: it raises too
            raise RuntimeError(
                f"{op} is not differentiable (no double backward): a gradient flowed into its outputs. Compute "
                "what needs its gradient outside the backward, or detach its inputs"
            )
    return [torch.zeros_like(t) for t in like]


@_no_double_backward.register_fake
def _(op, cotangents, like):
    return [torch.empty_like(t) for t in like]


def register(op, name: str) -> None:
    """Give the custom op ``op`` (public name ``name``) the formula above for its floating-point tensor inputs."""

    def setup_context(ctx, inputs, output):
        pos = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        ctx.n_inputs, ctx.pos = len(inputs), pos
        ctx.save_for_backward(*(inputs[i] for i in pos))

    def backward(ctx, *grads):
        cot = [g for g in grads if g is not None]
        zeros = iter(_no_double_backward(name, cot, list(ctx.saved_tensors)))
        return tuple(next(zeros) if i in ctx.pos else None for i in range(ctx.n_inputs))

    op.register_autograd(backward, setup_context=setup_context)
