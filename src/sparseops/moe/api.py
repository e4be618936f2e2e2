"""Public MoE ops: token permute / unpermute with an expert-parallel (EP) row window, and their gradients.

Contract: spec/moe.md (docs/moe.md explains it with pictures). Every public function validates all of its
arguments in this module (``_check_*``, before anything is computed), normalises the window once
(``normalize_range``), picks a backend (``_checks.resolve_backend``) and calls that backend module's function
of docs/internals.md through a ``torch.library`` custom op (namespace ``sparseops``), so that the ops are
differentiable and trace under ``torch.compile(fullgraph=True)`` without graph breaks.

Choices where the spec is silent (see docs/moe.md "Choices"):

- ``padded_mode=True`` raises ``NotImplementedError`` naming ``padded_mode``.
- float64 tokens / probs are accepted (for ``torch.autograd.gradcheck``); math is then float64.
- ``probs`` and ``topk_num`` both given: ``K = probs.shape[1]`` and ``topk_num`` is only type-checked.
- ``indices`` of shape ``[T]`` means K = 1; ``probs`` may then be ``[T]`` or ``[T, 1]``.
- ``range`` is a list / tuple of two ints, or a 1-D integer tensor with two elements (not under
  ``torch.compile``: its values decide the output's row count; a clear ``TypeError`` says so).
- Data-dependent checks (index values, duplicates) run when ``validate=True`` and the call is not being
  traced by ``torch.compile``; shape / dtype checks always run.
"""


from collections.abc import Sequence

import torch

from .. import _autograd, _checks
from .._checks import check_bool, check_int, check_same_device, check_tensor, fmt_shape
from . import reference, torch_impl

#: an EP window: ``[start, end]`` as two ints or a 1-D integer tensor of two elements
RangeLike = Sequence[int] | torch.Tensor
#: CANN's limit on top-k, kept
K_MAX = 512
#: token / prob dtypes of the Python API (float64 is accepted for gradcheck)
TOKEN_DTYPES = (*_checks.FLOAT_DTYPES, torch.float64)

_BACKEND_MODULES: dict = {"torch": torch_impl, "reference": reference}


# ----------------------------------------------------------------------------------------------------------------
# Checks shared by every op and backend
# ----------------------------------------------------------------------------------------------------------------


def normalize_range(range, N: int, natural_end: int) -> tuple[int, int]:
    """The window ``[s, e)`` of spec/moe.md §2.

    Args:
        range: ``None`` or two ints ``[s, e]``.
        N: slots, ``T * K``.
        natural_end: ``e`` when ``range`` is None (already clamped to ``[0, N]`` by the caller's rule).

    Returns:
        ``(s, e)`` with ``0 <= s <= e <= N``. A negative value gets ``+N``, then both are clamped to
        ``[0, N]``; ``e < s`` is an error, ``e == s`` an empty window.
    """
    if range is None:
        return 0, natural_end
    if isinstance(range, torch.Tensor):
        if range.dim() != 1 or range.dtype.is_floating_point or range.dtype == torch.bool:
            raise TypeError(
                f"range: expected two ints (a list, tuple or 1-D integer tensor), got a {range.dim()}-D "
                f"{str(range.dtype).replace('torch.', '')} tensor"
            )
        if torch.compiler.is_compiling():
            raise TypeError(
                "range: expected two Python ints under torch.compile, got a tensor (its values decide the number "
                "of output rows, which a traced graph cannot read); pass range.tolist()"
            )
        range = range.tolist()
    if not isinstance(range, (list, tuple)):
        raise TypeError(f"range: expected None or two ints [start, end], got {type(range).__name__} ({range!r})")
    if len(range) != 2:
        raise ValueError(f"range: expected exactly two ints [start, end], got {len(range)} values {list(range)!r}")
    s = check_int("range[0]", range[0])
    e = check_int("range[1]", range[1])
    s = min(max(s + N if s < 0 else s, 0), N)
    e = min(max(e + N if e < 0 else e, 0), N)
    if e < s:
        raise ValueError(
            f"range: expected start <= end after normalisation (negative + N={N}, clamp to [0, N]), "
            f"got {list(range)!r} -> [{s}, {e})"
        )
    return s, e


def _check_padded_mode(padded_mode) -> None:
    check_bool("padded_mode", padded_mode)
    if padded_mode:
        raise NotImplementedError("padded_mode: only False is supported, got True (CANN documents only False)")


