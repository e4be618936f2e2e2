"""DeepSeekSparseAttention against a dense float64 oracle from its own parameters (output, the indexer loss and
every parameter gradient), causality, packing invariance, the indexer trained only by its loss, bad input."""

import copy

import pytest
import torch
import torch.nn.functional as F

from sparseops.dsa import indexer_kl_loss, indexer_topk
from sparseops.nn import DeepSeekSparseAttention
from sparseops.testing import assert_close


def _rope(x, pos, theta):
    D = x.shape[-1]
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])
    ang = pos.double()[:, None, None] * theta ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((z.real, z.imag), -1)


def oracle(m, x, cu):
    """Dense per-sequence float64: the [S, S] indexer scores, a stable sort for the top-k, masked softmax."""
    ys, losses = [], []
    N1, N2, Dqk, Dv, Hi, Di = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim, m.index_heads, m.index_head_dim
    for a, b in zip(cu[:-1], cu[1:]):
        xs = x[a:b]
        S = b - a
        pos = torch.arange(S)
        q = (xs @ m.q_proj.weight.T).view(S, N1, Dqk)
        kv = xs @ m.kv_proj.weight.T
        k, v = kv[:, :N2 * Dqk].reshape(S, N2, Dqk), kv[:, N2 * Dqk:].reshape(S, N2, Dv)
        xi = xs.detach()
        qi = (xi @ m.index_q_proj.weight.T).view(S, Hi, Di) / Di ** 0.5
        ki = F.layer_norm(xi @ m.index_k_proj.weight.T, (Di,), m.index_k_norm.weight, m.index_k_norm.bias)
        wi = (xi @ m.index_w_proj.weight.T) / Hi ** 0.5
        if m.rope_theta is not None:
            q, k, qi = (_rope(t, pos, m.rope_theta) for t in (q, k, qi))
            ki = _rope(ki[:, None], pos, m.rope_theta)[:, 0]
        causal = pos[None, :] <= pos[:, None]
        I = torch.einsum("th,ths->ts", wi, torch.relu(torch.einsum("thd,sd->ths", qi, ki)))
        I = I.masked_fill(~causal, float("-inf"))
        order = torch.sort(I.detach(), dim=1, descending=True, stable=True).indices[:, :m.topk]
        sel = torch.zeros(S, S, dtype=torch.bool)
        sel.scatter_(1, order, True)
        sel &= causal
        kk, vv = k.repeat_interleave(N1 // N2, 1), v.repeat_interleave(N1 // N2, 1)
        logits = torch.einsum("thd,shd->hts", q, kk) * m.scale
        att = torch.softmax(logits.masked_fill(~sel, float("-inf")), dim=-1)
        ys.append(torch.einsum("hts,shd->thd", att, vv).reshape(S, N1 * Dv) @ m.o_proj.weight.T)
        p = att.detach().mean(0)
        logq = torch.log_softmax(I.masked_fill(~sel, float("-inf")), dim=-1)
        losses.append(torch.where(sel, p * (torch.log(p.clamp_min(1e-300)) - logq), 0.0).sum())
    return torch.cat(ys), sum(losses) / x.shape[0]


CONFIGS = [
    ("mqa-G8-rope-varlen", dict(num_heads=8, num_kv_heads=1, head_dim=16, v_head_dim=8, topk=5, index_heads=3,
                                index_head_dim=8, rope_theta=10000.0), [0, 13, 13, 40]),
    ("gqa-topk-above-len", dict(num_heads=4, num_kv_heads=2, head_dim=8, topk=64, index_heads=2, index_head_dim=4),
     [0, 30]),
]


@pytest.mark.parametrize("cfg, cu", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_matches_dense_oracle(cfg, cu):
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(24, **cfg, dtype=torch.float64)
    with torch.no_grad():
        m.index_k_norm.weight.uniform_(0.5, 1.5)
        m.index_k_norm.bias.normal_(0, 0.1)
    x = torch.randn(cu[-1], 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(cu[-1], 24, dtype=torch.float64)
    y, info = m(x, torch.tensor(cu, dtype=torch.int32), return_info=True)
    ((y * g).sum() + info["indexer_loss"]).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    got_x = x.grad.clone()
    m.zero_grad()
    x.grad = None
    ry, rloss = oracle(m, x, cu)
    ((ry * g).sum() + rloss).backward()
    assert_close(y, ry, torch.float64, name="y")
    assert_close(info["indexer_loss"], rloss, torch.float64, name="indexer_loss")
    assert_close(got_x, x.grad, torch.float64, name="dx")
    for n, p in m.named_parameters():
        assert_close(got[n], p.grad, torch.float64, name=f"d{n}")
    assert info["indices"].shape == (cu[-1], cfg["topk"])


def test_indexer_trains_only_on_its_loss_and_the_model_not_on_it():
    torch.manual_seed(1)
    m = DeepSeekSparseAttention(16, 4, 1, 8, topk=3, index_heads=2, index_head_dim=4)
    x = torch.randn(20, 16, requires_grad=True)
    y, info = m(x, return_info=True)
    y.sum().backward()
    assert all(p.grad is None for n, p in m.named_parameters() if n.startswith("index_"))
    m.zero_grad()
    x.grad = None
    info = m(x, return_info=True)[1]
    info["indexer_loss"].backward()
    assert x.grad is None
    assert all(p.grad is None for n, p in m.named_parameters() if not n.startswith("index_"))
    assert m.index_q_proj.weight.grad.abs().sum() > 0


def test_causal_and_packing_invariant():
    torch.manual_seed(2)
    m = DeepSeekSparseAttention(16, 4, 1, 8, topk=4, index_heads=2, index_head_dim=4, rope_theta=100.0,
                                dtype=torch.float64)
    x = torch.randn(30, 16, dtype=torch.float64)
    y = m(x, [0, 12, 30])
    x2 = x.clone()
    x2[20:] += 1.0  # later tokens of the second sequence
    assert torch.equal(m(x2, [0, 12, 30])[:20], y[:20])
    assert_close(m(x[12:]), y[12:], torch.float64)


WARMUP_CASES = [  # (cfg, cu_seqlens)
    pytest.param(dict(num_heads=4, num_kv_heads=1, head_dim=8, v_head_dim=6, index_heads=3, index_head_dim=4,
                      rope_theta=100.0), [0, 0, 7, 7, 19], id="mqa-rope-empty-seqs"),
    pytest.param(dict(num_heads=80, num_kv_heads=2, head_dim=4, index_heads=2, index_head_dim=4), [0, 9, 21],
                 id="G40-repeated-kv-heads"),  # the dense attention's groups hold at most 32 query heads
]


@pytest.mark.parametrize("cfg, cu", WARMUP_CASES)
def test_dense_warmup_is_the_every_key_selection(cfg, cu):
    """``dense_warmup``: y, the indexer loss, dx and every parameter's gradient those of the same layer selecting
    every visible key (topk = the longest sequence, checked against the oracles above), in float64; its topk
    unused, its info the loss alone."""
    torch.manual_seed(0)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    m = DeepSeekSparseAttention(12, **cfg, topk=longest, dtype=torch.float64)
    warm = copy.deepcopy(m)
    warm.dense_warmup, warm.topk = True, 1
    x = torch.randn(cu[-1], 12, dtype=torch.float64)
    gy = torch.randn(cu[-1], 12, dtype=torch.float64)
    got = []
    for mod in (warm, m):
        xi = x.clone().requires_grad_()
        y, info = mod(xi, cu, return_info=True)
        ((y * gy).sum() + info["indexer_loss"]).backward()
        got.append((y, info, xi.grad, {n: p.grad for n, p in mod.named_parameters()}))
    (y, info, dx, grads), (y_ref, info_ref, dx_ref, grads_ref) = got
    assert set(info) == {"indexer_loss"} and "dense_warmup=True" in repr(warm)
    assert_close(y, y_ref, name="y")
    assert_close(info["indexer_loss"], info_ref["indexer_loss"], name="indexer_loss")
    assert_close(dx, dx_ref, name="dx")
    for n, g in grads.items():
        assert_close(g, grads_ref[n], name=f"d{n}")


def test_dense_warmup_past_2048_tokens():
    """The warm-up at 2100 tokens, past the 2048 keys the selected attention takes: y the dense causal attention
    (SDPA per sequence) and the indexer loss and its gradients those of indexer_kl_loss over every listed key, in
    float64."""
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(8, 2, 1, 4, topk=16, index_heads=1, index_head_dim=4, dense_warmup=True,
                                dtype=torch.float64)
    cu = [0, 2090, 2100]
    x = torch.randn(cu[-1], 8, dtype=torch.float64)
    y, info = m(x, cu, return_info=True)
    info["indexer_loss"].backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if n.startswith("index_")}
    m.zero_grad()
    with torch.no_grad():
        q = m.q_proj(x).view(-1, 2, 4)
        k, v = m.kv_proj(x).view(-1, 1, 8).split([4, 4], dim=-1)
        o = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
                       for a, b in zip(cu[:-1], cu[1:])], dim=1).transpose(0, 1)
    assert_close(y, m.o_proj(o.reshape(-1, 8)), name="y")
    indices, scores = indexer_topk(*m.indexer(x, None), 2090, cu_seqlens=cu)
    want = indexer_kl_loss(q, k, indices, scores, scale=m.scale, head_num=2, cu_seqlens=cu)
    want.backward()
    assert_close(info["indexer_loss"], want, name="indexer_loss")
    for n, g in got.items():
        assert_close(g, m.get_parameter(n).grad, name=f"d{n}")


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=2049), ValueError, "topk"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(head_dim=300), ValueError, "head_dim"),
    (dict(v_head_dim=32), ValueError, "v_head_dim"),
    (dict(rope_theta=10.0, index_head_dim=5), ValueError, "index_head_dim"),
    (dict(detach_indexer_input=1), TypeError, "detach_indexer_input"),
    (dict(dense_warmup=None), TypeError, "dense_warmup: expected a bool"),
    (dict(dtype=torch.int32), TypeError, "dtype: expected None or one of"),
])
def test_bad_config(kw, exc, msg):
    args = dict(hidden_size=16, num_heads=4, num_kv_heads=1, head_dim=16, topk=4)
    args.update(kw)
    with pytest.raises(exc, match=msg):
        DeepSeekSparseAttention(**args)


