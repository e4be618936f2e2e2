"""The dense lightning-indexer scores (docs/dsa.md): the test oracle of :func:`sparseops.dsa.indexer_topk`.

It materialises ``[T, T]``: for tests and short sequences only.
"""

from __future__ import annotations

import torch

from .checks import acc_dtype, check_indexer_args


def index_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, *, cu_seqlens=None,
                 causal: bool = True) -> torch.Tensor:
    """``I [T, T]``: ``I[t, s] = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])`` for a key ``s`` of ``t``'s
    own sequence (and, causal, at or before ``t``), ``-inf`` elsewhere; fp32 (float64 for float64 inputs).

    Args:
        q_idx: ``[T, Hi, Di]`` the indexer's queries; k_idx: ``[T, Di]`` its keys (one head);
            weights: ``[T, Hi]`` the per-head weights (scales are the caller's, folded into these).
        cu_seqlens: flash-attention cumulative lengths with the leading 0, or None for one sequence.
        causal: mask the keys after the query.
    """
    cu, causal = check_indexer_args(q_idx, k_idx, weights, cu_seqlens, causal)
    acc = acc_dtype(q_idx.dtype)
    T = q_idx.shape[0]
    dots = torch.relu(torch.einsum("thd,sd->ths", q_idx.to(acc), k_idx.to(acc)))
    scores = torch.einsum("th,ths->ts", weights.to(acc), dots)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff(), output_size=T)
    ok = seq[:, None] == seq[None, :]
    if causal:
        ok &= torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    return scores.masked_fill(~ok.to(scores.device), float("-inf"))