def _check_topk(name: str, K) -> int:
    return check_int(name, K, lo=1, hi=K_MAX)


def _check_float(name: str, t, ndim) -> torch.Tensor:
    return check_tensor(name, t, ndim=ndim, dtypes=TOKEN_DTYPES)


def _check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected the dtype of {ref_name} ({str(ref.dtype).replace('torch.', '')}), "
            f"got {str(t.dtype).replace('torch.', '')}"
        )


def _check_rows(name: str, t: torch.Tensor, R: int, H: int | None, s: int, e: int) -> None:
    if t.shape[0] != R or (H is not None and t.shape[1] != H):
        want = f"[R={R}, H={H}]" if H is not None else f"[R={R}]"
        raise ValueError(f"{name}: expected shape {want} for the window [{s}, {e}), got {fmt_shape(t.shape)}")


def _check_sorted_indices(sorted_indices, T: int, K: int, validate: bool, *, T_from: str) -> int:
    check_tensor("sorted_indices", sorted_indices, ndim=1, dtypes=_checks.INDEX_DTYPES)
    N = sorted_indices.shape[0]
    if T is None:
        if N % K:
            raise ValueError(f"sorted_indices: expected a length that is a multiple of K={K} ({T_from}), got {N}")
    elif N != T * K:
        raise ValueError(f"sorted_indices: expected length T*K={T}*{K}={T * K} ({T_from}), got {N}")
    if _checks.data_checks(validate, sorted_indices):
        lo, hi = int(sorted_indices.min()), int(sorted_indices.max())
        if lo < 0 or hi >= N:
            raise ValueError(f"sorted_indices: expected values in [0, N={N}), got min {lo} and max {hi}")
        counts = torch.bincount(sorted_indices.long(), minlength=N)
        if int(counts.max()) > 1:
            v = int(torch.argmax(counts))
            slots = torch.nonzero(sorted_indices == v).flatten()[:2].tolist()
            raise ValueError(
                f"sorted_indices: expected a permutation of [0, N={N}) (each row once), got row {v} "
                f"{int(counts[v])} times (slots {slots[0]} and {slots[1]})"
            )
    return N


def _check_restore_shape(restore_shape, T: int, H: int) -> None:
    if restore_shape is None:
        return
    if isinstance(restore_shape, torch.Tensor) or not isinstance(restore_shape, (list, tuple, torch.Size)):
        raise TypeError(f"restore_shape: expected None or (T, H), got {type(restore_shape).__name__}")
    got = tuple(restore_shape)
    if len(got) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in got) or got != (T, H):
        raise ValueError(f"restore_shape: expected None or the output shape (T={T}, H={H}), got {got!r}")


def _check_backend(backend, *tensors) -> str:
    device = check_same_device(**{f"arg{i}": t for i, t in enumerate(tensors)})
    name = _checks.resolve_backend(backend, device)
    if name == "triton" and not torch.compiler.is_compiling():
        try:
            _backend_module(name)  # a clear error now rather than an ImportError inside the op
        except ValueError:
            if backend != "auto":
                raise
            return "torch"  # auto never fails for want of the MoE triton module
    return name


def _device_check(**tensors) -> None:
    check_same_device(**tensors)


def check_permute_args(tokens, indices, probs, range, num_out_tokens, padded_mode, validate=True):
    """Validate ``moe_token_permute_with_ep``'s arguments; returns ``(tokens, indices, probs [T, K] or None,
    K, s, e)``."""
    check_bool("validate", validate)
    _check_padded_mode(padded_mode)
    _check_float("tokens", tokens, 2)
    check_tensor("indices", indices, ndim=(1, 2), dtypes=_checks.INDEX_DTYPES)
    T, H = tokens.shape
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected {T} rows (the rows of tokens), got shape {fmt_shape(indices.shape)}")
    K = indices.shape[1] if indices.dim() == 2 else 1
    check_int("indices.shape[1] (K)", K, lo=1, hi=K_MAX)
    if probs is not None:
        _check_float("probs", probs, (1, 2))
        if tuple(probs.shape) != (T, K) and not (indices.dim() == 1 and tuple(probs.shape) == (T,)):
            want = f"[T={T}, K={K}]" + (f" or [T={T}]" if indices.dim() == 1 else "")
            raise ValueError(f"probs: expected shape {want} (the shape of indices), got {fmt_shape(probs.shape)}")
        probs = probs.reshape(T, K)
    _device_check(tokens=tokens, indices=indices, probs=probs)
    num_out_tokens = check_int("num_out_tokens", num_out_tokens)
    N = T * K
    if num_out_tokens == 0:
        natural = N
    elif num_out_tokens > 0:
        natural = min(num_out_tokens, N)
    else:
        natural = max(N + num_out_tokens, 0)
    s, e = normalize_range(range, N, natural)
    if _checks.data_checks(validate, indices):
        lo = int(indices.min())
        if lo < 0:
            raise ValueError(f"indices: expected expert ids >= 0, got min {lo}")
    return tokens, indices, probs, K, s, e


