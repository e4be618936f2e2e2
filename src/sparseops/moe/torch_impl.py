"""Vectorized PyTorch MoE permute / unpermute: the CPU path and the fallback on every device.

Same signatures as ``reference.py`` (docs/internals.md); arguments arrive validated and normalised.
Two index maps drive everything, both built once per call in O(N) integer work:

- row -> slot (``_row_slots``): the inverse permutation restricted to the window, so that every output row
  of ``permute`` / ``unpermute_grad`` is one gather (``index_select``) with exactly one writer;
- token -> row (``_token_rows``): ``sorted_indices.view(T, K) - s`` with -1 for slots outside the window,
  so that ``unpermute`` / ``permute_grad`` gather K rows per token and add them in k order.

Work is chunked over rows or tokens so that temporaries (gathered rows, fp32 upcasts of fp16/bf16) stay
cache-sized; there is no Python loop over tokens or slots (the loops run over chunks and over k).
Math is fp32 (float64 for float64 inputs); every output element is rounded once; no atomics.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import sys

import torch

from .. import _compile
from .._numerics import acc_dtype as _acc_rule
from .._settings import Settings
from . import workspace


@dataclasses.dataclass(frozen=True)
class MoeTorchSettings:
    """Tuning knobs of the MoE torch backend (read per call through :data:`SETTINGS`)."""

    #: bytes of one chunk's gathered rows (fp32 upcast size for fp16 / bf16): small enough to stay in a core's L2
    chunk_bytes: int = 1 << 18
    #: unpermute_grad's fp32 / float64 path (3 ops per chunk, no upcast buffers) takes chunks this many times
    #: larger (a core's L2): fewer ops, each an OpenMP parallel region ending in a barrier; the fp16 / bf16 path
    #: gains nothing from it and keeps ``chunk_bytes``
    big_chunk_factor: int = 16
    #: the k-ordered sums (unpermute, permute_grad) gather only live rows when fewer than this share of slots
    #: is live (an expert-parallel rank's window); else they walk all K slots of every token
    sparse_fraction: float = 0.5
    #: fresh CPU outputs at least this large are advised to use transparent huge pages (see ``_empty_rows``)
    huge_min_bytes: int = 4 << 20
    #: the compiled kernels (``_compile``) are taken from this many output elements (``R * H`` for the seed op,
    #: ``T * H`` for the k-ordered sums); below it the eager ops are about as fast and no compile is worth its
    #: seconds
    compiled_min_elements: int = 1 << 16
    #: the k-ordered sums take their compiled kernel up to this K (the loop over k is unrolled in the kernel)
    compiled_max_k: int = 16
    #: the alignment of the huge-page advice: the OS page size
    page_bytes: int = 4096
    #: CPU buffers of ``huge_min_bytes`` or more are recycled through ``moe.workspace.POOL``, which holds at most
    #: this many bytes of blocks (0: every buffer fresh)
    pool_bytes: int = 4 << 30


#: the knobs in force; tests and tuning scripts change them with ``SETTINGS.override(...)``
SETTINGS = Settings(MoeTorchSettings())

_MADV_HUGEPAGE = 14


def _load_madvise():
    """libc ``madvise`` on Linux, else None. ``SPARSEOPS_MOE_HUGEPAGES=0`` turns the advice off."""
    if not sys.platform.startswith("linux") or os.environ.get("SPARSEOPS_MOE_HUGEPAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


#: libc ``madvise``, looked up on first use (no work at import time); None where unavailable
_UNSET = object()
_madvise = _UNSET


def _empty_rows(n: int, H: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(n, H)``; on CPU, a large one is a recycled block of ``workspace.POOL`` when one is free.

    A fresh large CPU tensor is a new ``mmap``: the kernel zeroes each page at its first touch, which costs
    about as much as the copy itself, every step again. The pool's blocks are faulted in once. A new large
    block (pooled or not) is first advised ``MADV_HUGEPAGE`` on Linux, so it faults once per 2 MiB instead of
    per 4 KiB (honoured when transparent huge pages are in ``madvise`` or ``always`` mode). Neither changes
    a value: contents are undefined, as from ``torch.empty``; any failure of the advice is ignored.
    """
    knobs = SETTINGS.get()
    device = torch.device(device)
    nbytes = n * H * dtype.itemsize
    if device.type != "cpu" or nbytes < knobs.huge_min_bytes:
        return torch.empty(n, H, dtype=dtype, device=device)
    if knobs.pool_bytes > 0:
        block = workspace.POOL.take(nbytes, knobs.pool_bytes, lambda size: _advised(torch.empty(size, dtype=torch.uint8)))
        if block is not None:  # on the block's storage, not a view of the block (the pool counts storage uses)
            return torch.empty(0, dtype=dtype).set_(block.untyped_storage(), 0, (n, H))
    return _advised(torch.empty(n, H, dtype=dtype, device=device))


