"""Argument checks of :mod:`sparseops.dsa` (docs/dsa.md): they name the argument, the expected and the actual value,
and run before anything is computed."""

from __future__ import annotations

import torch

from .. import _checks, _varlen
from .._numerics import acc_dtype  # noqa: F401  (the dsa modules' import of the rule)

#: dtypes of the indexer's and the attention's inputs
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cu_seqlens_list(cu, total: int) -> list[int]:
    """flash-attention ``cu_seqlens`` (leading 0, int tensor or list; None = one sequence) -> ``list[int]``."""
    return _varlen.cu_seqlens_list("cu_seqlens", cu, total)


def check_attention_qk(q, k, scale, head_num) -> float:
    """The main attention's ``q [T, N1, Dqk]`` and ``k [T, N2, Dqk]`` (one dtype, ``N2`` dividing ``N1``), its
    ``scale`` and ``head_num = N1``, as the indexer's losses take them; returns ``scale`` as a float."""
    q = _checks.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    k = _checks.check_tensor("k", k, ndim=3)
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} (the dtype of q), got {k.dtype}")
    T, N1, D = q.shape
    _checks.check_shape("k", k, [("T", T), ("N2", -1), ("Dqk", D)])
    N2 = k.shape[1]
    if N2 < 1 or N1 % N2:
        raise ValueError(f"k: expected N2 = k.shape[1] >= 1 dividing N1 = {N1}, got N2 = {N2}")
    scale = _checks.check_float("scale", scale)
    if _checks.check_int("head_num", head_num) != N1:
        raise ValueError(f"head_num: expected N1 = q.shape[1] = {N1}, got {head_num}")
    return scale


def check_indexer_args(q_idx, k_idx, weights, cu_seqlens, causal) -> tuple[list[int], bool]:
    """``q_idx [T, Hi, Di]``, ``k_idx [T, Di]``, ``weights [T, Hi]`` of one floating dtype on one device;
    returns ``(cu, causal)``."""
    q_idx = _checks.check_tensor("q_idx", q_idx, ndim=3, dtypes=DTYPES)
    k_idx = _checks.check_tensor("k_idx", k_idx, ndim=2)
    weights = _checks.check_tensor("weights", weights, ndim=2)
    for name, t in (("k_idx", k_idx), ("weights", weights)):
        if t.dtype != q_idx.dtype:
            raise TypeError(f"{name}: expected dtype {q_idx.dtype} (the dtype of q_idx), got {t.dtype}")
    T, Hi, Di = q_idx.shape
    _checks.check_shape("k_idx", k_idx, [("T", T), ("Di", Di)])
    _checks.check_shape("weights", weights, [("T", T), ("Hi", Hi)])
    _checks.check_same_device(q_idx=q_idx, k_idx=k_idx, weights=weights)
    _checks.check_has_data("q_idx", q_idx)  # the top-k reads the scores
    return cu_seqlens_list(cu_seqlens, T), _checks.check_bool("causal", causal)


def check_positions(indices: torch.Tensor, cu: list[int]) -> None:
    """Every entry of ``indices [T, topk]`` in ``[-1, S(b))`` of its token's sequence ``b``."""
    if not _checks.data_checks(True, indices):
        return
    seq, _ = _varlen.token_seq_positions(cu, device=indices.device)
    lens = torch.tensor(_varlen.seq_lengths(cu), dtype=torch.int64, device=indices.device)
    bad = (indices < -1) | (indices >= lens[seq][:, None])
    if bool(bad.any()):
        t, j = (int(i) for i in torch.nonzero(bad)[0])
        b = int(seq[t])
        raise ValueError(f"indices: expected in-sequence positions in [-1, {int(lens[b])}) (sequence {b}), got "
                         f"{int(indices[t, j])} at [{t}, {j}]")