def check_unpermute_args(permuted_tokens, sorted_indices, probs, topk_num, range, padded_mode, restore_shape,
                         validate=True):
    """Validate ``moe_token_unpermute_with_ep``'s arguments; returns ``(permuted_tokens, sorted_indices, probs,
    K, s, e)``."""
    check_bool("validate", validate)
    _check_padded_mode(padded_mode)
    _check_float("permuted_tokens", permuted_tokens, 2)
    topk_num = _check_topk("topk_num", topk_num)
    if probs is not None:
        _check_float("probs", probs, 2)
        T, K = probs.shape
        check_int("probs.shape[1] (K)", K, lo=1, hi=K_MAX)
        N = _check_sorted_indices(sorted_indices, T, K, validate, T_from="T, K from probs")
    else:
        K = topk_num
        N = _check_sorted_indices(sorted_indices, None, K, validate, T_from="K = topk_num")
        T = N // K
    H = permuted_tokens.shape[1]
    _device_check(permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, probs=probs)
    s, e = normalize_range(range, N, min(permuted_tokens.shape[0], N))
    _check_rows("permuted_tokens", permuted_tokens, e - s, H, s, e)
    _check_restore_shape(restore_shape, T, H)
    return permuted_tokens, sorted_indices, probs, K, s, e


def check_unpermute_grad_args(unpermuted_tokens_grad, sorted_indices, permuted_tokens, probs, padded_mode,
                              restore_shape, range, topk_num, validate=True):
    """Validate ``moe_token_unpermute_with_ep_grad``'s arguments; returns ``(grad, sorted_indices,
    permuted_tokens or None, probs or None, K, s, e)`` (permuted_tokens is None exactly when probs is)."""
    check_bool("validate", validate)
    _check_padded_mode(padded_mode)
    grad = _check_float("unpermuted_tokens_grad", unpermuted_tokens_grad, 2)
    T, H = grad.shape
    topk_num = _check_topk("topk_num", topk_num)
    K = topk_num
    if probs is not None:
        _check_float("probs", probs, 2)
        K = check_int("probs.shape[1] (K)", probs.shape[1], lo=1, hi=K_MAX)
        if probs.shape[0] != T:
            raise ValueError(f"probs: expected shape [T={T}, K] (T from unpermuted_tokens_grad), got {fmt_shape(probs.shape)}")
        if permuted_tokens is None:
            raise ValueError("permuted_tokens: expected a [R, H] tensor when probs is given (needed for probs_grad), got None")
    if permuted_tokens is not None:
        _check_float("permuted_tokens", permuted_tokens, 2)
        _check_same_dtype("permuted_tokens", permuted_tokens, "unpermuted_tokens_grad", grad)
    N = _check_sorted_indices(sorted_indices, T, K, validate,
                              T_from="T from unpermuted_tokens_grad, K from " + ("probs" if probs is not None else "topk_num"))
    _device_check(unpermuted_tokens_grad=grad, sorted_indices=sorted_indices, permuted_tokens=permuted_tokens,
                  probs=probs)
    s, e = normalize_range(range, N, N if permuted_tokens is None else min(permuted_tokens.shape[0], N))
    if permuted_tokens is not None:
        _check_rows("permuted_tokens", permuted_tokens, e - s, H, s, e)
    _check_restore_shape(restore_shape, T, H)
    return grad, sorted_indices, (permuted_tokens if probs is not None else None), probs, K, s, e


