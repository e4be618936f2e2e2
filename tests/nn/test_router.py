"""TopKRouter: choice and tie rules, group-limited routing, probs, losses, dtypes, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from sparseops.nn import TopKRouter
from sparseops.nn.reference import moe_reference
from sparseops.testing import assert_close


def _router(E=6, K=2, H=5, **kw):
    r = TopKRouter(H, E, K, dtype=torch.float64, **kw)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(E * 7 + K), dtype=torch.float64))
    return r


def test_ties_go_to_the_lower_expert_id():
    r = TopKRouter(2, 4, 2, dtype=torch.float64)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    out = r(torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64))
    # token 0: experts 1 and 2 tie at the top; token 1: experts 0 and 3 tie at the top
    assert out.indices.tolist() == [[1, 2], [0, 3]]
    assert out.indices.dtype == torch.int32
    torch.testing.assert_close(out.probs, torch.full((2, 2), 0.5, dtype=torch.float64))


def test_group_limited_choice():
    # 3 groups of 2 experts; a group's key is the sum of its two scores: 0.5, 0.75, 0.5
    scores = torch.tensor([[0.5, 0.0, 0.25, 0.5, 0.25, 0.25]], dtype=torch.float64)
    r = TopKRouter(4, 6, 2, num_groups=3, group_topk=1, score_func="sigmoid", dtype=torch.float64)
    assert r.select(scores).tolist() == [[3, 2]]  # group 1 only, in descending score
    r2 = TopKRouter(4, 6, 2, num_groups=3, group_topk=2, dtype=torch.float64)
    # groups 1 and 0 (0 and 2 tie: the lower index); experts 0 and 3 tie at 0.5: the lower id first
    assert r2.select(scores).tolist() == [[0, 3]]


@pytest.mark.parametrize("kw", [
    {},
    {"score_func": "sigmoid", "scaling_factor": 2.5},
    {"norm_topk_prob": False, "aux_loss_coeff": 0.3, "z_loss_coeff": 0.02},
    {"num_groups": 3, "group_topk": 2, "score_func": "sigmoid", "aux_loss_coeff": 0.1},
    {"expert_bias": True, "z_loss_coeff": 0.1},
], ids=["softmax", "sigmoid-scaled", "no-norm-losses", "groups", "bias"])
@pytest.mark.parametrize("T", [0, 1, 17])  # empty batch, one token, odd
def test_router_matches_the_oracle(kw, T):
    r = _router(**kw)
    if r.expert_bias is not None:
        r.expert_bias.copy_(torch.linspace(-0.2, 0.2, 6))
    x = torch.randn(T, 5, generator=torch.Generator().manual_seed(T), dtype=torch.float64, requires_grad=True)
    out = r(x)
    params = {"router": r.weight, "expert_bias": r.expert_bias, "w1": torch.zeros(6, 1, 5, dtype=torch.float64),
              "w3": torch.zeros(6, 1, 5, dtype=torch.float64), "w2": torch.zeros(6, 5, 1, dtype=torch.float64)}
    rk = {k: v for k, v in kw.items() if k != "expert_bias"}
    ref = moe_reference([x], params, top_k=2, **rk)
    assert out.indices.tolist() == ref["indices"][0]
    assert out.tokens_per_expert.tolist() == ref["routed"]
    assert_close(out.aux_loss, ref["aux_loss"], torch.float64, "aux_loss")
    if T and ref["aux_loss"].requires_grad:
        g1 = torch.autograd.grad(out.aux_loss, [x, r.weight])
        g2 = torch.autograd.grad(ref["aux_loss"], [x, r.weight])
        for a, b in zip(g1, g2):
            assert_close(a, b, torch.float64, "aux_loss grad")


@pytest.mark.parametrize("dtype, rdt", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                        (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_router_never_computes_in_16_bit(dtype, rdt):
    r = TopKRouter(8, 4, 2, aux_loss_coeff=0.1, dtype=dtype)
    out = r(torch.randn(3, 2, 8, dtype=dtype))  # leading dims are flattened
    for t in (out.probs, out.scores, out.logits, out.aux_loss):
        assert t.dtype == rdt
    assert out.probs.shape == (6, 2) and out.tokens_per_expert.dtype == torch.int64
    assert out.aux_loss.dim() == 0


def test_losses_on_a_worked_example():
    # two tokens, E = 2, K = 1: logits [0, 0] and [ln 3, 0] -> scores [.5, .5], [.75, .25]
    r = TopKRouter(2, 2, 1, aux_loss_coeff=1.0, z_loss_coeff=1.0, dtype=torch.float64)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64))
    out = r(torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=torch.float64))
    assert out.indices.tolist() == [[0], [0]]
    f = torch.tensor([1.0, 0.0])
    P = torch.tensor([0.625, 0.375])
    z = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    torch.testing.assert_close(out.aux_loss.item(), 2 * float((f * P).sum()) + z)


@pytest.mark.parametrize("args, kw, err, match", [
    ((4, 4, 5), {}, ValueError, "top_k: expected at most num_experts = 4, got 5"),
    ((4, 4, 1), {"score_func": "relu"}, ValueError, "score_func"),
    ((4, 6, 1), {"num_groups": 4, "group_topk": 1}, ValueError, "num_groups: expected a divisor"),
    ((4, 6, 1), {"num_groups": 3}, ValueError, "group_topk"),
    ((4, 6, 3), {"num_groups": 3, "group_topk": 1}, ValueError, "top_k: expected at most the 2 eligible"),
    ((4, 6, 1), {"group_topk": 1}, ValueError, "group_topk"),
    ((4, 6, 1), {"aux_loss_coeff": -1.0}, ValueError, "aux_loss_coeff"),
    ((4, 4, 1), {"scaling_factor": 0.0}, ValueError, r"^scaling_factor: expected a float > 0, got 0\.0$"),
    ((4, 4, 1), {"scaling_factor": -2.5}, ValueError, r"^scaling_factor: expected a float > 0, got -2\.5$"),
    ((4, 4, 1), {"scaling_factor": float("inf")}, ValueError, r"^scaling_factor: expected a finite float, got inf$"),
    ((4, 4, 1), {"scaling_factor": float("nan")}, ValueError, r"^scaling_factor: expected a finite float, got nan$"),
    ((4, 0, 1), {}, ValueError, "num_experts"),
    ((4, 4, 1), {"expert_bias": 1}, TypeError, "expert_bias"),
    ((4, 4, 1), {"dtype": torch.int64}, TypeError, "dtype: expected None or one of"),
])
def test_bad_construction(args, kw, err, match):
    with pytest.raises(err, match=match):
        TopKRouter(*args, **kw)


def test_bad_input():
    r = TopKRouter(4, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., H=4\], got \[3, 5\]"):
        r(torch.randn(3, 5))
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        r(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        r([[0.0] * 4])
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_coo$"):  # was torch's reshape error
        r(torch.randn(3, 4).to_sparse())
    with pytest.raises(ValueError, match="x: expected device cpu"):
        r(torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match="x: expected a tensor with data, got one on the meta device"):
        TopKRouter(4, 4, 2, device="meta")(torch.randn(3, 4, device="meta"))
    with pytest.raises(TypeError, match="group: expected None or a torch.distributed.ProcessGroup"):
        r(torch.randn(3, 4), group="world")
    with pytest.raises(TypeError, match="aux: expected a bool"):
        r(torch.randn(3, 4), aux="no")


def _sort_select(r, scores):
    """The choice's definition (docs/moe-layer.md): the first K of stable descending sorts of groups and keys."""
    key = scores + r.expert_bias.to(scores.dtype) if r.expert_bias is not None else scores
    T, E = key.shape
    if r.num_groups is not None and r.group_topk < r.num_groups:
        G = r.num_groups
        gkey = key.view(T, G, E // G).topk(min(2, E // G), dim=-1).values.sum(-1)
        gbest = torch.sort(gkey, dim=-1, descending=True, stable=True).indices[:, :r.group_topk]
        eligible = torch.zeros(T, G, dtype=torch.bool).scatter_(1, gbest, True)
        key = key.masked_fill(~eligible.repeat_interleave(E // G, dim=1), -math.inf)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :r.top_k]


@pytest.mark.parametrize("E, K, kw", [
    (6, 1, {}), (6, 6, {}), (24, 5, {}), (256, 8, {}), (40, 3, {"expert_bias": True}),
    (24, 4, {"num_groups": 6, "group_topk": 2}), (24, 8, {"num_groups": 6, "group_topk": 2}),
    (30, 2, {"num_groups": 5, "group_topk": 3, "expert_bias": True}), (12, 1, {"num_groups": 12, "group_topk": 1}),
    (256, 8, {"num_groups": 8, "group_topk": 4, "expert_bias": True}),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(v) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_equals_the_stable_sort_on_ties(E, K, kw, dtype):
    # scores on a coarse grid (many exact ties within rows and between group sums), the bias on the same grid
    r = TopKRouter(4, E, K, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(E * 31 + K)
    if r.expert_bias is not None:
        r.expert_bias.copy_(torch.randint(-2, 3, (E,), generator=g) / 8)
    for levels in (2, 5, 64):
        scores = (torch.randint(0, levels, (50, E), generator=g) / levels).to(dtype)
        scores[:3] = 0.25  # rows that are one tie
        got = r.select(scores)
        assert got.dtype == torch.int64 and torch.equal(got, _sort_select(r, scores))


@pytest.mark.parametrize("sync", [False, True], ids=["graph", "sync"])
def test_stable_topk_on_nan_inf_and_signed_zeros(sync):
    from sparseops._topk import stable_topk

    nan, inf = math.nan, math.inf
    vals = torch.tensor([nan, -nan, inf, -inf, 0.0, -0.0, 1.0, 0.5])
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = vals[torch.randint(0, len(vals), (400, 13), generator=g)].to(dtype)
        x[0] = nan
        x[1] = -inf
        for k in (1, 2, 5, 13):
            want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(stable_topk(x, k, sync=sync), want), (dtype, k)
    x = torch.randn(40, 13, generator=g)  # no ties: sync's path without the cumulative count
    assert torch.equal(stable_topk(x, 5, sync=sync), torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :5])
    assert stable_topk(torch.empty(0, 7), 3, sync=sync).shape == (0, 3)


def test_select_compiles_to_one_graph():
    r = TopKRouter(4, 24, 4, num_groups=6, group_topk=3, expert_bias=True)
    r.expert_bias.copy_(torch.arange(24) % 3 / 8)
    scores = torch.randint(0, 4, (33, 24), generator=torch.Generator().manual_seed(1)) / 4
    torch._dynamo.reset()
    got = torch.compile(r.select, fullgraph=True, backend="aot_eager")(scores)  # fullgraph: no host sync
    torch._dynamo.reset()
    assert torch.equal(got, _sort_select(r, scores))
