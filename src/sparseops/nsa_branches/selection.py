"""Top-n block selection from the compressed attention scores (docs/nsa-module.md, Eq. 9 in 0-based form)."""

from __future__ import annotations

import torch

from .. import _checks
from .._numerics import exp_floor, without_autocast
from .._topk import stable_topk
from . import chunked_attention as _ca
from .checks import stats_dtype
from .compressed_attention import check_cmp_args


def importance_weights(block_size: int, stride: int, select_block_size: int) -> list[int]:
    """Weights of compressed blocks ``i*l'/d - (l/d - 1) .. i*l'/d + l'/d - 1`` in the score of selection block i:
    ``w[o + l/d - 1] = #{(a, b): a - b = o, 0 <= a < l'/d, 0 <= b < l/d}``. (32, 16, 64) -> [1, 2, 2, 2, 1]."""
    r, s = select_block_size // stride, block_size // stride
    w = [0] * (r + s - 1)
    for a in range(r):
        for b in range(s):
            w[a - b + s - 1] += 1
    return w


def block_importance(P: torch.Tensor, block_size: int, stride: int, select_block_size: int, nsel: int) -> torch.Tensor:
    """Eq. 9: ``S[..., i] = sum_{a < l'/d} sum_{b < l/d} P[..., i*l'/d + a - b]`` (indices in ``[0, C)``), as one
    strided ``conv1d`` with :func:`importance_weights`.

    Args:
        P: ``[..., C]`` float compressed-block probabilities, ``C <= nsel * l' / d``.
        block_size, stride, select_block_size: ``l``, ``d``, ``l'`` with ``d | l`` and ``d | l'``.
        nsel: the number of selection blocks to score.

    Returns:
        ``S [..., nsel]`` in P's dtype.
    """
    r, s = select_block_size // stride, block_size // stride
    weights = importance_weights(block_size, stride, select_block_size)
    kern = torch.tensor(weights, dtype=P.dtype, device=P.device).view(1, 1, -1)
    C = P.shape[-1]
    need = nsel * r + s - 1
    x = torch.nn.functional.pad(P.reshape(-1, 1, C), (s - 1, max(0, need - C - (s - 1))))
    return torch.nn.functional.conv1d(x[..., :need], kern, stride=r).view(*P.shape[:-1], nsel)


@without_autocast  # the scores that decide the selection stay in fp32
def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens,
    cu_seqlens_cmp,
    block_size: int = 32,
    stride: int = 16,
    select_block_size: int = 64,
    select_count: int = 16,
    init_blocks: int = 1,
    local_blocks: int = 2,
    scale: float | None = None,
) -> torch.Tensor:
    """The ``n`` selection blocks each (token, KV head) attends, from the compressed branch's probabilities.

    ``p[t, h, j] = exp(scale * q[t, h] . k_cmp[j] - lse[t, h])`` for the blocks j visible to t (``j*d + l - 1 <= t``),
    summed over the G query heads of KV head n2: ``P[t, n2, j]``. Selection block i (positions
    ``[i*l', (i+1)*l')``) scores (Eq. 9, 0-based, needs ``d | l`` and ``d | l'``)::

        S[t, n2, i] = sum_{a=0}^{l'/d-1} sum_{b=0}^{l/d-1} P[t, n2, i*l'/d + a - b]     (indices in [0, C))

    i.e. weights 1, 2, 2, 2, 1 on compressed blocks ``4i-1 .. 4i+3`` for (l, d, l') = (32, 16, 64), the identity
    for ``l = l' = d``. Candidates are the blocks with ``i*l' <= t``; among them ``i < init_blocks`` and the
    ``local_blocks`` blocks ending at ``t // l'`` are forced. The ``min(n, #candidates)`` candidates with the largest
    S (ties to the lower i) are written sorted ascending, then ``-1``. Computed from detached scores in fp32
    (float64 for float64 inputs), by chunks of queries; not differentiable.

    Args:
        q: ``[T, N1, Dqk]`` float16, bfloat16, float32 or float64.
        k_cmp: ``[C, N2, Dqk]``, the dtype of q.
        lse: ``[T, N1]`` from :func:`~sparseops.nsa_branches.compressed_attention` (``-inf`` where nothing is visible).
        cu_seqlens, cu_seqlens_cmp: cumulative lengths with the leading 0 (as for ``compressed_attention``).
        block_size, stride: ``l`` and ``d``; select_block_size: ``l'`` with ``d | l'``.
        select_count: ``n >= init_blocks + local_blocks``; init_blocks, local_blocks: ``>= 0``.
        scale: multiplies ``q . k``; default ``Dqk ** -0.5``.

    Returns:
        ``topk_indices [T, N2, n]`` int32, block ids local to each token's sequence, for
        :func:`sparseops.nsa_selected_attention` (cumulative lengths ``cu_seqlens[1:]``, ``sparse_mode=2``).
    """
    cu, cu_cmp, l, d, scale = check_cmp_args(q, k_cmp, None, cu_seqlens, cu_seqlens_cmp, block_size, stride, scale,
                                             v_needed=False)
    T, N1, _ = q.shape
    lse = _checks.check_tensor("lse", lse, ndim=2, dtypes=(torch.float32, torch.float64))
    _checks.check_shape("lse", lse, [("T", T), ("N1", N1)])
    lb = _checks.check_int("select_block_size", select_block_size, lo=1)
    if lb % d:
        raise ValueError(f"select_block_size: expected a multiple of stride = {d}, got {lb}")
    init = _checks.check_int("init_blocks", init_blocks, lo=0)
    local = _checks.check_int("local_blocks", local_blocks, lo=0)
    n = _checks.check_int("select_count", select_count, lo=1)
    if n < init + local:
        raise ValueError(f"select_count: expected >= init_blocks + local_blocks = {init + local}, got {n}")
    with torch.no_grad():
        return _select(q.detach(), k_cmp.detach(), lse.detach(), cu, cu_cmp, l, d, lb, n, init, local, scale)


