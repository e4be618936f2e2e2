"""Triton launchers for the MoE ops, with the backend signatures of docs/internals.md.

Arguments arrive validated and normalised (window ``[s, e)``, top-k ``K``, full ``[N]`` slot -> row map that
is a permutation of ``[0, N)``). One program per token (times an H chunk where nothing reduces over H); see
``triton_kernels.py`` and docs/moe.md (GPU section). Every kernel is launched through ``_triton.launch`` with its
arguments by name.

Outputs are allocated with ``torch.empty`` and need no zero-fill: because ``sorted_indices`` is a
permutation, each row ``r`` of a ``[R, H]`` output is ``v - s`` for exactly one slot with ``v = r + s``, and
that slot is live, so its owning program writes the row; ``[T, ...]`` outputs are written by their token's
program(s) for every ``h`` and ``k`` (zeros where no slot is live). Empty windows (``R = 0``), ``T = 0`` and
``H = 0`` never launch.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _triton
from .._settings import Settings
from .triton_kernels import moe_permute_kernel, moe_unpermute_grad_kernel, moe_unpermute_kernel


@dataclasses.dataclass(frozen=True)
class MoeTritonSettings:
    """Tuning knobs of the MoE Triton backend (``SETTINGS.get()`` reads them, ``SETTINGS.override`` swaps them):
    per op, a launch configuration ``(BLOCK_K, BLOCK_J, BLOCK_H, num_warps)`` that replaces the one ``_tile``
    chooses (None: ``_tile``'s), for tuning sweeps (``benchmarks/gpu_moe.py --tune``) and tests."""

    permute_tile: tuple[int, int, int, int] | None = None
    unpermute_tile: tuple[int, int, int, int] | None = None
    unpermute_grad_tile: tuple[int, int, int, int] | None = None
    permute_grad_tile: tuple[int, int, int, int] | None = None


SETTINGS = Settings(MoeTritonSettings())


def _acc(*ts) -> tl.dtype:
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else tl.float32


def _tile(name: str, H: int, K: int, N: int, R: int, elem: int, slot_tile: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_K, BLOCK_J, BLOCK_H, num_warps)``: ``BLOCK_K`` slots are ranked at once, ``BLOCK_J`` live ones move
    together (``SETTINGS``' ``<name>_tile`` where set).

    Slot-tile kernels (``unpermute_grad``, ``permute``) hold a ``[BLOCK_J, BLOCK_H]`` tile of at most 32 KiB with
    ``BLOCK_J`` the expected live slots per token ``K * R / N`` capped at 4 (``[4, 4096]`` on a full window,
    ``[2, 4096]`` on a quarter one); row kernels (``unpermute``, ``permute_grad``) move rows of at most 8 KiB, one
    live row at a time for ``unpermute`` and two for ``permute_grad``: the best of a sweep on an H200 at a model's
    size (``benchmarks/gpu_moe.py --tune``; docs/moe.md, GPU section)."""
    forced = getattr(SETTINGS.get(), f"{name}_tile")
    if forced is not None:
        return forced
    block_k = min(triton.next_power_of_2(K), 32)
    if slot_tile:
        live = max(1, round(K * R / max(1, N)))
        block_j = min(block_k, 4, triton.next_power_of_2(live))
        block_h = min(triton.next_power_of_2(H), (32768 // elem) // block_j, 4096)
        tile_bytes = block_j * block_h * elem
    else:
        block_j = 2 if name == "permute_grad" else 1
        block_h = min(triton.next_power_of_2(H), 8192 // elem)
        tile_bytes = 2 * block_h * elem
    num_warps = max(1, min(4, tile_bytes // 4096))
    return block_k, block_j, block_h, num_warps


def permute(tokens, sorted_indices, probs, K, s, e):
    """``permuted_tokens[v - s] = tokens[i // K]``, ``permuted_probs[v - s] = probs.flatten()[i]`` for live i."""
    T, H = tokens.shape
    R = e - s
    out = torch.empty(R, H, dtype=tokens.dtype, device=tokens.device)
    pprobs = None if probs is None else torch.empty(R, dtype=probs.dtype, device=tokens.device)
    if T == 0 or R == 0 or (H == 0 and probs is None):
        return out, pprobs
    tokens = tokens.contiguous()
    si = sorted_indices.contiguous()
    probs_c = si if probs is None else probs.contiguous()
    Hc = max(H, 1)
    block_k, block_j, block_h, num_warps = _tile("permute", Hc, K, T * K, R, tokens.element_size(), True)
    _triton.launch(
        moe_permute_kernel, (T, triton.cdiv(Hc, block_h)), tokens.device,
        dict(p_tok=tokens, p_si=si, p_probs=probs_c, p_out=out, p_pprobs=out if pprobs is None else pprobs, s=s, e=e),
        num_warps=num_warps, H=H, K=K, HAS_PROBS=probs is not None, BLOCK_K=block_k, BLOCK_J=block_j,
        BLOCK_H=block_h,
    )
    return out, pprobs


def unpermute(permuted_tokens, sorted_indices, probs, K, s, e):
    """``out[t] = sum_k probs[t, k] * permuted_tokens[v - s]`` over live slots, k ascending, prob == 0 skipped."""
    R, H = permuted_tokens.shape
    T = sorted_indices.numel() // K
    if T == 0 or H == 0 or R == 0:
        return torch.zeros(T, H, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    out = torch.empty(T, H, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    x = permuted_tokens.contiguous()
    si = sorted_indices.contiguous()
    probs_c = si if probs is None else probs.contiguous()
    block_k, block_j, block_h, num_warps = _tile("unpermute", H, K, T * K, R, x.element_size(), False)
    _triton.launch(
        moe_unpermute_kernel, (T, triton.cdiv(H, block_h)), x.device,
        dict(p_x=x, p_si=si, p_probs=probs_c, p_out=out, p_ppg=si, p_pg=si, s=s, e=e),
        num_warps=num_warps, H=H, K=K, HAS_PROBS=probs is not None, GATHER_PG=False, ACC=_acc(x, probs),
        BLOCK_K=block_k, BLOCK_J=block_j, BLOCK_H=block_h,
    )
    return out


def unpermute_grad(grad, sorted_indices, permuted_tokens, probs, K, s, e):
    """The seed op: ``ptg[v - s] = grad[t] * probs[t, k]`` (exact copy without probs) and
    ``probs_grad[t, k] = <permuted_tokens[v - s], grad[t]>`` (0 for dead slots), in one pass."""
    T, H = grad.shape
    R = e - s
    ptg = torch.empty(R, H, dtype=grad.dtype, device=grad.device)
    if probs is None:
        pg = None
        if T == 0 or R == 0 or H == 0:
            return ptg, pg
    else:
        if T == 0 or R == 0 or H == 0:
            return ptg, torch.zeros(T, K, dtype=probs.dtype, device=grad.device)
        pg = torch.empty(T, K, dtype=probs.dtype, device=grad.device)
    g = grad.contiguous()
    si = sorted_indices.contiguous()
    x = g if permuted_tokens is None else permuted_tokens.contiguous()
    probs_c = si if probs is None else probs.contiguous()
    block_k, block_j, block_h, num_warps = _tile("unpermute_grad", H, K, T * K, R, g.element_size(), True)
    _triton.launch(
        moe_unpermute_grad_kernel, (T,), g.device,
        dict(p_grad=g, p_si=si, p_x=x, p_probs=probs_c, p_ptg=ptg, p_pg=ptg if pg is None else pg, s=s, e=e),
        num_warps=num_warps, H=H, K=K, HAS_PROBS=probs is not None, ACC=_acc(g, permuted_tokens, probs),
        BLOCK_K=block_k, BLOCK_J=block_j, BLOCK_H=block_h,
    )
    return ptg, pg


def permute_grad(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e):
    """``tokens_grad[t] = sum_k ptg[v - s]`` over live slots (k ascending); ``probs_grad[t, k] = ppg[v - s]`` or 0."""
    ptg = permuted_tokens_grad
    R, H = ptg.shape
    T = sorted_indices.numel() // K
    ppg = permuted_probs_grad
    if T == 0 or R == 0:
        tg = torch.zeros(T, H, dtype=ptg.dtype, device=ptg.device)
        pg = None if ppg is None else torch.zeros(T, K, dtype=ppg.dtype, device=ptg.device)
        return tg, pg
    tg = torch.empty(T, H, dtype=ptg.dtype, device=ptg.device)
    pg = None if ppg is None else torch.empty(T, K, dtype=ppg.dtype, device=ptg.device)
    if H == 0 and ppg is None:
        return tg, pg
    x = ptg.contiguous()
    si = sorted_indices.contiguous()
    Hc = max(H, 1)
    block_k, block_j, block_h, num_warps = _tile("permute_grad", Hc, K, T * K, R, x.element_size(), False)
    _triton.launch(
        moe_unpermute_kernel, (T, triton.cdiv(Hc, block_h)), x.device,
        dict(p_x=x, p_si=si, p_probs=si, p_out=tg, p_ppg=si if ppg is None else ppg.contiguous(),
             p_pg=tg if pg is None else pg, s=s, e=e),
        num_warps=num_warps, H=H, K=K, HAS_PROBS=False, GATHER_PG=ppg is not None, ACC=_acc(x),
        BLOCK_K=block_k, BLOCK_J=block_j, BLOCK_H=block_h,
    )
    return tg, pg
