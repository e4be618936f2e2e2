"""MoELayer under expert parallelism: spawned gloo processes against the float64 per-token oracle.

One spawn of 4 processes runs every case with both dispatchers on EP groups of 2, 3 and 4 of its ranks in turn
(process start-up dominates the time).
Each rank's loss is ``(y_r * g_r).sum() + 3 * aux.loss``; the oracle's is the sum over ranks, so rank r's
x.grad and local-expert grads must equal the oracle's, and the router / shared grads summed over ranks must.
"""

from __future__ import annotations

import pytest
import torch

from sparseops.distributed import spawn
from sparseops.nn import MoELayer, update_expert_bias
from sparseops.nn.reference import moe_reference
from sparseops.testing import TOLERANCES, assert_close

pytestmark = pytest.mark.distributed

H, F, FS = 12, 10, 6
#: the expert FFN size of the replicated-token runs: a multiple of 32, so that no row of the activation ends in
#: the scalar tail of a CPU SIMD loop (whose exp rounds unlike the vector one): the condition of bitwise equality
FR = 32
TIMEOUT = 120.0
AUX = 3.0
DISPATCHERS = ("allgather", "alltoall")

# (name, tokens of ranks 0..3 (the first ws are used), experts per rank, K, dtype, layer keywords, skew)
CASES = [
    # uneven T with T = 0 on rank 0; two local experts each
    ("uneven", (0, 9, 5, 7), 2, 2, torch.float64, {}, False),
    # every token goes to rank 0's experts: the other ranks' experts receive no rows
    ("skewed", (4, 3, 6, 2), 2, 2, torch.float64, {"shared_ffn_size": FS}, True),
    # capacity, both policies, with the losses and a shared expert; one local expert per rank
    ("cap-probs", (8, 5, 7, 6), 1, 2, torch.float64,
     {"capacity_factor": 0.6, "shared_ffn_size": FS, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}, False),
    ("cap-position", (6, 8, 1, 5), 2, 3, torch.float64,
     {"capacity_factor": 0.5, "drop_policy": "position", "aux_loss_coeff": 0.2}, False),
    # sigmoid scores, group-limited choice steered by a bias, scaling
    ("groups-bias", (7, 4, 5, 3), 2, 2, torch.float64,
     {"score_func": "sigmoid", "num_groups": 2, "group_topk": 1, "scaling_factor": 2.0, "expert_bias": True,
      "z_loss_coeff": 0.05}, False),
    # no tokens anywhere
    ("all-empty", (0, 0, 0, 0), 2, 2, torch.float64, {"aux_loss_coeff": 0.1}, False),
    # low precision: repeated runs bitwise, and close to the oracle on the same choices
    ("fp32", (9, 6, 8, 7), 2, 2, torch.float32, {"shared_ffn_size": FS}, False),
    ("bf16", (9, 6, 8, 7), 2, 2, torch.bfloat16, {"capacity_factor": 0.8}, False),
]