def _advised(out: torch.Tensor) -> torch.Tensor:
    """``out`` (a fresh CPU tensor) after advising its pages ``MADV_HUGEPAGE``."""
    global _madvise
    if _madvise is _UNSET:
        _madvise = _load_madvise()
    if _madvise is not None:
        page = SETTINGS.get().page_bytes
        p, nbytes = out.data_ptr(), out.numel() * out.element_size()
        a = (p + page - 1) & ~(page - 1)
        length = (p + nbytes - a) & ~(page - 1)
        if length > 0:
            _madvise(a, length, _MADV_HUGEPAGE)
    return out


_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fusable(src: torch.Tensor, acc_dtype: torch.dtype, sizes: tuple[int, ...], out_elements: int) -> bool:
    """Whether a compiled kernel may take the call: CPU, fp32 accumulation, a compiled dtype, no size below 2
    (inductor would specialise on 0 and 1) and at least ``compiled_min_elements`` output elements."""
    return (
        src.device.type == "cpu"
        and acc_dtype == torch.float32
        and src.dtype in _COMPILED_DTYPES
        and min(sizes) >= 2
        and out_elements >= SETTINGS.get().compiled_min_elements
    )


@_compile.kernel("moe_unpermute_grad")
def _unpermute_grad_fused(grad, tok, permuted_tokens, scale, ptg, dots):
    """One pass over the window's rows: ``ptg[r] = grad[tok[r]] * scale[r]`` (fp32 math, rounded once) and
    ``dots[r] = <grad[tok[r]], permuted_tokens[r]>`` (fp32)."""
    g = grad.index_select(0, tok).float()
    ptg.copy_(g * scale.float()[:, None])
    dots.copy_((g * permuted_tokens.float()).sum(-1))


@_compile.kernel("moe_sum_over_k")
def _sum_over_k_fused(src, rows, w, out):
    """``out[t] = sum_k w[t, k] * src[rows[t, k]]`` over the slots with ``w != 0``, k ascending, in fp32, rounded
    once: one pass over ``[T, H]`` that reads each token's K rows (the k loop is unrolled)."""
    acc = None
    for k in range(rows.shape[1]):
        wk = w[:, k, None]
        # a dead slot (w = 0) may point at a row holding inf / NaN: select, never multiply it
        term = torch.where(wk != 0, src.index_select(0, rows[:, k]).float() * wk, 0.0)
        acc = term if acc is None else acc + term
    out.copy_(acc)