def check_permute_grad_args(permuted_tokens_grad, sorted_indices, permuted_probs_grad, topk_num, range, padded_mode,
                            validate=True):
    """Validate ``moe_token_permute_with_ep_grad``'s arguments; returns ``(ptg, sorted_indices, permuted_probs_grad,
    K, s, e)``."""
    check_bool("validate", validate)
    _check_padded_mode(padded_mode)
    ptg = _check_float("permuted_tokens_grad", permuted_tokens_grad, 2)
    K = _check_topk("topk_num", topk_num)
    N = _check_sorted_indices(sorted_indices, None, K, validate, T_from="K = topk_num")
    if permuted_probs_grad is not None:
        _check_float("permuted_probs_grad", permuted_probs_grad, 1)
    _device_check(permuted_tokens_grad=ptg, sorted_indices=sorted_indices, permuted_probs_grad=permuted_probs_grad)
    s, e = normalize_range(range, N, min(ptg.shape[0], N))
    _check_rows("permuted_tokens_grad", ptg, e - s, ptg.shape[1], s, e)
    if permuted_probs_grad is not None:
        _check_rows("permuted_probs_grad", permuted_probs_grad, e - s, None, s, e)
    return ptg, sorted_indices, permuted_probs_grad, K, s, e


# ----------------------------------------------------------------------------------------------------------------
# Backends behind torch.library custom ops (custom ops cannot return None: an empty tensor stands for it)
# ----------------------------------------------------------------------------------------------------------------


def _backend_module(name: str):
    mod = _BACKEND_MODULES.get(name)
    if mod is not None:
        return mod
    if name == "triton":
        try:
            from . import triton_impl as mod
        except ImportError as exc:
            raise ValueError(
                f"backend: 'triton' MoE kernels are not available ({type(exc).__name__}: {exc}); "
                f"use backend='torch' or 'auto'"
            ) from exc
        missing = [f for f in ("permute", "unpermute", "unpermute_grad", "permute_grad") if not hasattr(mod, f)]
        if missing:
            raise ValueError(f"backend: 'triton' MoE backend lacks {missing}; use backend='torch' or 'auto'")
    _BACKEND_MODULES[name] = mod
    return mod


