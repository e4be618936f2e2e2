"""Public MoE ops: token permute / unpermute with an expert-parallel (EP) row window, and their gradients.

Contract: docs/moe.md. Every public function validates all of its arguments (:mod:`.checks`, before anything
is computed), normalises the window once (``normalize_range``), picks a backend (:func:`sparseops._backend.resolve`)
and calls it through a ``torch.library`` custom op (namespace ``sparseops``) and the dispatcher
(:func:`sparseops._backend.call`), so that the ops are differentiable and trace under
``torch.compile(fullgraph=True)`` without graph breaks.

Choices where the contract is silent (docs/moe.md):

- ``padded_mode=True`` raises ``NotImplementedError`` naming ``padded_mode``.
- float64 tokens / probs are accepted (for ``torch.autograd.gradcheck``); math is then float64.
- ``probs`` and ``topk_num`` both given: ``K = probs.shape[1]``; ``topk_num`` must be 1 (the default, as in CANN's
  example) or equal K, any other value is a contradiction (``ValueError``).
- ``indices`` of shape ``[T]`` means K = 1; ``probs`` may then be ``[T]`` or ``[T, 1]``.
- ``range`` is a list / tuple of two ints, or a 1-D integer tensor with two elements (not under
  ``torch.compile``: its values decide the output's row count; a clear ``TypeError`` says so).
- Data-dependent checks (index values, duplicates) run when ``validate=True`` and the call is not being
  traced by ``torch.compile``; shape / dtype checks always run.
"""


from collections.abc import Sequence

import torch

from .. import _autograd, _backend
from .._checks import check_same_device
from . import reference, torch_impl
from .checks import (
    RangeLike,
    check_permute_args,
    check_permute_grad_args,
    check_unpermute_args,
    check_unpermute_grad_args,
)

#: the family's backends for the dispatcher (:mod:`sparseops._backend`)
FAMILY = _backend.Family("moe", ("permute", "unpermute", "unpermute_grad", "permute_grad"), reference, torch_impl,
                         "sparseops.moe.triton_impl")


