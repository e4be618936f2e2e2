"""Argument checks of the MoE ops, shared by the Python API (:mod:`.api`) and the CANN layer (``aclnn``).

Each ``check_*_args`` validates every argument of one public op before anything is computed and returns the
normalised values the backends take; messages name the argument, the expected and the actual value. The window
rule (:func:`normalize_range`) and the shapes are those of docs/moe.md. Data-dependent checks (index values,
duplicates) run when ``validate=True`` and the call is not being traced by ``torch.compile``; shape / dtype
checks always run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _checks
from .._checks import check_bool, check_int, check_same_device, check_tensor, fmt_shape

#: an EP window: ``[start, end]`` as two ints or a 1-D integer tensor of two elements
RangeLike = Sequence[int] | torch.Tensor
#: CANN's limit on top-k, kept
K_MAX = 512
#: token / prob dtypes of the Python API (float64 is accepted for gradcheck)
TOKEN_DTYPES = (*_checks.FLOAT_DTYPES, torch.float64)


def normalize_range(range, N: int, natural_end: int) -> tuple[int, int]:
    """The window ``[s, e)`` of an EP rank (docs/moe.md).

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


def _topk_of(topk_num: int, probs_k: int | None) -> int:
    """K from ``topk_num`` and, when probs are given, their ``K = probs.shape[1]``. With probs, ``topk_num`` 1 (the
    default, and what CANN's own example passes) defers to probs; any other value must equal it: a different one
    is a contradiction, not a choice."""
    if probs_k is None:
        return topk_num
    if topk_num not in (1, probs_k):
        raise ValueError(
            f"topk_num: expected 1 (the default) or K = probs.shape[1] = {probs_k} (the top-k of probs), "
            f"got {topk_num}"
        )
    return probs_k


def check_num_experts(indices: torch.Tensor, num_experts, validate: bool) -> int | None:
    """``num_experts``: None or an int ``>= 1``; when given, every expert id of ``indices`` is below it."""
    if num_experts is None:
        return None
    num_experts = check_int("num_experts", num_experts, lo=1)
    if _checks.data_checks(validate, indices):
        hi = int(indices.max())
        if hi >= num_experts:
            bad = torch.nonzero(indices.reshape(indices.shape[0], -1) == hi)[0].tolist()
            raise ValueError(
                f"indices: expected expert ids < num_experts = {num_experts}, got {hi} at {bad}"
            )
    return num_experts


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


def check_permute_args(tokens, indices, probs, range, num_out_tokens, padded_mode, validate=True, num_experts=None):
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
    check_same_device(tokens=tokens, indices=indices, probs=probs)
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
    check_num_experts(indices, num_experts, validate)
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
        _topk_of(topk_num, K)
        N = _check_sorted_indices(sorted_indices, T, K, validate, T_from="T, K from probs")
    else:
        K = _topk_of(topk_num, None)
        N = _check_sorted_indices(sorted_indices, None, K, validate, T_from="K = topk_num")
        T = N // K
    H = permuted_tokens.shape[1]
    check_same_device(permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, probs=probs)
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
    K = topk_num = _check_topk("topk_num", topk_num)
    if probs is not None:
        _check_float("probs", probs, 2)
        K = check_int("probs.shape[1] (K)", probs.shape[1], lo=1, hi=K_MAX)
        _topk_of(topk_num, K)
        if probs.shape[0] != T:
            raise ValueError(f"probs: expected shape [T={T}, K] (T from unpermuted_tokens_grad), got {fmt_shape(probs.shape)}")
        if permuted_tokens is None:
            raise ValueError("permuted_tokens: expected a [R, H] tensor when probs is given (needed for probs_grad), got None")
    if permuted_tokens is not None:
        _check_float("permuted_tokens", permuted_tokens, 2)
        _check_same_dtype("permuted_tokens", permuted_tokens, "unpermuted_tokens_grad", grad)
    N = _check_sorted_indices(sorted_indices, T, K, validate,
                              T_from="T from unpermuted_tokens_grad, K from " + ("probs" if probs is not None else "topk_num"))
    check_same_device(unpermuted_tokens_grad=grad, sorted_indices=sorted_indices, permuted_tokens=permuted_tokens,
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
    check_same_device(permuted_tokens_grad=ptg, sorted_indices=sorted_indices, permuted_probs_grad=permuted_probs_grad)
    s, e = normalize_range(range, N, min(ptg.shape[0], N))
    _check_rows("permuted_tokens_grad", ptg, e - s, ptg.shape[1], s, e)
    if permuted_probs_grad is not None:
        _check_rows("permuted_probs_grad", permuted_probs_grad, e - s, None, s, e)
    return ptg, sorted_indices, permuted_probs_grad, K, s, e