def _chunk_rows(H: int, itemsize: int, factor: int = 1) -> int:
    return max(16, SETTINGS.get().chunk_bytes * factor // max(1, H * itemsize))


def sorted_indices_from(indices: torch.Tensor) -> torch.Tensor:
    """slot -> row as int32: the inverse of the stable argsort of ``indices.flatten()``."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # row -> slot
    out = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    return out.scatter_(0, order, torch.arange(flat.numel(), dtype=torch.int32, device=flat.device))


def _row_slots(sorted_indices: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """``[e - s]`` int64: the slot that row ``s + r`` holds (every row of the window has exactly one)."""
    N = sorted_indices.numel()
    inv = torch.empty(N, dtype=torch.int64, device=sorted_indices.device)
    inv.scatter_(0, sorted_indices.long(), torch.arange(N, dtype=torch.int64, device=sorted_indices.device))
    return inv[s:e]


def _token_rows(sorted_indices: torch.Tensor, K: int, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T, K]`` local row of each slot, clamped to 0 when invalid, ``[T, K]`` bool validity mask)."""
    rows = sorted_indices.reshape(-1, K).long() - s
    valid = (rows >= 0) & (rows < e - s)
    return rows.masked_fill(~valid, 0), valid


def permute(tokens, sorted_indices, probs, K, s, e):
    """``permuted_tokens[v - s] = tokens[i // K]``, ``permuted_probs[v - s] = probs.flatten()[i]``."""
    slots = _row_slots(sorted_indices, s, e)
    out = _empty_rows(slots.numel(), tokens.shape[1], tokens.dtype, tokens.device)
    torch.index_select(tokens, 0, torch.div(slots, K, rounding_mode="floor"), out=out)
    pprobs = None if probs is None else probs.reshape(-1).index_select(0, slots)
    return out, pprobs


def _sum_over_k(src, rows, valid, weights, out):
    """``out[t] = sum_k weights[t, k] * src[rows[t, k]]`` over valid slots (weight 0 skipped), k ascending, in
    the accumulation dtype (each product rounded, then added: the compiled kernel's arithmetic, so the eager
    and compiled paths agree bitwise), rounded once into ``out``. ``weights`` None means plain sum."""
    T, K = rows.shape
    H = src.shape[1]
    acc_dtype = _acc_rule(src, weights)
    direct = out.dtype == acc_dtype  # accumulate straight into the output
    if weights is not None:
        valid = valid & (weights != 0)
        # a dead slot's prob (another rank's row) may be inf / NaN: zero it, never multiply it
        weights = torch.where(valid, weights.to(acc_dtype), 0.0)
    if K <= SETTINGS.get().compiled_max_k and _fusable(src, acc_dtype, (T, H, src.shape[0]), T * H):
        w = valid.to(acc_dtype) if weights is None else weights
        if _sum_over_k_fused(src, rows, w, out):
            return out
    step = _chunk_rows(H, 4 if acc_dtype == torch.float32 else 8)
    if T * K and int(valid.sum()) < SETTINGS.get().sparse_fraction * T * K:
        return _sum_over_live_slots(src, rows, valid, weights, out, acc_dtype, step)
    buf = None
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        acc = out[t0:t1] if direct else torch.empty(t1 - t0, H, dtype=acc_dtype, device=src.device)
        if buf is None or buf.shape[0] != t1 - t0:
            buf = torch.empty(t1 - t0, H, dtype=src.dtype, device=src.device)
        acc.zero_()
        for k in range(K):
            v = valid[t0:t1, k]
            n_valid = int(v.sum())
            if n_valid == 0:
                continue
            torch.index_select(src, 0, rows[t0:t1, k], out=buf)
            if n_valid != t1 - t0:
                buf.masked_fill_(~v[:, None], 0)  # an unused row may hold inf/NaN: never multiply it
            term = buf if buf.dtype == acc_dtype else buf.to(acc_dtype)
            if weights is not None:
                # the product rounded, then added (no fused multiply-add): the compiled kernel's arithmetic,
                # so a token's sum does not depend on which path its call's size picks
                term.mul_(weights[t0:t1, k, None])
            acc.add_(term)
        if not direct:
            out[t0:t1].copy_(acc)
    return out


def _sum_over_live_slots(src, rows, valid, weights, out, acc_dtype, step):
    """``_sum_over_k`` for a sparse window (most slots dead, as on an expert-parallel rank): gathers only the
    live rows. Tokens are ordered by their live-slot count, descending, so that the j-th live slot of every
    token that has one is a prefix of each chunk; pass j adds those rows, so each token still sums its terms
    in k order, in the accumulation dtype, rounded once. Dead tokens get zeros."""
    T, K = rows.shape
    H = src.shape[1]
    count = valid.sum(dim=1)
    order = torch.argsort(count, descending=True, stable=True)
    n_live = int((count > 0).sum())
    out.zero_()
    if n_live == 0:
        return out
    order = order[:n_live]
    count = count[order]
    # k of the j-th live slot of each token: live slots in k order, packed to the left
    rank = valid.cumsum(dim=1) - 1
    t_idx, k_idx = valid.nonzero(as_tuple=True)
    k_of = torch.zeros(T, int(count[0]), dtype=torch.int64, device=rows.device)
    k_of[t_idx, rank[t_idx, k_idx]] = k_idx
    k_of = k_of[order]
    live_rows = rows[order].gather(1, k_of)
    live_w = None if weights is None else weights[order].gather(1, k_of)
    for t0 in range(0, n_live, step):
        t1 = min(n_live, t0 + step)
        acc = torch.zeros(t1 - t0, H, dtype=acc_dtype, device=src.device)
        for j in range(int(count[t0])):
            n = t0 + int((count[t0:t1] > j).sum())  # tokens t0..n-1 have a j-th live slot
            term = torch.index_select(src, 0, live_rows[t0:n, j])
            term = term if term.dtype == acc_dtype else term.to(acc_dtype)
            if live_w is not None:
                term.mul_(live_w[t0:n, j, None])  # product rounded, then added: see _sum_over_k
            acc[: n - t0].add_(term)
        out.index_copy_(0, order[t0:t1], acc.to(out.dtype))
    return out


def unpermute(permuted_tokens, sorted_indices, probs, K, s, e):
    """``out[t] = sum_k probs[t, k] * permuted_tokens[v - s]`` over valid slots, k ascending; prob == 0 skipped."""
    T, H = sorted_indices.numel() // K, permuted_tokens.shape[1]
    out = _empty_rows(T, H, permuted_tokens.dtype, permuted_tokens.device)
    if T == 0 or H == 0:
        return out.zero_()
    rows, valid = _token_rows(sorted_indices, K, s, e)
    return _sum_over_k(permuted_tokens, rows, valid, probs, out)


def unpermute_grad(grad, sorted_indices, permuted_tokens, probs, K, s, e):
    """The seed op. With probs: ``ptg[v - s] = grad[t] * probs[t, k]`` and
    ``probs_grad[t, k] = <permuted_tokens[v - s], grad[t]>`` (0 for invalid slots); without: a row copy."""
    T, H = grad.shape
    N = sorted_indices.numel()
    slots = _row_slots(sorted_indices, s, e)
    tok = torch.div(slots, K, rounding_mode="floor")
    R = e - s
    if probs is None:
        return torch.index_select(grad, 0, tok, out=_empty_rows(R, H, grad.dtype, grad.device)), None
    acc_dtype = _acc_rule(grad, permuted_tokens, probs)
    ptg = _empty_rows(R, H, grad.dtype, grad.device)
    row_probs = probs.reshape(-1).index_select(0, slots)
    if grad.dtype == probs.dtype or acc_dtype == torch.float64:
        scale = row_probs.to(grad.dtype) if grad.dtype == torch.float64 else row_probs
    else:
        scale = row_probs.to(acc_dtype)  # mixed dtypes: multiply in fp32, round once into ptg
    dots = torch.empty(R, dtype=acc_dtype, device=grad.device)
    step = _chunk_rows(H, 4 if acc_dtype == torch.float32 else 8)
    fusable = grad.dtype == permuted_tokens.dtype and _fusable(grad, acc_dtype, (T, H, R), R * H)
    if fusable and _unpermute_grad_fused(grad, tok, permuted_tokens, scale, ptg, dots):
        pass
    elif grad.dtype == acc_dtype and permuted_tokens.dtype == acc_dtype:
        step = _chunk_rows(H, 4 if acc_dtype == torch.float32 else 8, SETTINGS.get().big_chunk_factor)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            g = ptg[r0:r1]
            torch.index_select(grad, 0, tok[r0:r1], out=g)  # grad rows land in the output, then scale in place
            torch.linalg.vecdot(permuted_tokens[r0:r1], g, out=dots[r0:r1])
            g.mul_(scale[r0:r1, None])
    else:  # fp16 / bf16: rows gathered in their dtype, dots from fp32 copies held in two cache-sized buffers
        a = torch.empty(step, H, dtype=acc_dtype, device=grad.device)
        b = torch.empty(step, H, dtype=acc_dtype, device=grad.device)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            g = ptg[r0:r1]
            torch.index_select(grad, 0, tok[r0:r1], out=g)
            ac, bc = a[: r1 - r0], b[: r1 - r0]
            ac.copy_(permuted_tokens[r0:r1])
            bc.copy_(g)
            torch.linalg.vecdot(ac, bc, out=dots[r0:r1])
            g.mul_(scale[r0:r1, None])  # computed in fp32, rounded once
    pg = torch.zeros(N, dtype=probs.dtype, device=grad.device)
    pg.index_copy_(0, slots, dots.to(probs.dtype))
    return ptg, pg.view(T, K)


def permute_grad(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e):
    """``tokens_grad[t] = sum_k ptg[v - s]`` over valid slots; ``probs_grad[t, k] = permuted_probs_grad[v - s]`` or 0."""
    N = sorted_indices.numel()
    T, H = N // K, permuted_tokens_grad.shape[1]
    rows, valid = _token_rows(sorted_indices, K, s, e)
    tg = _empty_rows(T, H, permuted_tokens_grad.dtype, permuted_tokens_grad.device)
    if T and H:
        _sum_over_k(permuted_tokens_grad, rows, valid, None, tg)
    else:
        tg.zero_()
    pg = None
    if permuted_probs_grad is not None:
        if e > s:
            pg = permuted_probs_grad.index_select(0, rows.reshape(-1)).view(T, K)
            pg = pg.masked_fill(~valid, 0)
        else:
            pg = torch.zeros(T, K, dtype=permuted_probs_grad.dtype, device=permuted_probs_grad.device)
    return tg, pg
