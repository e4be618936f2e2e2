"""The MoE layer's oracle: a per-token loop in the inputs' dtype (float64 in the tests), slow and obvious.

It follows docs/moe-layer.md literally: each token's logits, scores and choice (Python ``sorted`` with the
tie rules), each expert applied to one row, capacity decided per source rank, losses over all ranks' tokens.
Differentiable (plain torch ops), so autograd gives the reference gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _expert(x: torch.Tensor, w1, w3, w2, activation: str) -> torch.Tensor:
    h = w1 @ x
    a = F.silu(h) * (w3 @ x) if activation == "swiglu" else F.gelu(h)
    return w2 @ a


def _choose(key: list[float], K: int, num_groups, group_topk) -> list[int]:
    E = len(key)
    eligible = list(range(E))
    if num_groups is not None:
        n = E // num_groups
        gkey = [sum(sorted(key[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: (-gkey[g], g))[:group_topk]
        eligible = [e for e in eligible if e // n in groups]
    return sorted(eligible, key=lambda e: (-key[e], e))[:K]


def moe_reference(xs: list[torch.Tensor], params: dict, *, top_k: int, score_func: str = "softmax",
                  norm_topk_prob: bool = True, scaling_factor: float = 1.0, num_groups=None, group_topk=None,
                  aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, capacity_factor=None,
                  drop_policy: str = "probs", activation: str = "swiglu", indices: list | None = None) -> dict:
    """The outputs of an MoE layer run on ``len(xs)`` ranks (rank q's tokens ``xs[q] [T_q, H]``).

    Args:
        xs: every rank's tokens. params: ``router`` `[E, H]`, ``expert_bias`` `[E]` or None, ``w1``, ``w3``
            (swiglu) `[E, F, H]`, ``w2`` `[E, H, F]`, ``shared`` ``(w1 [Fs, H], w3, w2 [H, Fs])`` or None; all
            global (every expert).
        indices: optional per-rank `[T_q, K]` choices to use instead of the oracle's own (for low-precision
            runs, where a near-tie may flip between dtypes).
        other keywords: as :class:`sparseops.nn.MoELayer` / :class:`sparseops.nn.TopKRouter`.

    Returns:
        dict with ``ys`` (list of `[T_q, H]`), ``aux_loss`` (0-dim), ``indices`` (list of lists),
        ``routed`` `[E]` and ``kept`` `[E]` (int lists), ``dropped`` (int).
    """
    Wr, bias = params["router"], params.get("expert_bias")
    E = Wr.shape[0]
    K = top_k
    per_rank = []
    routed = [0] * E
    s_hat_sum = None
    z_sum = 0.0
    T_g = sum(x.shape[0] for x in xs)
    for q, x in enumerate(xs):
        toks = []
        for t in range(x.shape[0]):
            logits = Wr @ x[t]
            scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
            key = [float(v) for v in scores.detach()]
            if bias is not None:
                key = [k + float(b) for k, b in zip(key, bias)]
            chosen = indices[q][t] if indices is not None else _choose(key, K, num_groups, group_topk)
            p = torch.stack([scores[e] for e in chosen])
            if norm_topk_prob:
                p = p / p.sum()
            p = p * scaling_factor
            for e in chosen:
                routed[e] += 1
            s_hat = scores / scores.sum()
            s_hat_sum = s_hat if s_hat_sum is None else s_hat_sum + s_hat
            z_sum = z_sum + torch.logsumexp(logits, -1) ** 2
            toks.append((chosen, p))
        keep = [[True] * K for _ in toks]
        if capacity_factor is not None:
            cap = math.ceil(capacity_factor * len(toks) * K / E)
            for e in range(E):
                slots = [(t, k) for t, (ch, _) in enumerate(toks) for k in range(K) if ch[k] == e]
                if drop_policy == "probs":
                    slots = sorted(slots, key=lambda s: (-float(toks[s[0]][1][s[1]].detach()), s[0]))
                for t, k in slots[cap:]:
                    keep[t][k] = False
        per_rank.append((toks, keep))
    ys, kept, idx_out = [], [0] * E, []
    for q, x in enumerate(xs):
        toks, keep = per_rank[q]
        rows = []
        for t, (chosen, p) in enumerate(toks):
            y = x.new_zeros(x.shape[1])
            for k, e in enumerate(chosen):
                if keep[t][k]:
                    kept[e] += 1
                    y = y + p[k] * _expert(x[t], params["w1"][e], params["w3"][e] if activation == "swiglu"
                                           else None, params["w2"][e], activation)
            if params.get("shared") is not None:
                s1, s3, s2 = params["shared"]
                y = y + s2 @ (F.silu(s1 @ x[t]) * (s3 @ x[t]))
            rows.append(y)
        ys.append(torch.stack(rows) if rows else x.new_zeros(0, x.shape[1]))
        idx_out.append([list(c) for c, _ in toks])
    aux = Wr.new_zeros(())
    if T_g and aux_loss_coeff:
        f = torch.tensor(routed, dtype=Wr.dtype) / (T_g * K)
        aux = aux + aux_loss_coeff * E * (f * (s_hat_sum / T_g)).sum()
    if T_g and z_loss_coeff:
        aux = aux + z_loss_coeff * z_sum / T_g
    return {"ys": ys, "aux_loss": aux, "indices": idx_out, "routed": routed, "kept": kept,
            "dropped": sum(routed) - sum(kept)}