def test_bad_input():
    m = DeepSeekSparseAttention(16, 4, 1, 8, topk=4)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(5, 8))
    with pytest.raises(TypeError, match="x"):
        m(torch.randn(5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_coo"):
        m(torch.randn(5, 16).to_sparse())
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(5, 16), [0, 4])
    with pytest.raises(ValueError, match="x: expected device cpu"):
        m(torch.randn(5, 16, device="meta"))
    with pytest.raises(ValueError, match="x: expected a tensor with data, got one on the meta device"):
        DeepSeekSparseAttention(16, 4, 1, 8, topk=4, device="meta")(torch.randn(5, 16, device="meta"))


@pytest.mark.parametrize("kernels", ["cpu-kernels", "torch"])
def test_bf16_autocast_is_the_bf16_copy(kernels, monkeypatch):
    """fp32 parameters under ``torch.autocast(bf16)``, on the C++ kernels and on the torch path: y and the
    attention's gradients bitwise what a bf16 copy computes (autocast re-types none of the ops' own fp32
    products: the indexer's scores, the attention's accumulation), the indexer loss in fp32, every gradient in
    fp32. The indexer's key norm runs in fp32 under autocast (a LayerNorm): its path may differ from the copy."""
    if kernels == "torch":
        monkeypatch.setenv("SPARSEOPS_CPU_KERNELS", "0")
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(32, 4, 1, 16, topk=16, index_heads=2, index_head_dim=16, rope_theta=1e4)
    low = copy.deepcopy(m).bfloat16()
    cu = torch.tensor([0, 70, 133], dtype=torch.int32)
    x = torch.randn(133, 32)
    xs = (x.clone().requires_grad_(), x.bfloat16().requires_grad_())
    outs = []
    for mod, xi, ac in ((m, xs[0], True), (low, xs[1], False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            y, info = mod(xi, cu, return_info=True)
        (y.float().pow(2).sum() + info["indexer_loss"]).backward()
        outs.append((y, info))
    (y, info), (y_low, info_low) = outs
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_low)
    assert info["indexer_loss"].dtype == torch.float32 and torch.isfinite(info["indexer_loss"])
    assert torch.equal(xs[0].grad, xs[1].grad.float())
    for (n, p), q in zip(m.named_parameters(), low.parameters()):
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n
        if not n.startswith("index_k_"):
            assert torch.equal(p.grad, q.grad.float()), n


def test_autocast_with_an_fp32_norm_as_on_cuda(monkeypatch):
    """CUDA's autocast runs LayerNorm in fp32 (the CPU's keeps bf16): the indexer's key then comes in fp32 beside
    its bf16 queries; the layer hands the top-k one dtype, the queries' (emulated here by an fp32 norm)."""
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(32, 4, 1, 16, topk=16, index_heads=2, index_head_dim=16)
    norm = m.index_k_norm.forward
    monkeypatch.setattr(m.index_k_norm, "forward", lambda t: norm(t).float())
    x = torch.randn(50, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, info = m(x, [0, 20, 50], return_info=True)
    assert y.dtype == torch.bfloat16 and torch.isfinite(info["indexer_loss"])


# a per-token float64 oracle straight from docs/dsa.md, on both CPU paths, float64 and fp32


def token_oracle(P, m, x, cu, selection=None):
    """Per query token in float64 from the parameters ``P``: the indexer scores over the keys ``s <= t`` of the
    token's sequence, the exact top-k (descending, ties to the smaller position) unless ``selection`` (the layer's
    ``indices``) is given, each head's softmax over the selected keys, and the indexer loss
    ``(1 / T) sum_t KL(p_t || softmax(I_t[S_t]))`` with ``p_t`` the head mean, a constant. The indexer reads
    ``x.detach()`` only when the layer does. Returns ``(y, loss, the selection as lists)``."""
    N1, N2, Dqk, Dv, Hi, Di = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim, m.index_heads, m.index_head_dim
    G, theta = N1 // N2, m.rope_theta
    ys, sels, loss = [], [], x.new_zeros(())
    for a, b in zip(cu[:-1], cu[1:]):
        S, xs = b - a, x[a:b]
        pos = torch.arange(S)
        q = (xs @ P["q_proj.weight"].T).view(S, N1, Dqk)
        k, v = (xs @ P["kv_proj.weight"].T).split([N2 * Dqk, N2 * Dv], dim=-1)
        k, v = k.reshape(S, N2, Dqk), v.reshape(S, N2, Dv)
        xi = xs.detach() if m.detach_indexer_input else xs
        qi = (xi @ P["index_q_proj.weight"].T).view(S, Hi, Di) / Di ** 0.5
        ki = F.layer_norm(xi @ P["index_k_proj.weight"].T, (Di,), P["index_k_norm.weight"], P["index_k_norm.bias"])
        wi = (xi @ P["index_w_proj.weight"].T) / Hi ** 0.5
        if theta is not None:
            q, k, qi = (_rope(t, pos, theta) for t in (q, k, qi))
            ki = _rope(ki[:, None], pos, theta)[:, 0]
        for t in range(S):
            score = torch.stack([(wi[t] * torch.relu(qi[t] @ ki[s])).sum() for s in range(t + 1)])
            if selection is None:
                vals = score.tolist()
                sel = sorted(range(t + 1), key=lambda s: (-vals[s], s))[:m.topk]
            else:
                sel = [s for s in selection[a + t].tolist() if s >= 0]
            sels.append(sel)
            heads, probs = [], []
            for h in range(N1):
                p = torch.softmax(torch.stack([q[t, h] @ k[s, h // G] for s in sel]) * m.scale, 0)
                heads.append(sum(p[j] * v[s, h // G] for j, s in enumerate(sel)))
                probs.append(p.detach())
            ys.append(torch.cat(heads) @ P["o_proj.weight"].T)
            target = torch.stack(probs).mean(0)
            loss = loss + (target * (target.log() - torch.log_softmax(score[sel], 0))).sum()
    return torch.stack(ys), loss / x.shape[0], sels


MQA = dict(num_heads=4, num_kv_heads=1, head_dim=8, v_head_dim=6, index_heads=3, index_head_dim=4, rope_theta=100.0)
GQA = dict(num_heads=6, num_kv_heads=3, head_dim=8, index_heads=2, index_head_dim=6)
TOKEN_CASES = [  # (cfg, topk, cu_seqlens): empty sequences first, inside and last; sequences shorter than topk
    pytest.param(MQA, 4, [0, 0, 3, 3, 14, 20, 20], id="mqa-rope-empty-and-short-seqs"),
    pytest.param(GQA, 5, [0, 9, 9, 21], id="gqa"),
    pytest.param(GQA, 1, [0, 5, 5, 16], id="gqa-topk1"),
    pytest.param(MQA, 12, [0, 7, 7, 19], id="mqa-topk-equals-longest"),
    pytest.param(MQA, 40, [0, 0, 7, 19], id="mqa-topk-above-longest"),
]


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "attached"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cfg, topk, cu", TOKEN_CASES)
def test_matches_per_token_oracle(cfg, topk, cu, dtype, detach):
    """y, the indexer loss, x.grad and every parameter's gradient against ``token_oracle`` at the tolerance of the
    dtype; float64 also checks the selection (the oracle's own top-k), fp32 gives the oracle the layer's
    selection so that near-ties cannot flip it. With ``detach_indexer_input=False`` the loss reaches x."""
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(12, **cfg, topk=topk, detach_indexer_input=detach, dtype=torch.float64)
    with torch.no_grad():
        m.index_k_norm.weight.uniform_(0.5, 1.5)
        m.index_k_norm.bias.normal_(0, 0.1)
    m = m.to(dtype)
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(cu[-1], 12, generator=g, dtype=torch.float64).to(dtype).double()
    gy = torch.randn(cu[-1], 12, generator=g, dtype=torch.float64).to(dtype).double()
    x = x64.to(dtype).clone().requires_grad_()
    y, info = m(x, torch.tensor(cu, dtype=torch.int32), return_info=True)
    ((y * gy.to(dtype)).sum() + info["indexer_loss"]).backward()
    P = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    xr = x64.clone().requires_grad_()
    given = info["indices"] if dtype != torch.float64 else None
    ry, rloss, sels = token_oracle(P, m, xr, cu, selection=given)
    ((ry * gy).sum() + rloss).backward()
    if given is None:
        assert [[s for s in row if s >= 0] for row in info["indices"].tolist()] == sels
    assert_close(y, ry, dtype, name="y")
    assert_close(info["indexer_loss"], rloss, dtype, name="indexer_loss")
    assert_close(x.grad, xr.grad, dtype, name="dx")
    for n, p in m.named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        assert_close(got, torch.zeros_like(P[n]) if P[n].grad is None else P[n].grad, dtype, name=f"d{n}")
    if topk == 1:  # one key per query: the loss and every indexer gradient exactly 0 (docs/dsa.md)
        assert info["indexer_loss"].item() == 0
        assert all(p.grad is None or not p.grad.any() for n, p in m.named_parameters() if n.startswith("index_"))


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_ties_select_the_smaller_positions(dtype):
    """A zero indexer weight makes every visible key score 0: each query selects its first ``min(topk, t + 1)``
    positions, and the layer still matches the oracle (whose weights' gradient is not 0)."""
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(12, **GQA, topk=5, dtype=dtype)
    torch.nn.init.zeros_(m.index_w_proj.weight)
    cu = [0, 9, 9, 21]
    x = torch.randn(21, 12, dtype=dtype, requires_grad=True)
    y, info = m(x, torch.tensor(cu, dtype=torch.int32), return_info=True)
    (y.sum() + info["indexer_loss"]).backward()
    want = [list(range(min(5, t - a + 1))) for a, b in zip(cu[:-1], cu[1:]) for t in range(a, b)]
    assert [[s for s in row if s >= 0] for row in info["indices"].tolist()] == want
    P = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    xr = x.detach().double().requires_grad_()
    ry, rloss, _ = token_oracle(P, m, xr, cu, selection=None)
    (ry.sum() + rloss).backward()
    assert_close(y, ry, dtype, name="y")
    assert_close(info["indexer_loss"], rloss, dtype, name="indexer_loss")
    assert_close(m.index_w_proj.weight.grad, P["index_w_proj.weight"].grad, dtype, name="dindex_w_proj.weight")
    assert P["index_w_proj.weight"].grad.abs().sum() > 0
