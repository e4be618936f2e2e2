"""The NSA reference oracle against an independent dense formulation (float64).

The dense form builds, per sequence and KV head, a ``[S1, S2]`` visibility-count matrix (a key picked by two
slots counts twice), then takes the softmax with the counts as multiplicities; its gradients come from torch
autograd. Nothing here shares code with ``sparseops.nsa``.
"""

import pytest
import torch

from sparseops._varlen import normalize_cu_seqlens
from sparseops.nsa import reference
from sparseops.testing import assert_close, make_nsa_inputs


def visibility_counts(topk_b, S1, S2, bs, causal):
    """``[S1, S2]`` float64: how many slots of each query row gather each key, after the visibility rules of docs/nsa.md."""
    cnt = torch.zeros(S1, S2, dtype=torch.float64)
    if S1 == 0 or S2 == 0:
        return cnt
    s1 = torch.arange(S1)[:, None]
    for j in range(topk_b.shape[1]):
        idx = topk_b[:, j].long()[:, None]
        p = idx * bs + torch.arange(bs)[None, :]
        ok = (idx != -1) & (p >= 0) & (p < S2)
        if causal:
            ok &= p <= s1
        cnt.scatter_add_(1, torch.where(ok, p, 0), ok.to(torch.float64))
    return cnt


def dense_nsa(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    """Differentiable float64 dense NSA: ``(out [T1,N1,Dv], m [T1,N1], l [T1,N1])``."""
    T1, N1, _ = q.shape
    N2 = k.shape[1]
    G = N1 // N2
    outs, ms, ls = [], [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_kv[b], cu_kv[b + 1]
        o_b, m_b, l_b = [], [], []
        for h in range(N1):
            n2 = h // G
            cnt = visibility_counts(topk[qs:qe, n2], qe - qs, ke - ks, bs, causal)
            x = scale * q[qs:qe, h] @ k[ks:ke, n2].T
            seen = cnt > 0
            mx = torch.where(seen, x, float("-inf")).amax(dim=1, keepdim=True) if ke > ks else x.new_zeros(qe - qs, 1)
            mx = torch.where(torch.isfinite(mx), mx, 0.0).detach()
            w = cnt * torch.exp(torch.where(seen, x - mx, float("-inf")))
            l = w.sum(dim=1, keepdim=True)
            o_b.append((w / torch.where(l > 0, l, 1.0)) @ v[ks:ke, n2])
            m_b.append(mx[:, 0])
            l_b.append(l[:, 0])
        outs.append(torch.stack(o_b, dim=1))
        ms.append(torch.stack(m_b, dim=1))
        ls.append(torch.stack(l_b, dim=1))
    return torch.cat(outs), torch.cat(ms), torch.cat(ls)


CASES = [
    # id, seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, bs, K, causal, empty_frac, duplicates
    ("varlen-empty-seq-causal", [5, 0, 40, 33], [7, 3, 40, 50], 6, 2, 16, 8, 16, 3, True, 0.2, True),
    ("varlen-noncausal-G1", [9, 30], [17, 64], 2, 2, 8, 8, 16, 4, False, 0.3, True),
    ("kv-longer-G4-bs32", [20], [70], 4, 1, 12, 4, 32, 2, True, 0.0, False),
    ("no-keys-at-all", [4, 3], [0, 5], 2, 1, 8, 8, 16, 2, False, 0.0, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_dense(case):
    _, sq, skv, N1, N2, Dqk, Dv, bs, K, causal, ef, dup = case
    a = make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=torch.float64,
                        causal=causal, empty_frac=ef, duplicates=dup, seed=3)
    q, k, v, topk = a["query"], a["key"], a["value"], a["topk_indices"]
    cu_q = normalize_cu_seqlens("q", a["actual_seq_qlen"], q.shape[0])
    cu_kv = normalize_cu_seqlens("kv", a["actual_seq_kvlen"], k.shape[0])
    args = (topk, a["scale_value"], bs, cu_q, cu_kv, causal)

    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    out_d, m_d, l_d = dense_nsa(qd, kd, vd, *args)
    out_r, m_r, l_r = reference.forward(q, k, v, *args)
    assert_close(out_r, out_d.detach(), name="out")
    assert_close(m_r, m_d, name="softmax_max")
    assert_close(l_r, l_d, name="softmax_sum")

    dout = torch.randn(out_d.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gq, gk, gv = torch.autograd.grad(out_d, (qd, kd, vd), dout, allow_unused=True)
    gq, gk, gv = (torch.zeros_like(t) if g is None else g for g, t in zip((gq, gk, gv), (q, k, v)))
    dq, dk, dv = reference.backward(q, k, v, out_r, dout, m_r, l_r, *args)
    assert_close(dq, gq, name="dq")
    assert_close(dk, gk, name="dk")
    assert_close(dv, gv, name="dv")


def test_dense_counts_duplicates_twice():
    # the dense oracle itself: slot ids [0, 0] on one token see each of the first bs keys twice
    topk = torch.tensor([[0, 0]], dtype=torch.int32)
    cnt = visibility_counts(topk, 1, 20, 16, causal=False)
    assert cnt[0, :16].eq(2).all() and cnt[0, 16:].eq(0).all()