def _none_to_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _fresh(out: torch.Tensor, *inputs) -> torch.Tensor:
    """A custom op may not return (a view of) an input."""
    ptr = out.untyped_storage().data_ptr()
    if out.numel() and any(t is not None and t.numel() and t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out


def _call(backend: str, auto: bool, fn: str, rows: torch.Tensor, **kwargs):
    """The backend's ``fn`` by keyword; under ``auto`` with the shape key of ``rows`` (device, dtype, H, K)."""
    key = (str(rows.device), rows.dtype, rows.shape[1], kwargs["K"]) if auto else None
    return _backend.call(FAMILY, backend, fn, fallback_key=key, **kwargs)


# Custom ops cannot return None: an empty tensor stands for it. ``backend`` is the resolved backend, ``auto``
# whether ``backend="auto"`` chose it (docs/internals.md).


@torch.library.custom_op("sparseops::moe_permute", mutates_args=())
def _permute_op(tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None, K: int, s: int,
                e: int, backend: str, auto: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, pprobs = _call(backend, auto, "permute", tokens, tokens=tokens, sorted_indices=sorted_indices, probs=probs,
                        K=K, s=s, e=e)
    return _fresh(out, tokens), _none_to_empty(_fresh(pprobs, probs) if pprobs is not None else None, tokens)


@_permute_op.register_fake
def _(tokens, sorted_indices, probs, K, s, e, backend, auto):
    pprobs = tokens.new_empty(0) if probs is None else probs.new_empty(e - s)
    return tokens.new_empty(e - s, tokens.shape[1]), pprobs


@torch.library.custom_op("sparseops::moe_unpermute", mutates_args=())
def _unpermute_op(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None, K: int,
                  s: int, e: int, backend: str, auto: bool) -> torch.Tensor:
    out = _call(backend, auto, "unpermute", permuted_tokens, permuted_tokens=permuted_tokens,
                sorted_indices=sorted_indices, probs=probs, K=K, s=s, e=e)
    return _fresh(out, permuted_tokens)


@_unpermute_op.register_fake
def _(permuted_tokens, sorted_indices, probs, K, s, e, backend, auto):
    return permuted_tokens.new_empty(sorted_indices.shape[0] // K, permuted_tokens.shape[1])


@torch.library.custom_op("sparseops::moe_unpermute_grad", mutates_args=())
def _unpermute_grad_op(grad: torch.Tensor, sorted_indices: torch.Tensor, permuted_tokens: torch.Tensor | None,
                       probs: torch.Tensor | None, K: int, s: int, e: int, backend: str,
                       auto: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ptg, pg = _call(backend, auto, "unpermute_grad", grad, grad=grad, sorted_indices=sorted_indices,
                    permuted_tokens=permuted_tokens, probs=probs, K=K, s=s, e=e)
    return _fresh(ptg, grad), _none_to_empty(pg, grad)


@_unpermute_grad_op.register_fake
def _(grad, sorted_indices, permuted_tokens, probs, K, s, e, backend, auto):
    pg = grad.new_empty(0) if probs is None else probs.new_empty(grad.shape[0], K)
    return grad.new_empty(e - s, grad.shape[1]), pg


@torch.library.custom_op("sparseops::moe_permute_grad", mutates_args=())
def _permute_grad_op(permuted_tokens_grad: torch.Tensor, sorted_indices: torch.Tensor,
                     permuted_probs_grad: torch.Tensor | None, K: int, s: int, e: int, backend: str,
                     auto: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tg, pg = _call(backend, auto, "permute_grad", permuted_tokens_grad, permuted_tokens_grad=permuted_tokens_grad,
                   sorted_indices=sorted_indices, permuted_probs_grad=permuted_probs_grad, K=K, s=s, e=e)
    return _fresh(tg, permuted_tokens_grad), _none_to_empty(pg, permuted_tokens_grad)


@_permute_grad_op.register_fake
def _(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e, backend, auto):
    T = sorted_indices.shape[0] // K
    pg = permuted_tokens_grad.new_empty(0) if permuted_probs_grad is None else permuted_probs_grad.new_empty(T, K)
    return permuted_tokens_grad.new_empty(T, permuted_tokens_grad.shape[1]), pg


_autograd.register(_unpermute_grad_op, "moe_token_unpermute_with_ep_grad")
_autograd.register(_permute_grad_op, "moe_token_permute_with_ep_grad")


def _permute_setup_context(ctx, inputs, output):
    tokens, sorted_indices, probs, K, s, e, backend, auto = inputs
    ctx.save_for_backward(sorted_indices)
    ctx.args = (K, s, e, backend, auto)
    ctx.has_probs = probs is not None


def _permute_backward(ctx, grad_out, grad_pprobs):
    (sorted_indices,) = ctx.saved_tensors
    pprobs_grad = grad_pprobs if ctx.has_probs else None
    tg, pg = _permute_grad_op(grad_out, sorted_indices, pprobs_grad, *ctx.args)
    return tg, None, (pg if ctx.has_probs else None), None, None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup_context)


def _unpermute_setup_context(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, K, s, e, backend, auto = inputs
    ctx.has_probs = probs is not None
    if ctx.has_probs:
        ctx.save_for_backward(sorted_indices, permuted_tokens, probs)
    else:
        ctx.save_for_backward(sorted_indices)
    ctx.args = (K, s, e, backend, auto)


def _unpermute_backward(ctx, grad_out):
    if ctx.has_probs:
        sorted_indices, permuted_tokens, probs = ctx.saved_tensors
    else:
        (sorted_indices,) = ctx.saved_tensors
        permuted_tokens = probs = None
    ptg, pg = _unpermute_grad_op(grad_out, sorted_indices, permuted_tokens, probs, *ctx.args)
    return ptg, None, (pg if ctx.has_probs else None), None, None, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


def _resolve(op: str, backend, *tensors) -> tuple[str, bool]:
    _autograd.check_no_forward_ad(op, *tensors)
    device = check_same_device(**{f"arg{i}": t for i, t in enumerate(tensors)})
    return _backend.resolve(FAMILY, backend, device)


# Public ops


def moe_token_permute_with_ep(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    range: RangeLike | None = None,
    num_out_tokens: int = 0,
    padded_mode: bool = False,
    *,
    num_experts: int | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sort token copies by expert and keep the rows of one expert-parallel window ``[s, e)``.

    Slot ``i = t*K + k`` is copy k of token t; ``sorted_indices[i]`` is its row in the expert-sorted buffer
    (stable: experts ascending, ties by slot). For every valid slot (``s <= v < e`` with ``v = sorted_indices[i]``)::

        permuted_tokens[v - s] = tokens[i // K]
        permuted_probs[v - s]  = probs.flatten()[i]

    Example (CANN doc): tokens rows ``0.1, 0.2, 0.3`` (H=4), indices ``[[1, 2], [3, 1], [2, 3]]``, probs
    ``[[.5, .3], [.4, .2], [.5, .4]]``, range ``[1, 5)`` -> sorted_indices ``[0, 2, 4, 1, 3, 5]``, permuted_tokens
    rows ``0.2, 0.1, 0.3, 0.2``, permuted_probs ``[.2, .3, .5, .4]``.

    Args:
        tokens: `[T, H]` float32 / float16 / bfloat16 (float64 accepted, e.g. for gradcheck).
        indices: `[T, K]` (or `[T]`, meaning K = 1) int32 / int64 expert ids, ``>= 0``; ``1 <= K <= 512``.
        probs: optional `[T, K]` router weights (shape of indices), any of the four float dtypes.
        range: ``None`` or ``[s, e]``, the permuted rows this rank owns; negative values get ``+N``
            (``N = T*K``), then both are clamped to ``[0, N]``; ``e == s`` is an empty window.
        num_out_tokens: only when ``range`` is None: 0 keeps all N rows, ``n > 0`` the first ``min(n, N)``,
            ``n < 0`` drops ``|n|`` rows from the tail.
        padded_mode: only ``False`` is supported (``True`` raises ``NotImplementedError``).
        num_experts: optional expert count E; when given, every id must be ``< E`` (checked with the other index
            values, before anything is computed).
        backend: ``"auto"`` (triton for CUDA tensors when it imports, else torch), ``"torch"``, ``"triton"``
            or ``"reference"``.
        validate: check index values (``indices >= 0``, ``< num_experts``); skipped when traced by
            ``torch.compile``.

    Returns:
        ``(permuted_tokens, sorted_indices, permuted_probs)``: `[R, H]` tokens.dtype with ``R = e - s``;
        `[N]` int32 (slot -> row, full length); `[R]` probs.dtype or None.
        Differentiable in ``tokens`` and ``probs`` (backward = :func:`moe_token_permute_with_ep_grad`).

    Raises:
        TypeError, ValueError: a bad argument (the message names it, with the expected and actual value).
        NotImplementedError: ``padded_mode=True``.
    """
    tokens, indices, probs, K, s, e = check_permute_args(tokens, indices, probs, range, num_out_tokens, padded_mode,
                                                         validate, num_experts)
    name, auto = _resolve("moe_token_permute_with_ep", backend, tokens, indices, probs)
    if name == "triton" and not torch.compiler.is_compiling():
        mod = _backend.module(FAMILY, name)
        sorted_indices = getattr(mod, "sorted_indices_from", torch_impl.sorted_indices_from)(indices=indices)
    else:  # the reference's Python loop is no better an oracle than a stable argsort
        sorted_indices = torch_impl.sorted_indices_from(indices=indices)
    out, pprobs = _permute_op(tokens, sorted_indices, probs, K, s, e, name, auto)
    return out, sorted_indices, (pprobs if probs is not None else None)


def moe_token_unpermute_with_ep(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    topk_num: int = 1,
    range: RangeLike | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Gather each token's K expert outputs from the window ``[s, e)`` and add them, weighted by ``probs``.

    Without ``range`` the window is ``[0, R)`` with R the rows of ``permuted_tokens``, whatever window the permute
    used: after ``moe_token_permute_with_ep(..., range=[s, e])`` pass the same ``range`` here.

    For every token t, in k order, over valid slots ``i = t*K + k`` (``s <= v < e``, ``v = sorted_indices[i]``)::

        out[t] = sum_k probs[t, k] * permuted_tokens[v - s]      (no probs: plain sum)

    in fp32 (float64 for float64 inputs), rounded once. A term whose prob is exactly 0 is skipped, so an
    inf/NaN in an unused row never leaks; a token with no valid slot gets zeros.

    Example: permuted_tokens rows ``0.2, 0.1, 0.3, 0.2`` (window ``[1, 5)`` of the permute example),
    sorted_indices ``[0, 2, 4, 1, 3, 5]``, probs ``[[.5, .3], [.4, .2], [.5, .4]]`` -> out rows
    ``.3*0.1 = 0.03``, ``.4*0.2 + .2*0.2 = 0.12``, ``.5*0.3 = 0.15`` (slots 0 and 5 are outside the window).

    Args:
        permuted_tokens: `[R, H]` float32 / float16 / bfloat16 / float64, ``R = e - s``.
        sorted_indices: `[N]` int32 / int64 slot -> row map (a permutation of ``[0, N)``), ``N = T*K``.
        probs: optional `[T, K]` weights, any float dtype; when given, ``K = probs.shape[1]``.
        topk_num: K when ``probs`` is None (``1 <= K <= 512``); with probs, 1 (the default) or
            ``probs.shape[1]``: any other value contradicts probs and raises ``ValueError``.
        range: ``None`` (``[0, rows of permuted_tokens)``) or ``[s, e]``, normalised as in
            :func:`moe_token_permute_with_ep`.
        padded_mode: only ``False`` is supported.
        restore_shape: ``None`` or the output shape ``(T, H)`` (checked, otherwise unused).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"``.
        validate: check that ``sorted_indices`` is a permutation; skipped when traced by ``torch.compile``.

    Returns:
        `[T, H]` in permuted_tokens.dtype. Differentiable in ``permuted_tokens`` and ``probs``
        (backward = :func:`moe_token_unpermute_with_ep_grad`).

    Raises:
        TypeError, ValueError: a bad argument (the message names it). NotImplementedError: ``padded_mode=True``.
    """
    permuted_tokens, sorted_indices, probs, K, s, e = check_unpermute_args(
        permuted_tokens, sorted_indices, probs, topk_num, range, padded_mode, restore_shape, validate)
    name, auto = _resolve("moe_token_unpermute_with_ep", backend, permuted_tokens, sorted_indices, probs)
    return _unpermute_op(permuted_tokens, sorted_indices, probs, K, s, e, name, auto)


def moe_token_unpermute_with_ep_grad(
    unpermuted_tokens_grad: torch.Tensor,
    sorted_indices: torch.Tensor,
    permuted_tokens: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
    range: RangeLike | None = None,
    topk_num: int = 1,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of :func:`moe_token_unpermute_with_ep` (CANN ``MoeTokenUnpermuteWithEpGrad``).

    Without ``range`` the window is ``[0, R)`` with R the rows of ``permuted_tokens`` (``[0, N)`` without it),
    whatever window the permute used: pass the forward's ``range``.

    For every valid slot ``i = t*K + k`` (``s <= v < e``, ``v = sorted_indices[i]``)::

        permuted_tokens_grad[v - s] = grad[t] * probs[t, k]                      (no probs: grad[t], exact copy)
        probs_grad[t, k]            = sum_h permuted_tokens[v - s, h] * grad[t, h]

    in fp32 (float64 for float64 inputs), each element rounded once; invalid slots get ``probs_grad = 0``.
    Every output element has one writer (deterministic, no atomics).

    Example (CANN doc): permuted_tokens ``ones(3, 2)``, grad ``ones(1, 2)``, probs ``ones(1, 3)``,
    sorted_indices ``[0, 1, 2]``, no range -> permuted_tokens_grad ``ones(3, 2)``, probs_grad ``[[2, 2, 2]]``.

    Args:
        unpermuted_tokens_grad: `[T, H]` float32 / float16 / bfloat16 / float64.
        sorted_indices: `[N]` int32 / int64 slot -> row map, ``N = T*K``.
        permuted_tokens: `[R, H]` forward input, same dtype as the grad; required when ``probs`` is given.
        probs: optional `[T, K]` forward weights, any float dtype; when given, ``K = probs.shape[1]``.
        padded_mode: only ``False`` is supported.
        restore_shape: ``None`` or ``(T, H)`` (checked, otherwise unused).
        range: ``None`` (``[0, rows of permuted_tokens)``, or ``[0, N)`` without it) or ``[s, e]``.
        topk_num: K when ``probs`` is None (``1 <= K <= 512``); with probs, 1 (the default) or
            ``probs.shape[1]``: any other value contradicts probs and raises ``ValueError``.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"``.
        validate: check that ``sorted_indices`` is a permutation; skipped when traced by ``torch.compile``.

    Returns:
        ``(permuted_tokens_grad, probs_grad)``: `[R, H]` in the grad's dtype; `[T, K]` in probs.dtype, or None
        without probs.

    Raises:
        TypeError, ValueError: a bad argument (the message names it). NotImplementedError: ``padded_mode=True``.
    """
    grad, sorted_indices, permuted_tokens, probs, K, s, e = check_unpermute_grad_args(
        unpermuted_tokens_grad, sorted_indices, permuted_tokens, probs, padded_mode, restore_shape, range, topk_num,
        validate)
    name, auto = _resolve("moe_token_unpermute_with_ep_grad", backend, grad, sorted_indices, permuted_tokens,
                          probs)
    ptg, pg = _unpermute_grad_op(grad, sorted_indices, permuted_tokens, probs, K, s, e, name, auto)
    return ptg, (pg if probs is not None else None)


def moe_token_permute_with_ep_grad(
    permuted_tokens_grad: torch.Tensor,
    sorted_indices: torch.Tensor,
    permuted_probs_grad: torch.Tensor | None = None,
    topk_num: int = 1,
    range: RangeLike | None = None,
    padded_mode: bool = False,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of :func:`moe_token_permute_with_ep`.

    For every token t, in k order, over valid slots ``i = t*K + k`` (``s <= v < e``, ``v = sorted_indices[i]``)::

        tokens_grad[t]   = sum_k permuted_tokens_grad[v - s]        (fp32, rounded once)
        probs_grad[t, k] = permuted_probs_grad[v - s]  if valid, else 0

    Example (CANN doc): permuted_tokens_grad rows ``[2, 2], [1, 1], [3, 3], [2, 2]``, permuted_probs_grad
    ``[.2, .5, .4, .4]``, sorted_indices ``[2, 0, 4, 1, 5, 3]``, topk_num 2, range ``[1, 5)`` -> tokens_grad
    ``[[1, 1], [4, 4], [3, 3]]``, probs_grad ``[[.5, 0], [.4, .2], [0, .4]]``.

    Args:
        permuted_tokens_grad: `[R, H]` float32 / float16 / bfloat16 / float64.
        sorted_indices: `[N]` int32 / int64 slot -> row map, ``N = T*K``.
        permuted_probs_grad: optional `[R]`, any float dtype.
        topk_num: K, ``1 <= K <= 512``.
        range: ``None`` (``[0, rows of permuted_tokens_grad)``) or ``[s, e]``.
        padded_mode: only ``False`` is supported.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"``.
        validate: check that ``sorted_indices`` is a permutation; skipped when traced by ``torch.compile``.

    Returns:
        ``(tokens_grad, probs_grad)``: `[T, H]` in the grad's dtype; `[T, K]` in permuted_probs_grad.dtype, or
        None without it.

    Raises:
        TypeError, ValueError: a bad argument (the message names it). NotImplementedError: ``padded_mode=True``.
    """
    ptg, sorted_indices, ppg, K, s, e = check_permute_grad_args(
        permuted_tokens_grad, sorted_indices, permuted_probs_grad, topk_num, range, padded_mode, validate)
    name, auto = _resolve("moe_token_permute_with_ep_grad", backend, ptg, sorted_indices, ppg)
    tg, pg = _permute_grad_op(ptg, sorted_indices, ppg, K, s, e, name, auto)
    return tg, (pg if ppg is not None else None)
