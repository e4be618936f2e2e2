"""Float64 dense-mask oracles of the NSA module's functional pieces (docs/nsa-module.md).

Slow and obvious: one sequence at a time, a dense visibility mask, Eq. 9 as its double sum, the selection as a
per-token sort. Inputs are validated by the public functions; these take cu_seqlens as lists with the leading 0.
"""

from __future__ import annotations

import torch

from .checks import cmp_cu_seqlens


def compress_kv(k, v, cu, l, d, compressor=None):
    """``(k_cmp, v_cmp, cu_cmp)`` in float64; ``compressor`` as in :func:`sparseops.nsa_branches.compress_kv`."""
    phi_k, phi_v = compressor if isinstance(compressor, tuple) else (compressor, compressor)
    cu_cmp = cmp_cu_seqlens(cu, l, d)
    outs = []
    for x, phi in ((k, phi_k), (v, phi_v)):
        x = x.double()
        blocks = [x[cu[b] + j * d: cu[b] + j * d + l] for b in range(len(cu) - 1)
                  for j in range(cu_cmp[b + 1] - cu_cmp[b])]
        if not blocks:
            outs.append(x.new_zeros((0, *x.shape[1:])))
            continue
        stacked = torch.stack(blocks)
        outs.append(stacked.mean(1) if phi is None else phi(stacked).double())
    return outs[0], outs[1], cu_cmp


def _dense(q, k, v, visible, scale):
    """``q [Lq, N1, D]``, ``k [Lk, N2, D]``, ``visible [Lq, Lk]`` -> ``(o, lse)``; empty rows: 0 and -inf."""
    G = q.shape[1] // max(k.shape[1], 1)
    kk = k.double().repeat_interleave(G, dim=1)
    vv = v.double().repeat_interleave(G, dim=1)
    s = scale * torch.einsum("qhd,khd->hqk", q.double(), kk)
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    o = torch.einsum("hqk,khd->qhd", p, vv)
    return o, lse.transpose(0, 1)


def _cmp_visibility(q, k_cmp, cu, cu_cmp, l, d, scale):
    """Per sequence: ``(q_b, k_cmp_b, visible [L, C])`` with ``visible[t, j] = j*d + l - 1 <= t``."""
    res = []
    for b in range(len(cu) - 1):
        qb, kb = q[cu[b]:cu[b + 1]], k_cmp[cu_cmp[b]:cu_cmp[b + 1]]
        L, C = qb.shape[0], kb.shape[0]
        t = torch.arange(L)[:, None]
        j = torch.arange(C)[None, :]
        visible = j * d + l - 1 <= t
        res.append((qb, kb, visible))
    return res


def compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, l, d, scale):
    """``(o [T, N1, Dv], lse [T, N1])`` float64, by a dense mask per sequence."""
    o = q.new_zeros((q.shape[0], q.shape[1], v_cmp.shape[2]), dtype=torch.float64)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b, (qb, kb, visible) in enumerate(_cmp_visibility(q, k_cmp, cu, cu_cmp, l, d, scale)):
        if qb.shape[0] == 0:
            continue
        ob, lb = _dense(qb, kb, v_cmp[cu_cmp[b]:cu_cmp[b + 1]], visible, scale)
        o[cu[b]:cu[b + 1]] = ob
        lse[cu[b]:cu[b + 1]] = lb
    return o, lse


def importance(P, l, d, lb, nsel):
    """Eq. 9 as written: ``S[..., i] = sum_a sum_b P[..., i*l'/d + a - b]`` over indices in ``[0, C)``."""
    C = P.shape[-1]
    S = P.new_zeros((*P.shape[:-1], nsel))
    for i in range(nsel):
        for a in range(lb // d):
            for bb in range(l // d):
                j = i * (lb // d) + a - bb
                if 0 <= j < C:
                    S[..., i] += P[..., j]
    return S


def select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lb, n, init, local, scale):
    """``topk_indices [T, N2, n]`` int32 by a per-token, per-KV-head sort in float64."""
    q, k_cmp, lse = q.detach(), k_cmp.detach(), lse.detach()
    T, N1, _ = q.shape
    n2 = k_cmp.shape[1]
    G = N1 // n2
    out = torch.full((T, n2, n), -1, dtype=torch.int32)
    for b, (qb, kb, visible) in enumerate(_cmp_visibility(q, k_cmp, cu, cu_cmp, l, d, scale)):
        L = qb.shape[0]
        if L == 0:
            continue
        kk = kb.double().repeat_interleave(G, dim=1)
        s = scale * torch.einsum("qhd,khd->qhk", qb.double(), kk)
        lb_ = lse[cu[b]:cu[b + 1]].double()[..., None]
        p = torch.where(visible[:, None, :] & (lb_ > float("-inf")), torch.exp(s - lb_), 0.0)
        P = p.view(L, n2, G, -1).sum(2)
        nsel = (L - 1) // lb + 1
        S = importance(P, l, d, lb, nsel)
        for t in range(L):
            cur = t // lb
            for h in range(n2):
                cands = list(range(cur + 1))
                forced = [i for i in cands if i < init or i > cur - local]
                rest = sorted((i for i in cands if i not in forced), key=lambda i: (-float(S[t, h, i]), i))
                pick = sorted((forced + rest)[:n])
                out[cu[b] + t, h, :len(pick)] = torch.tensor(pick, dtype=torch.int32)
    return out


def sliding_window_attention(q, k, v, cu, window, scale):
    """``o [T, N1, Dv]`` float64 by a dense band mask per sequence."""
    o = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float64)
    for b in range(len(cu) - 1):
        L = cu[b + 1] - cu[b]
        if L == 0:
            continue
        t = torch.arange(L)
        diff = t[:, None] - t[None, :]
        o[cu[b]:cu[b + 1]] = _dense(q[cu[b]:cu[b + 1]], k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]],
                                    (diff >= 0) & (diff < window), scale)[0]
    return o


def selected_attention(q, k, v, topk, cu, lb, scale):
    """The selected branch, dense: token t attends the keys ``<= t`` of its selected blocks."""
    o = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float64)
    n2 = k.shape[1]
    G = q.shape[1] // n2
    for b in range(len(cu) - 1):
        L = cu[b + 1] - cu[b]
        if L == 0:
            continue
        t = torch.arange(L)
        blk = t // lb
        tk = topk[cu[b]:cu[b + 1]].long()
        for h in range(n2):
            chosen = (tk[:, h, :, None] == blk[None, None, :]).any(1)
            visible = chosen & (t[None, :] <= t[:, None])
            heads = slice(h * G, (h + 1) * G)
            o[cu[b]:cu[b + 1], heads] = _dense(q[cu[b]:cu[b + 1], heads], k[cu[b]:cu[b + 1], h:h + 1],
                                               v[cu[b]:cu[b + 1], h:h + 1], visible, scale)[0]
    return o
