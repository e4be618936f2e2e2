"""The grad ops are not differentiable a second time, and no op has a forward-mode formula; this makes them say so.

A grad op (``moe_token_*_grad``, ``nsa_selected_attention_grad``, and the backward of the differentiable ops)
called on tensors that require grad gets an autograd formula whose backward is ``sparseops::no_double_backward``:
given an all-zero cotangent it returns zeros (the exact vector-Jacobian product of any function with a zero
cotangent), otherwise it raises a ``RuntimeError`` naming the op. Without a formula, ``torch.compile`` (AOT
autograd traces the backward of every output that requires grad) would fail at compile time even when nothing
backpropagates through the op; eager calls fail only when a backward reaches it. The check reads the cotangents (a
device sync on GPU), only on this path.

The ``torch.autograd.Function`` s whose backward runs outside autograd (C++ kernels, products written into buffers)
decorate it with :func:`once_differentiable`. Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp`` /
``jacfwd``): torch runs a custom op whose inputs do not require grad without their tangents, a zero derivative
without a word. The public ops call :func:`check_no_forward_ad` first, which raises instead.
"""

from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as fwAD


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


def once_differentiable(name: str):
    """For the ``backward`` of an ``autograd.Function`` named ``name`` in messages: run it without autograd and,
    under ``create_graph=True``, return gradients that raise a ``RuntimeError`` naming ``name`` when differentiated
    again. torch's ``once_differentiable`` marks them only when an incoming gradient requires grad, so a
    second derivative through the saved inputs (an incoming gradient of 1) would be a silent zero; this also
    counts the saved tensors."""

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled() or not any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in (*grads, *ctx.saved_tensors)):
                return out
            outs = out if isinstance(out, tuple) else (out,)
            err = torch._C._functions.DelayedError(
                f"{name} is not differentiable twice (its backward runs outside autograd): a gradient flowed "
                "into the gradients it returned".encode(), len(outs))
            marked = err(*(None if t is None else t.detach().requires_grad_() for t in outs))
            marked = marked if isinstance(marked, tuple) else (marked,)
            return marked if isinstance(out, tuple) else marked[0]

        return wrapper

    return wrap


def _has_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dual tensor, also inside ``torch.func`` wrappers (``jvp``, ``jacfwd``, ``vmap`` around or
    inside them): the layers are read, nothing is unwrapped for use."""
    functorch = torch._C._functorch
    while True:
        try:
            if fwAD.unpack_dual(t).tangent is not None:
                return True
        except RuntimeError:  # a vmap layer inside jvp has no rule for reading the dual: look below it
            pass
        if not functorch.is_functorch_wrapped_tensor(t):
            return False
        t = functorch.get_unwrapped(t)


def check_no_forward_ad(name: str, *tensors) -> None:
    """``NotImplementedError`` naming the public op ``name`` when forward-mode AD would pass through it with one of
    ``tensors`` (None allowed) carrying a tangent: the custom op would drop it. One global read when no dual level
    is open (``torch.func.jvp`` opens one too); skipped while compiling."""
    if fwAD._current_level < 0 or torch.compiler.is_compiling():
        return
    if any(_has_tangent(t) for t in tensors if isinstance(t, torch.Tensor)):
        raise NotImplementedError(
            f"{name}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp / jacfwd) is not supported, got "
            "an input with a tangent; use reverse mode (Tensor.backward, torch.autograd.grad)"
        )