def _none_to_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _fresh(out: torch.Tensor, *inputs) -> torch.Tensor:
    """A custom op may not return (a view of) an input."""
    ptr = out.untyped_storage().data_ptr()
    if out.numel() and any(t is not None and t.numel() and t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out


@torch.library.custom_op("sparseops::moe_permute", mutates_args=())
def _permute_op(tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None, K: int, s: int,
                e: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, pprobs = _backend_module(backend).permute(tokens, sorted_indices, probs, K, s, e)
    return _fresh(out, tokens), _none_to_empty(_fresh(pprobs, probs) if pprobs is not None else None, tokens)


@_permute_op.register_fake
def _(tokens, sorted_indices, probs, K, s, e, backend):
    pprobs = tokens.new_empty(0) if probs is None else probs.new_empty(e - s)
    return tokens.new_empty(e - s, tokens.shape[1]), pprobs


@torch.library.custom_op("sparseops::moe_unpermute", mutates_args=())
def _unpermute_op(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None, K: int,
                  s: int, e: int, backend: str) -> torch.Tensor:
    out = _backend_module(backend).unpermute(permuted_tokens, sorted_indices, probs, K, s, e)
    return _fresh(out, permuted_tokens)


@_unpermute_op.register_fake
def _(permuted_tokens, sorted_indices, probs, K, s, e, backend):
    return permuted_tokens.new_empty(sorted_indices.shape[0] // K, permuted_tokens.shape[1])


@torch.library.custom_op("sparseops::moe_unpermute_grad", mutates_args=())
def _unpermute_grad_op(grad: torch.Tensor, sorted_indices: torch.Tensor, permuted_tokens: torch.Tensor | None,
                       probs: torch.Tensor | None, K: int, s: int, e: int,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    ptg, pg = _backend_module(backend).unpermute_grad(grad, sorted_indices, permuted_tokens, probs, K, s, e)
    return _fresh(ptg, grad), _none_to_empty(pg, grad)


@_unpermute_grad_op.register_fake
def _(grad, sorted_indices, permuted_tokens, probs, K, s, e, backend):
    pg = grad.new_empty(0) if probs is None else probs.new_empty(grad.shape[0], K)
    return grad.new_empty(e - s, grad.shape[1]), pg


@torch.library.custom_op("sparseops::moe_permute_grad", mutates_args=())
def _permute_grad_op(permuted_tokens_grad: torch.Tensor, sorted_indices: torch.Tensor,
                     permuted_probs_grad: torch.Tensor | None, K: int, s: int, e: int,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    tg, pg = _backend_module(backend).permute_grad(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e)
    return _fresh(tg, permuted_tokens_grad), _none_to_empty(pg, permuted_tokens_grad)


@_permute_grad_op.register_fake
def _(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e, backend):
    T = sorted_indices.shape[0] // K
    pg = permuted_tokens_grad.new_empty(0) if permuted_probs_grad is None else permuted_probs_grad.new_empty(T, K)
    return permuted_tokens_grad.new_empty(T, permuted_tokens_grad.shape[1]), pg


_autograd.register(_unpermute_grad_op, "moe_token_unpermute_with_ep_grad")
_autograd.register(_permute_grad_op, "moe_token_permute_with_ep_grad")


def _permute_setup_context(ctx, inputs, output):
    tokens, sorted_indices, probs, K, s, e, backend = inputs
    ctx.save_for_backward(sorted_indices)
    ctx.args = (K, s, e, backend)
    ctx.has_probs = probs is not None


def _permute_backward(ctx, grad_out, grad_pprobs):
    (sorted_indices,) = ctx.saved_tensors
    pprobs_grad = grad_pprobs if ctx.has_probs else None
    tg, pg = _permute_grad_op(grad_out, sorted_indices, pprobs_grad, *ctx.args)
    return tg, None, (pg if ctx.has_probs else None), None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup_context)


def _unpermute_setup_context(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, K, s, e, backend = inputs
    ctx.has_probs = probs is not None
    if ctx.has_probs:
        ctx.save_for_backward(sorted_indices, permuted_tokens, probs)
    else:
        ctx.save_for_backward(sorted_indices)
    ctx.args = (K, s, e, backend)


def _unpermute_backward(ctx, grad_out):
    if ctx.has_probs:
        sorted_indices, permuted_tokens, probs = ctx.saved_tensors
    else:
        (sorted_indices,) = ctx.saved_tensors
        permuted_tokens = probs = None
    ptg, pg = _unpermute_grad_op(grad_out, sorted_indices, permuted_tokens, probs, *ctx.args)
    return ptg, None, (pg if ctx.has_probs else None), None, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------------------


def moe_token_permute_with_ep(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    range: RangeLike | None = None,
    num_out_tokens: int = 0,
    padded_mode: bool = False,
    *,
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
        backend: ``"auto"`` (triton for CUDA tensors when it imports, else torch), ``"torch"``, ``"triton"``
            or ``"reference"``.
        validate: check index values (``indices >= 0``); skipped when traced by ``torch.compile``.

    Returns:
        ``(permuted_tokens, sorted_indices, permuted_probs)``: `[R, H]` tokens.dtype with ``R = e - s``;
        `[N]` int32 (slot -> row, full length); `[R]` probs.dtype or None.
        Differentiable in ``tokens`` and ``probs`` (backward = :func:`moe_token_permute_with_ep_grad`).

    Raises:
        TypeError, ValueError: a bad argument (the message names it, with the expected and actual value).
        NotImplementedError: ``padded_mode=True``.
    """
    tokens, indices, probs, K, s, e = check_permute_args(tokens, indices, probs, range, num_out_tokens, padded_mode,
                                                         validate)
    name = _check_backend(backend, tokens, indices, probs)
    if name == "triton" and not torch.compiler.is_compiling():
        sorted_indices = getattr(_backend_module(name), "sorted_indices_from", torch_impl.sorted_indices_from)(indices)
    else:  # the reference's Python loop is no better an oracle than a stable argsort
        sorted_indices = torch_impl.sorted_indices_from(indices)
    out, pprobs = _permute_op(tokens, sorted_indices, probs, K, s, e, name)
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
        topk_num: K when ``probs`` is None (``1 <= K <= 512``); ignored (but type-checked) otherwise.
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
    name = _check_backend(backend, permuted_tokens, sorted_indices, probs)
    return _unpermute_op(permuted_tokens, sorted_indices, probs, K, s, e, name)


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
        topk_num: K when ``probs`` is None (``1 <= K <= 512``).
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
    name = _check_backend(backend, grad, sorted_indices, permuted_tokens, probs)
    ptg, pg = _unpermute_grad_op(grad, sorted_indices, permuted_tokens, probs, K, s, e, name)
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
    name = _check_backend(backend, ptg, sorted_indices, ppg)
    tg, pg = _permute_grad_op(ptg, sorted_indices, ppg, K, s, e, name)
    return tg, (pg if ppg is not None else None)
