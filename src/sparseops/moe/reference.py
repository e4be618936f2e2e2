"""Slow, obvious MoE permute/unpermute that reads like the formulas of docs/moe.md: the test oracle.

Every function takes already-validated arguments: the window ``[s, e)`` is normalised (docs/moe.md), ``K`` is
the top-k, ``sorted_indices`` is the full-length slot -> row map. Loops run over slots; do not use at scale.
Arithmetic is fp32 (float64 when any input is float64); each output element is rounded once.
"""

from __future__ import annotations

import torch

from .._numerics import acc_dtype


def sorted_indices_from(indices: torch.Tensor) -> torch.Tensor:
    """slot -> row: ``argsort(stable_argsort(indices.flatten()))`` as int32."""
    flat = indices.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda i: (flat[i], i))  # row -> slot, experts ascending, stable
    out = [0] * len(flat)
    for row, slot in enumerate(order):
        out[slot] = row
    return torch.tensor(out, dtype=torch.int32, device=indices.device)


def permute(tokens, sorted_indices, probs, K, s, e):
    """``permuted_tokens[v - s] = tokens[i // K]``, ``permuted_probs[v - s] = probs.flatten()[i]`` for valid i."""
    H = tokens.shape[1]
    out = torch.zeros(e - s, H, dtype=tokens.dtype, device=tokens.device)
    pprobs = None if probs is None else torch.zeros(e - s, dtype=probs.dtype, device=probs.device)
    flat_probs = None if probs is None else probs.reshape(-1)
    for i, v in enumerate(sorted_indices.tolist()):
        if s <= v < e:
            out[v - s] = tokens[i // K]
            if pprobs is not None:
                pprobs[v - s] = flat_probs[i]
    return out, pprobs


def unpermute(permuted_tokens, sorted_indices, probs, K, s, e):
    """``out[t] = sum_k probs[t, k] * permuted_tokens[v - s]`` over valid slots, k ascending; prob == 0 skipped."""
    T, H = sorted_indices.numel() // K, permuted_tokens.shape[1]
    acc = acc_dtype(permuted_tokens, probs)
    out = torch.zeros(T, H, dtype=acc, device=permuted_tokens.device)
    si = sorted_indices.tolist()
    for t in range(T):
        for k in range(K):
            v = si[t * K + k]
            if not s <= v < e:
                continue
            row = permuted_tokens[v - s].to(acc)
            if probs is None:
                out[t] += row
            else:
                p = probs[t, k].to(acc)
                if p != 0:
                    out[t] += p * row
    return out.to(permuted_tokens.dtype)


def unpermute_grad(grad, sorted_indices, permuted_tokens, probs, K, s, e):
    """The seed op. With probs: ``ptg[v - s] = grad[t] * probs[t, k]``, ``probs_grad[t, k] = <permuted_tokens[v - s], grad[t]>``
    (0 for invalid slots). Without: ``ptg[v - s] = grad[t]`` exactly, ``probs_grad = None``."""
    T, H = grad.shape
    acc = acc_dtype(grad, permuted_tokens, probs)
    ptg = torch.zeros(e - s, H, dtype=grad.dtype, device=grad.device)
    pg = None if probs is None else torch.zeros(T, K, dtype=probs.dtype, device=grad.device)
    si = sorted_indices.tolist()
    for t in range(T):
        for k in range(K):
            v = si[t * K + k]
            if not s <= v < e:
                continue
            if probs is None:
                ptg[v - s] = grad[t]
            else:
                g = grad[t].to(acc)
                ptg[v - s] = (g * probs[t, k].to(acc)).to(grad.dtype)
                pg[t, k] = (permuted_tokens[v - s].to(acc) * g).sum().to(probs.dtype)
    return ptg, pg


def permute_grad(permuted_tokens_grad, sorted_indices, permuted_probs_grad, K, s, e):
    """``tokens_grad[t] = sum_k ptg[v - s]`` over valid slots; ``probs_grad[t, k] = permuted_probs_grad[v - s]`` or 0."""
    N = sorted_indices.numel()
    T, H = N // K, permuted_tokens_grad.shape[1]
    acc = acc_dtype(permuted_tokens_grad)
    tg = torch.zeros(T, H, dtype=acc, device=permuted_tokens_grad.device)
    pg = None
    if permuted_probs_grad is not None:
        pg = torch.zeros(T, K, dtype=permuted_probs_grad.dtype, device=permuted_tokens_grad.device)
    si = sorted_indices.tolist()
    for t in range(T):
        for k in range(K):
            v = si[t * K + k]
            if not s <= v < e:
                continue
            tg[t] += permuted_tokens_grad[v - s].to(acc)
            if pg is not None:
                pg[t, k] = permuted_probs_grad[v - s]
    return tg.to(permuted_tokens_grad.dtype), pg