def _globals(name: str, E: int, kw: dict, skew: bool, f: int = F) -> dict:
    """Every expert's weights (float64), the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 7 * E)
    p = {"router": torch.randn(E, H, generator=g, dtype=torch.float64) * H ** -0.5,
         "w1": torch.randn(E, f, H, generator=g, dtype=torch.float64) * H ** -0.5,
         "w3": torch.randn(E, f, H, generator=g, dtype=torch.float64) * H ** -0.5,
         "w2": torch.randn(E, H, f, generator=g, dtype=torch.float64) * f ** -0.5,
         "shared": None, "expert_bias": None}
    if kw.get("shared_ffn_size"):
        p["shared"] = (torch.randn(FS, H, generator=g, dtype=torch.float64) * H ** -0.5,
                       torch.randn(FS, H, generator=g, dtype=torch.float64) * H ** -0.5,
                       torch.randn(H, FS, generator=g, dtype=torch.float64) * FS ** -0.5)
    if kw.get("expert_bias"):
        p["expert_bias"] = (torch.randn(E, generator=g, dtype=torch.float64) * 0.1).float().double()
    if skew:  # x has a positive mean: experts 0 and 1 win every token
        p["router"][:2] = 1.0
        p["router"][2:] = -1.0
    return p


def _inputs(name: str, T: int, rank: int, skew: bool):
    g = torch.Generator().manual_seed(1000 * rank + sum(map(ord, name)))
    x = torch.randn(T, H, generator=g, dtype=torch.float64) + (2.0 if skew else 0.0)
    return x, torch.randn(T, H, generator=g, dtype=torch.float64)


def _run(rank, ws, case, dispatcher, group):
    name, tokens, El, K, dtype, kw, skew = case
    E = El * ws
    P = _globals(name, E, kw, skew)
    layer = MoELayer(H, F, E, K, ep_group=group, dispatcher=dispatcher, dtype=dtype, **kw)
    _load(layer, P, rank * El, (rank + 1) * El)
    x0, g0 = _inputs(name, tokens[rank], rank, skew)
    out = []
    for _ in range(2 if dtype != torch.float64 else 1):
        layer.zero_grad(set_to_none=True)
        x = x0.to(dtype).requires_grad_(True)
        y, aux = layer(x)
        ((y * g0.to(dtype)).sum() + AUX * aux.loss).backward()
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in layer.named_parameters()}
        with torch.no_grad():
            _, _, idx, _, _ = layer.router.route(x.detach())
        out.append({"y": y.detach(), "x.grad": x.grad, "grads": grads, "loss": aux.loss.detach(),
                    "kept": aux.tokens_per_expert, "dropped": aux.dropped, "indices": idx.tolist()})
    return out


def _load(layer, P, lo, hi):
    with torch.no_grad():
        layer.router.weight.copy_(P["router"])
        layer.experts.w1.copy_(P["w1"][lo:hi])
        layer.experts.w3.copy_(P["w3"][lo:hi])
        layer.experts.w2.copy_(P["w2"][lo:hi])
        if layer.shared is not None:
            for w, v in zip((layer.shared.w1, layer.shared.w3, layer.shared.w2), P["shared"]):
                w.copy_(v)
        if P["expert_bias"] is not None:
            layer.router.expert_bias.copy_(P["expert_bias"])


def _run_replicated(rank, ws, case, dispatcher, group):
    """``replicated_tokens``: every rank passes the whole batch; also the one-process layer on it, here."""
    name, tokens, El, K, dtype, kw, skew = case
    E = El * ws
    P = _globals(name, E, kw, skew, FR)
    xs, gs = zip(*[_inputs(name, T, q, skew) for q, T in enumerate(tokens[:ws])])
    x0, g0 = torch.cat(xs), torch.cat(gs)
    out = {}
    for key, layer, (lo, hi) in (
            ("ep", MoELayer(H, FR, E, K, ep_group=group, dispatcher=dispatcher, replicated_tokens=True,
                            dtype=dtype, **kw), (rank * El, (rank + 1) * El)),
            ("one", MoELayer(H, FR, E, K, dtype=dtype, **kw), (0, E))):
        _load(layer, P, lo, hi)
        x = x0.to(dtype).requires_grad_(True)
        y, aux = layer(x)
        ((y * g0.to(dtype)).sum() + AUX * aux.loss).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        for n in ("experts.w1", "experts.w3", "experts.w2"):
            grads[n] = grads[n][rank * El:(rank + 1) * El] if key == "one" else grads[n]
        out[key] = {"y": y.detach(), "x.grad": x.grad, "grads": grads, "loss": aux.loss.detach(),
                    "kept": aux.tokens_per_expert, "dropped": aux.dropped}
    return out


def _worker(rank, world, sizes, cases):
    """Every case at each EP group size of ``sizes`` in turn, the group ranks ``[0, ws)`` of the ``world``
    spawned processes (the others wait for the next group): ``{ws: results}`` (``None`` outside the group)."""
    import torch.distributed as dist

    out = {}
    for ws in sizes:
        group = dist.new_group(list(range(ws)))  # a non-default group, as a real EP group would be
        out[ws] = _ep_group_checks(rank, ws, cases, group) if rank < ws else None
    return out


def _ep_group_checks(rank, ws, cases, group):
    res = {}
    for case in cases:
        for d in DISPATCHERS:
            res[(case[0], d)] = _run(rank, ws, case, d, group)
            res[("replicated", case[0], d)] = _run_replicated(rank, ws, case, d, group)
    # replicated tokens that differ between the ranks: every rank fails, none hangs
    for what, x in (("count", torch.randn(3 + (rank == 1), H)),
                    ("routing", torch.randn(5, H, generator=torch.Generator().manual_seed(min(rank, 1))))):
        try:
            MoELayer(H, F, 2 * ws, 2, ep_group=group, replicated_tokens=True)(x)
            res[("replicated-disagree", what)] = None
        except ValueError as exc:
            res[("replicated-disagree", what)] = str(exc)
    # update_expert_bias: counts of the training-mode forwards, summed over the group
    layer = MoELayer(H, F, 2 * ws, 2, ep_group=group, expert_bias=True)
    layer(torch.randn(3 + rank, H))
    layer(torch.randn(rank, H))
    counts = layer.router.local_tokens_per_expert.clone()
    n = update_expert_bias(layer, rate=0.5, group=group)
    res["bias"] = (n, counts, layer.router.expert_bias.clone(), layer.router.local_tokens_per_expert.clone())
    # an EP group that does not divide E
    try:
        MoELayer(H, F, ws + 1, 1, ep_group=group)
        res["indivisible"] = None
    except ValueError as exc:
        res["indivisible"] = str(exc)
    # ranks that disagree on E fail together at the first forward (a ValueError, not a hang)
    bad = MoELayer(H, F, 2 * ws if rank else 4 * ws, 2, ep_group=group)
    try:
        bad(torch.randn(2, H))
        res["disagree"] = None
    except ValueError as exc:
        res["disagree"] = str(exc)
    # ranks that disagree on the dtype: a ValueError too (the exchange of rows of another size aborted gloo)
    dt = torch.float64 if rank == 0 else torch.float32
    try:
        MoELayer(H, F, 2 * ws, 2, ep_group=group, dtype=dt)(torch.randn(2, H, dtype=dt))
        res["dtype-disagree"] = None
    except ValueError as exc:
        res["dtype-disagree"] = str(exc)
    return res


def _expected(case, ws, indices=None):
    name, tokens, El, K, dtype, kw, skew = case
    E = El * ws
    P = _globals(name, E, kw, skew)
    if dtype != torch.float64:  # the oracle runs on the same rounded weights and inputs
        P = {k: (v.to(dtype).double() if isinstance(v, torch.Tensor) else
                 (tuple(t.to(dtype).double() for t in v) if isinstance(v, tuple) else v)) for k, v in P.items()}
    leaves = {"router.weight": P["router"], "experts.w1": P["w1"], "experts.w3": P["w3"], "experts.w2": P["w2"]}
    if P["shared"] is not None:
        leaves.update(zip(("shared.w1", "shared.w3", "shared.w2"), P["shared"]))
    leaves = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
    xs, gs = zip(*[_inputs(name, T, r, skew) for r, T in enumerate(tokens[:ws])])
    xs = [x.to(dtype).double().requires_grad_(True) for x in xs]
    params = {"router": leaves["router.weight"], "w1": leaves["experts.w1"], "w3": leaves["experts.w3"],
              "w2": leaves["experts.w2"], "expert_bias": P["expert_bias"],
              "shared": tuple(leaves[f"shared.w{i}"] for i in (1, 3, 2)) if P["shared"] is not None else None}
    rk = {k: v for k, v in kw.items() if k not in ("shared_ffn_size", "expert_bias")}
    ref = moe_reference(xs, params, top_k=K, indices=indices, **rk)
    loss = sum((y * g.to(dtype).double()).sum() for y, g in zip(ref["ys"], gs)) + AUX * ref["aux_loss"]
    wrt = xs + list(leaves.values())
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
    return ref, grads[:ws], dict(zip(leaves, grads[ws:]))


def _check(case, ws, res, dispatcher):
    name, tokens, El, K, dtype, kw, skew = case
    runs = [res[r][(name, dispatcher)] for r in range(ws)]
    if dtype != torch.float64:  # repeated runs are bitwise equal
        for r in range(ws):
            a, b = runs[r]
            assert torch.equal(a["y"], b["y"]) and torch.equal(a["x.grad"], b["x.grad"]), f"{name} rank {r}"
            for n in a["grads"]:
                assert torch.equal(a["grads"][n], b["grads"][n]), f"{name} rank {r} {n} not bitwise repeatable"
    runs = [r[0] for r in runs]
    indices = None if dtype == torch.float64 else [r["indices"] for r in runs]
    ref, xgrads, pgrads = _expected(case, ws, indices)
    tol_dtype = dtype
    for r, run in enumerate(runs):
        where = f"{name}/{dispatcher} ws={ws} rank {r}"
        assert run["y"].dtype == dtype and run["y"].shape == (tokens[r], H), where
        assert_close(run["y"], ref["ys"][r], tol_dtype, f"{where}: y")
        assert_close(run["x.grad"], xgrads[r], tol_dtype, f"{where}: x.grad")
        for n, g in run["grads"].items():
            assert g is not None, f"{where}: {n} got no gradient"
        for n in ("experts.w1", "experts.w3", "experts.w2"):
            assert_close(run["grads"][n], pgrads[n][r * El:(r + 1) * El], tol_dtype, f"{where}: {n}.grad")
        assert_close(run["loss"], ref["aux_loss"], run["loss"].dtype, f"{where}: aux loss")
        assert run["kept"].tolist() == ref["kept"] and run["dropped"] == ref["dropped"], where
    for n in pgrads:
        if n.startswith(("router", "shared")):
            total = sum(run["grads"][n].double() for run in runs)
            assert_close(total, pgrads[n], tol_dtype, f"{name}/{dispatcher} ws={ws}: sum over ranks of {n}.grad")


def _check_replicated(case, ws, res, dispatcher):
    """Every rank returns the one-process numbers for the whole batch: bitwise with alltoall (each token's
    outputs summed on its own rank in k order), within the dtype's tolerance with allgather (rank order)."""
    name, dtype = case[0], case[4]
    for r in range(ws):
        run = res[r][("replicated", name, dispatcher)]
        ep, one = run["ep"], run["one"]
        where = f"replicated {name}/{dispatcher} ws={ws} rank {r}"
        pairs = [("y", ep["y"], one["y"]), ("x.grad", ep["x.grad"], one["x.grad"]),
                 ("aux loss", ep["loss"], one["loss"])]
        pairs += [(f"{n}.grad", ep["grads"][n], one["grads"][n]) for n in one["grads"]]
        for what, a, b in pairs:
            if dispatcher == "alltoall":
                assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {what} not bitwise the one-process one"
            else:
                assert_close(a.double(), b.double(), dtype, f"{where}: {what}")
        assert ep["kept"].tolist() == one["kept"].tolist() and ep["dropped"] == one["dropped"], where
        # the replicated parameters' gradients are the same on every rank: nothing to all-reduce
        for n in one["grads"]:
            if not n.startswith("experts."):
                assert torch.equal(ep["grads"][n], res[0][("replicated", name, dispatcher)]["ep"]["grads"][n]), where


