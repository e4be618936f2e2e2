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
    """The selection by chunks (docs/nsa-module.md, "How it is computed"): a sequence that needs several chunks, or
    whose rows are too many to gather, runs alone by row chunks; the others run in padded batches of sequences of
    like length (:func:`_plan`). The Python work grows with the chunks and the length classes, not with the
    sequences, and no shape depends on the data (one graph under ``torch.compile``)."""
    T, N1, D = q.shape
    n2 = k_cmp.shape[1]
    cfg = _ca.SETTINGS.get()
    cdt = stats_dtype(q.dtype)
    elt = 8 if cdt == torch.float64 else 4
    dev = q.device
    out = torch.full((T + 1, n2, n), -1, dtype=torch.int32, device=dev)  # row T takes the padding rows' writes
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse.to(cdt))
    rule = (l, d, lb, n, init, local)
    alone, batches, width = _plan(cu, cu_cmp, l, N1 * elt, D, cfg.chunk_bytes, cfg.select_group_bytes)
    for b in alone:
        st, L, c = cu[b], cu[b + 1] - cu[b], cu_cmp[b]
        rows = max(1, cfg.chunk_bytes // (N1 * elt * max(cu_cmp[b + 1] - c, 1)))
        for p0 in range(0, L, rows):
            p1 = min(L, p0 + rows)
            nv = max(0, (p1 - 1 - (l - 1)) // d + 1)
            qh = _ca._heads_first(q[st + p0:st + p1].to(cdt), n2) * scale if nv else None
            S = _scores(qh, k_cmp[c:c + nv], lse_safe[st + p0:st + p1][None], p0, rule)
            ids = _pick(S, torch.arange(p0, p1, device=dev), rule)
            out[st + p0:st + p1, :, :ids.shape[-1]] = ids
    if width:
        # positions < l - 1 see no block and score 0 everywhere: their ids depend on the position only
        table = _pick(torch.zeros((width, n2, (width - 1) // lb + 1), dtype=cdt, device=dev),
                      torch.arange(width, device=dev), rule)
    for sees, first, rows, cfirst, counts in batches:
        if not sees:
            _put(out, first, rows, max(rows), table)
            continue
        if l > 1:
            _put(out, [f - (l - 1) for f in first], [l - 1] * len(first), l - 1, table)
        _batch(q, k_cmp, lse_safe, out, first, rows, cfirst, counts, scale, rule)
    return out[:T]


def _plan(cu, cu_cmp, l, row_bytes, D, chunk_bytes, group_bytes):
    """``(alone, batches, width)``: the sequences that run alone; batches ``(sees, first, rows, cfirst, counts)``,
    lists over their sequences: with blocks (``sees``) their ``rows`` rows from position ``l - 1`` on at ``first``
    and their ``counts`` blocks at ``cfirst``, else all their ``rows`` rows at ``first``; ``width``, the positions
    that the table of rows that see no block holds.

    A sequence runs alone when its rows times ``max(C, Dqk)`` exceed one chunk (``chunk_bytes`` of scores or of
    queries, ``row_bytes`` per row and entry) or its rows' queries ``group_bytes``. The others go by classes of
    ``(2**(k-1), 2**k]`` rows, with blocks or without, sorted by rows: a batch pads to its longest (less than twice
    as long) and holds at most one chunk. A function of Python ints that returns Python ints: ``torch.compile``
    calls it when it traces and keeps the result as constants, as it keeps ``cu_seqlens`` (marked as
    ``_settings._reader`` is)."""
    starts, cstarts = torch.tensor(cu), torch.tensor(cu_cmp)
    lens, counts = starts.diff(), cstarts.diff()
    sees = counts > 0
    rows = torch.where(sees, lens - (l - 1), lens)
    cap = chunk_bytes // row_bytes
    alone = sees & ((rows * counts.clamp(min=D) > cap) | (rows * D * row_bytes > group_bytes))
    rest = (~alone & (lens > 0)).nonzero().flatten()
    rest = rest[rows[rest].sort(stable=True).indices]
    key = sees[rest] * 64 + torch.searchsorted(2 ** torch.arange(63), rows[rest])  # 64 * sees + ceil(log2(rows))
    key, order = key.sort(stable=True)
    rest = rest[order]
    sizes = key.unique_consecutive(return_counts=True)[1]
    first = (starts[rest] + sees[rest] * (l - 1)).tolist()
    r, s, c, cf = rows[rest].tolist(), sees[rest].tolist(), counts[rest].tolist(), cstarts[rest].tolist()
    batches, a = [], 0
    for size in sizes.tolist():
        last = a + size - 1
        m = max(1, cap // (r[last] * (max(c[last], D) if s[last] else 1)))
        for g0 in range(a, a + size, m):
            g = slice(g0, min(a + size, g0 + m))
            batches.append((s[last], first[g], r[g], cf[g], c[g]))
        a += size
    width = l - 1 if any(s) else max(r, default=0)
    return alone.nonzero().flatten().tolist(), batches, width


_plan._dynamo_marked_constant = True


def _put(out, first, lens, width, table):
    """Rows ``first[i] + p`` for ``p < lens[i]`` (lists) get ``table[p]``, the ids of position p when no block is
    seen; ``width >= max(lens)``."""
    first, lens = torch.tensor(first), torch.tensor(lens)
    p = torch.arange(width)
    dst = torch.where(p < lens[:, None], first[:, None] + p, out.shape[0] - 1).flatten().to(out.device)
    k = table.shape[-1]
    out[dst, :, :k] = table[:width].expand(len(first), *table[:width].shape).reshape(-1, *table.shape[1:])


def _batch(q, k_cmp, lse_safe, out, first, rows, cfirst, counts, scale, rule):
    """Selects for ``m`` sequences at once: sequence i's ``rows[i]`` rows from ``first[i]`` (positions ``l - 1``
    on) and its ``counts[i]`` blocks from ``cfirst[i]`` (lists), padded to the longest by repeating its last row and
    block: a padded row writes to ``out``'s last row, and a padded block lies after the blocks that a row of its
    sequence sees, so the positional rule hides it."""
    l, n2, dev = rule[0], k_cmp.shape[1], q.device
    m, tq, nv = len(rows), max(rows), max(counts)
    first, rows, cfirst, counts = (torch.tensor(x) for x in (first, rows, cfirst, counts))
    r = torch.arange(tq)
    tok = (first[:, None] + torch.minimum(r[None, :], rows[:, None] - 1)).flatten().to(dev)  # [m * tq]
    blocks = cfirst[None, :] + torch.minimum(torch.arange(nv)[:, None], counts[None, :] - 1)  # [nv, m]
    # the gathered rows are this function's own: scaled in place, no second copy
    qh = _ca._heads_first(q.index_select(0, tok).to(lse_safe.dtype).view(m, tq, *q.shape[1:]), n2).mul_(scale)
    kc = k_cmp.index_select(0, blocks.flatten().to(dev)).view(nv, m * n2, -1)
    S = _scores(qh, kc, lse_safe.index_select(0, tok).view(m, tq, -1), l - 1, rule)
    ids = _pick(S, torch.arange(l - 1, l - 1 + tq, device=dev).repeat(m), rule)
    dst = torch.where(r[None, :] < rows[:, None], first[:, None] + r, out.shape[0] - 1).flatten().to(dev)
    out[dst, :, :ids.shape[-1]] = ids


def _scores(qh, kc, lc, p0, rule):
    """Eq. 9 for ``m`` sequences' queries at positions ``p0 .. p0 + Tq - 1``: ``qh [m*N2, Tq*G, Dqk]`` scaled
    (:func:`~sparseops.nsa_branches.chunked_attention._heads_first`), their blocks ``kc [nv, m*N2, Dqk]`` (sequence
    i's KV heads at ``i*N2 ..``), ``lc [m, Tq, N1]`` the log-sum-exp (``inf`` where nothing is visible); returns
    ``S [m*Tq, N2, nsel]`` in lc's dtype, ``nsel`` the blocks up to the last position."""
    l, d, lb = rule[:3]
    m, tq = lc.shape[:2]
    nv, n2 = kc.shape[0], kc.shape[1] // m
    cdt, dev = lc.dtype, lc.device
    nsel = (p0 + tq - 1) // lb + 1
    if nv == 0:
        return torch.zeros((m * tq, n2, nsel), dtype=cdt, device=dev)
    chunk = (0, tq, 0, nv, p0, l - 1)
    sc = _ca._scores(qh, kc.to(cdt), chunk, tq)  # [m*N2, Tq, G, nv]
    lc = lc.view(m, tq, n2, -1).transpose(1, 2).reshape(m * n2, tq, -1)[..., None]
    P = _ca._exp_(sc.sub_(lc), _ca._edges(chunk, d, None, tq, dev), exp_floor(cdt))
    P = P.sum(2).view(m, n2, tq, nv).transpose(1, 2)  # [m, Tq, N2, nv]
    return block_importance(P, l, d, lb, nsel).view(m * tq, n2, nsel)


def _pick(S, pos, rule):
    """``ids [R, N2, min(n, nsel)]`` int32 from the scores ``S [R, N2, nsel]`` of rows at positions ``pos [R]``: the
    forced blocks, then the best candidates (ties to the lower block), ascending, ``-1`` past the candidates."""
    _, _, lb, n, init, local = rule
    R, n2, nsel = S.shape
    dev = S.device
    blk = torch.arange(nsel, device=dev)
    cur = (pos // lb)[:, None]
    cand = blk[None, :] <= cur
    forced = cand & ((blk[None, :] < init) | (blk[None, :] > cur - local))
    S = S.masked_fill(forced[:, None, :], float("inf")).masked_fill(~cand[:, None, :], float("-inf"))
    # the first n of a stable descending sort (ties to the lower block), without sorting every block
    order = stable_topk(S.reshape(-1, nsel), min(n, nsel)).view(R, n2, -1)
    ids = torch.where(cand.sum(1)[:, None, None] > torch.arange(order.shape[-1], device=dev), order, nsel)
    ids = ids.sort(-1).values
    return torch.where(ids == nsel, -1, ids).to(torch.int32)