def _select(q, k_cmp, lse, cu, cu_cmp, l, d, lb, n, init, local, scale):
    T, N1, _ = q.shape
    n2 = k_cmp.shape[1]
    cdt = stats_dtype(q.dtype)
    dev = q.device
    out = torch.full((T, n2, n), -1, dtype=torch.int32, device=dev)
    budget = _ca.SETTINGS.get().chunk_bytes
    elt = 8 if cdt == torch.float64 else 4
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse.to(cdt))
    for b in range(len(cu) - 1):
        st, L, c, C = cu[b], cu[b + 1] - cu[b], cu_cmp[b], cu_cmp[b + 1] - cu_cmp[b]
        rows = max(1, budget // (N1 * elt * max(C, 1)))
        for p0 in range(0, L, rows):
            p1 = min(L, p0 + rows)
            tq = p1 - p0
            nsel = (p1 - 1) // lb + 1
            pos = torch.arange(p0, p1, device=dev)
            if C > 0 and p1 - 1 >= l - 1:
                nv = (p1 - 1 - (l - 1)) // d + 1
                chunk = (st + p0, st + p1, c, c + nv, p0, l - 1)
                qh = _ca._heads_first(q[st + p0:st + p1].to(cdt), n2) * scale
                sc = _ca._scores(qh, k_cmp[c:c + nv].to(cdt), chunk, tq)
                lc = lse_safe[st + p0:st + p1].view(tq, n2, -1).transpose(0, 1)[..., None]
                P = _ca._exp_(sc.sub_(lc), _ca._edges(chunk, d, None, tq, dev), exp_floor(cdt))
                P = P.sum(2).transpose(0, 1)  # [tq, N2, nv]
                S = block_importance(P, l, d, lb, nsel)
            else:
                S = torch.zeros((tq, n2, nsel), dtype=cdt, device=dev)
            blk = torch.arange(nsel, device=dev)
            cur = (pos // lb)[:, None]
            cand = blk[None, :] <= cur
            forced = cand & ((blk[None, :] < init) | (blk[None, :] > cur - local))
            S = S.masked_fill(forced[:, None, :], float("inf")).masked_fill(~cand[:, None, :], float("-inf"))
            # the first n of a stable descending sort (ties to the lower block), without sorting every block
            order = stable_topk(S.reshape(-1, nsel), min(n, nsel)).view(tq, n2, -1)
            ids = torch.where(cand.sum(1)[:, None, None] > torch.arange(order.shape[-1], device=dev), order, nsel)
            ids = ids.sort(-1).values
            ids = torch.where(ids == nsel, -1, ids).to(torch.int32)
            out[st + p0:st + p1, :, :ids.shape[-1]] = ids
    return out