#: the EP group sizes: one spawn of the largest runs them all in turn (process start-up dominates the time)
SIZES = (2, 3, 4)


@pytest.fixture(scope="module")
def runs() -> list:
    return spawn(_worker, max(SIZES), SIZES, CASES, timeout=TIMEOUT * len(SIZES))


@pytest.mark.parametrize("ws", SIZES, ids=lambda w: f"ws{w}")
def test_ep_layer_matches_oracle(ws, runs):
    assert all(r[ws] is None for r in runs[ws:])
    res = [r[ws] for r in runs[:ws]]
    failures = []
    for case in CASES:
        for d in DISPATCHERS:
            for check in (_check, _check_replicated):
                try:
                    check(case, ws, res, d)
                except AssertionError as exc:
                    failures.append(str(exc))
    for r in res:
        assert "x: expected the same tokens on every rank" in (r[("replicated-disagree", "count")] or "")
        assert "different routing" in (r[("replicated-disagree", "routing")] or "")
    # update_expert_bias: the same bias everywhere, from the group's counts
    n, _, bias0, left = res[0]["bias"]
    total = sum(r["bias"][1] for r in res).double()
    b = 0.5 * torch.sign(total.mean() - total)
    b -= b.mean()
    assert n == 1 and left.sum() == 0
    for r in res:
        assert torch.equal(r["bias"][2], bias0)
    torch.testing.assert_close(bias0.double(), b, atol=1e-6, rtol=0)
    for r in res:
        assert "ep_group: expected a group size that divides num_experts" in (r["indivisible"] or "")
        assert r["disagree"] is not None and "num_experts: expected the same value on every rank" in r["disagree"]
        assert "dtype: expected the same value on every rank of ep_group, got torch.float" in (r["dtype-disagree"] or "")
    assert not failures, "\n".join(failures)


def test_oracle_tolerance_table_covers_the_layer():
    assert set(TOLERANCES) >= {torch.float64, torch.float32, torch.bfloat16}
