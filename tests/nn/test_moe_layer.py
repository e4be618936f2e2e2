"""MoELayer in one process against the float64 per-token oracle (float64, and every gradient in fp32 / fp16 /
bf16); capacity; balancing; bad input.

Expert parallelism (several processes) is tested in tests/distributed/test_moe_layer_ep.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sparseops.nn import MoELayer, SharedExpert, update_expert_bias
from sparseops.nn.capacity import drop_to_sink
from sparseops.nn.reference import moe_reference
from sparseops.testing import assert_close, tolerance

H, F, E = 10, 6, 8


def _params(layer):
    p = {"router": layer.router.weight, "expert_bias": layer.router.expert_bias, "w1": layer.experts.w1,
         "w3": layer.experts.w3, "w2": layer.experts.w2, "shared": None}
    if layer.shared is not None:
        p["shared"] = (layer.shared.w1, layer.shared.w3, layer.shared.w2)
    return p


def _oracle_kw(kw):
    return {k: v for k, v in kw.items() if k not in ("shared_ffn_size", "expert_bias", "backend")}


CASES = {
    "plain": {},
    "capacity-probs": {"capacity_factor": 0.5, "aux_loss_coeff": 0.1},
    "capacity-position": {"capacity_factor": 0.75, "drop_policy": "position", "z_loss_coeff": 0.01},
    "shared-losses": {"shared_ffn_size": 5, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01},
    "sigmoid-groups": {"score_func": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5},
    "gelu": {"activation": "gelu"},
    "bias": {"expert_bias": True},
    "reference-backend": {"backend": "reference", "capacity_factor": 0.5},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [0, 1, 13])  # empty batch, one token, odd
def test_layer_matches_the_oracle_float64(name, T):
    kw = CASES[name]
    torch.manual_seed(T)
    layer = MoELayer(H, F, E, 3, dtype=torch.float64, **kw)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(T, H, dtype=torch.float64)
    y, aux = layer(x)
    ref = moe_reference([x], _params(layer), top_k=3, **_oracle_kw(kw))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, ref["ys"][0], torch.float64, "y")
    assert_close(aux.loss, ref["aux_loss"], torch.float64, "aux.loss")
    assert aux.tokens_per_expert.tolist() == ref["kept"] and aux.dropped == ref["dropped"]
    wrt = [x] + list(layer.parameters())
    got = torch.autograd.grad((y * gy).sum() + 2 * aux.loss, wrt)  # raises if any parameter has no gradient
    lr = (ref["ys"][0] * gy).sum() + 2 * ref["aux_loss"]
    exp = torch.autograd.grad(lr, wrt, allow_unused=True) if lr.requires_grad else [None] * len(wrt)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for n, a, b, w in zip(names, got, exp, wrt):
        assert_close(a, torch.zeros_like(w) if b is None else b, torch.float64, f"{n}.grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_close_and_bitwise_repeatable(dtype):
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, 2, shared_ffn_size=4, capacity_factor=0.9, dtype=dtype)
    x0 = torch.randn(2, 11, H).to(dtype)  # leading dims are flattened
    runs = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y, aux = layer(x)
        y.float().pow(2).sum().backward()
        runs.append([y, x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with torch.no_grad():
        idx = layer.router.route(x0.reshape(-1, H))[2].tolist()
    params = {k: (v.detach().double().requires_grad_(True) if isinstance(v, torch.Tensor) else
                  (tuple(t.detach().double().requires_grad_(True) for t in v) if isinstance(v, tuple) else v))
              for k, v in _params(layer).items()}
    xd = x0.reshape(-1, H).double().requires_grad_(True)
    ref = moe_reference([xd], params, top_k=2, capacity_factor=0.9, indices=[idx])
    y, x_grad = runs[0][0], runs[0][1]
    assert y.shape == x0.shape and y.dtype == dtype
    assert_close(y.reshape(-1, H), ref["ys"][0], dtype, "y")
    ref_grad = torch.autograd.grad((ref["ys"][0].to(dtype).double() ** 2).sum(), xd)[0]
    assert_close(x_grad.reshape(-1, H), ref_grad, dtype, "x.grad")


# (top_k, layer kwargs): what each low-precision case adds; K = 1 with normalised probs: p = s / s = 1, so the
# routed path gives the router no gradient (the expert bias is a buffer: it has none either)
LOW_CASES = {
    "plain-K3": (3, {}),
    "shared-aux-z": (3, {"shared_ffn_size": 5, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}),
    "capacity-position": (2, {"capacity_factor": 0.75, "drop_policy": "position", "z_loss_coeff": 0.01}),
    "sigmoid-groups": (2, {"score_func": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5}),
    "gelu-shared": (2, {"activation": "gelu", "shared_ffn_size": 4}),
    "K1-normalised-bias": (1, {"expert_bias": True}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(LOW_CASES))
def test_low_precision_gradients_match_the_oracle(name, dtype):
    """y, the aux loss, x.grad and every parameter's gradient of a ``dtype`` layer against the float64 oracle on
    the same values and the layer's own choices (a near-tie may flip between dtypes), within the table's
    tolerance. H = 32, T = 64: at H = 10 the bf16 router gradient's error reaches the tolerance. K = 1
    normalised: the exact router gradient is 0, so its size is bounded instead, by the tolerance times the
    gradient the same loss gives the router without the normalisation."""
    K, kw = LOW_CASES[name]
    Hd, Fd, T = 32, 16, 64
    torch.manual_seed(0)
    layer64 = MoELayer(Hd, Fd, E, K, dtype=torch.float64, **kw)
    with torch.no_grad():
        if layer64.router.expert_bias is not None:
            layer64.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
        for p in layer64.parameters():
            p.copy_(p.to(dtype))
    layer = copy.deepcopy(layer64).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, Hd, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    gy = torch.randn(T, Hd, generator=g, dtype=torch.float64).to(dtype)
    y, aux = layer(x)
    wrt = [x] + list(layer.parameters())
    got = torch.autograd.grad((y.float() * gy.float()).sum() + 2 * aux.loss.float(), wrt)
    with torch.no_grad():
        idx = layer.router.route(x)[2].tolist()
    xd = x.detach().double().requires_grad_(True)
    okw = dict(_oracle_kw(kw), top_k=K, indices=[idx])
    ref = moe_reference([xd], _params(layer64), **okw)
    assert ref["kept"] == aux.tokens_per_expert.tolist()
    assert_close(y, ref["ys"][0], dtype, "y")
    assert_close(aux.loss, ref["aux_loss"], dtype, "aux.loss")
    wrt64 = [xd] + list(layer64.parameters())
    exp = torch.autograd.grad((ref["ys"][0] * gy.double()).sum() + 2 * ref["aux_loss"], wrt64, allow_unused=True)
    for (n, _), a, b, w in zip([("x", None), *layer.named_parameters()], got, exp, wrt64):
        assert a.dtype == dtype, n
        if K == 1 and n == "router.weight":
            unnorm = moe_reference([xd], _params(layer64), norm_topk_prob=False, **okw)
            (scale,) = torch.autograd.grad((unnorm["ys"][0] * gy.double()).sum(), w)
            size = a.double().pow(2).mean().sqrt().item()
            assert size <= tolerance(dtype) * scale.pow(2).mean().sqrt().item(), (n, size)
            continue
        assert_close(a, torch.zeros_like(w) if b is None else b, dtype, f"{n}.grad")


def test_drop_to_sink_worked_example():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    assert drop_to_sink(idx, probs, 3, 2, "position").tolist() == [[0, 1], [0, 2], [3, 1]]
    assert drop_to_sink(idx, probs, 3, 2, "probs").tolist() == [[0, 1], [0, 2], [3, 1]]
    # probs decide: token 2's slot for expert 0 now beats token 0's
    probs2 = torch.tensor([[0.4, 0.6], [0.7, 0.3], [0.5, 0.5]])
    assert drop_to_sink(idx, probs2, 3, 2, "probs").tolist() == [[3, 1], [0, 2], [0, 1]]
    # ties on probs: the lower token index is kept
    probs3 = torch.full((3, 2), 0.5)
    assert drop_to_sink(idx, probs3, 3, 1, "probs").tolist() == [[0, 1], [3, 2], [3, 3]]


def test_update_expert_bias_one_process():
    torch.manual_seed(0)
    layer = MoELayer(H, F, 4, 1, expert_bias=True)
    layer.train()
    layer(torch.randn(9, H))
    layer.eval()
    layer(torch.randn(50, H))  # eval-mode forwards are not counted
    c = layer.router.local_tokens_per_expert.clone()
    assert int(c.sum()) == 9
    assert update_expert_bias(torch.nn.Sequential(layer), rate=0.25) == 1
    b = 0.25 * torch.sign(c.double().mean() - c.double())
    torch.testing.assert_close(layer.router.expert_bias.double(), b - b.mean())
    assert int(layer.router.local_tokens_per_expert.sum()) == 0
    assert update_expert_bias(torch.nn.Linear(2, 2)) == 0
    with pytest.raises(ValueError, match="rate"):
        update_expert_bias(layer, rate=-1.0)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got list"):
        update_expert_bias([layer])
    with pytest.raises(TypeError, match="^group: expected None or a torch.distributed.ProcessGroup, got int"):
        update_expert_bias(layer, group=1)


@pytest.mark.parametrize("kw, err, match", [
    ({"dispatcher": "ring"}, ValueError, "dispatcher: expected one of"),
    ({"drop_policy": "random"}, ValueError, "drop_policy: expected one of"),
    ({"activation": "relu"}, ValueError, "activation: expected one of"),
    ({"capacity_factor": 0.0}, ValueError, "capacity_factor: expected None or a number > 0"),
    ({"capacity_factor": -1}, ValueError, "capacity_factor"),
    ({"score_func": "tanh"}, ValueError, "score_func"),
    ({"num_groups": 3, "group_topk": 1}, ValueError, "num_groups: expected a divisor of num_experts = 8"),
    ({"top_k": 9}, ValueError, "top_k: expected at most num_experts = 8, got 9"),
    ({"shared_ffn_size": -1}, ValueError, "shared_ffn_size"),
    ({"backend": "cuda"}, ValueError, "backend: expected one of"),
    ({"dtype": torch.int32}, TypeError, "dtype: expected None or one of"),
    ({"ep_group": 1}, TypeError, "^ep_group: expected None or a torch.distributed.ProcessGroup, got int"),
])
def test_bad_construction(kw, err, match):
    args = {"top_k": 2} | kw
    with pytest.raises(err, match=match):
        MoELayer(H, F, E, args.pop("top_k"), **args)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_bad_input():
    layer = MoELayer(H, F, E, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., H=10\], got \[4, 9\]"):
        layer(torch.randn(4, 9))
    with pytest.raises(TypeError, match="x: expected dtype torch.float32 \\(the experts' weights\\)"):
        layer(torch.randn(4, H, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        layer(torch.ones(4, H, dtype=torch.int32))
    # a sparse x died in the router's reshape ("not implemented for sparse tensors", "do not have is_contiguous")
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_coo$"):
        layer(torch.randn(4, H).to_sparse())
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_csr$"):
        layer(torch.randn(4, H).to_sparse_csr())
    with pytest.raises(ValueError, match="x: expected a tensor with data, got one on the meta device"):
        MoELayer(H, F, E, 2, device="meta")(torch.randn(4, H, device="meta"))


@pytest.mark.parametrize("args, kw, err, match", [
    ((0, 4), {}, ValueError, "^hidden_size: expected >= 1, got 0"),
    ((H, -1), {}, ValueError, "^ffn_size: expected >= 1, got -1"),
    ((True, 4), {}, TypeError, "^hidden_size: expected an int, got bool"),
    ((H, 4.0), {}, TypeError, "^ffn_size: expected an int, got float"),
    ((H, 4), {"dtype": torch.int64}, TypeError, "^dtype: expected None or one of"),
], ids=["hidden-0", "ffn-negative", "hidden-bool", "ffn-float", "dtype-int"])
def test_shared_expert_bad_construction(args, kw, err, match):
    with pytest.raises(err, match=match):
        SharedExpert(*args, **kw)


@pytest.mark.parametrize("x, err, match", [
    ([[0.0] * H], TypeError, "^x: expected a torch.Tensor, got list"),
    (torch.randn(3, H + 1), ValueError, rf"^x: expected shape \[\.\.\., H={H}\], got \[3, {H + 1}\]"),
    (torch.tensor(1.0), ValueError, rf"^x: expected shape \[\.\.\., H={H}\], got \[\]"),
    (torch.randn(3, H, dtype=torch.float64), TypeError, "^x: expected dtype torch.float32"),
    (torch.ones(3, H, dtype=torch.int64), TypeError, "^x: expected dtype torch.float32"),
], ids=["list", "width", "0-d", "float64", "int"])
def test_shared_expert_bad_input(x, err, match):
    with pytest.raises(err, match=match):
        SharedExpert(H, 4)(x)


@pytest.mark.parametrize("shared", [0, 4])
def test_under_autocast_routing_stays_fp32_and_the_experts_run_in_its_dtype(shared):
    torch.manual_seed(1)
    layer = MoELayer(H, F, E, 2, shared_ffn_size=shared, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(13, H, requires_grad=True)
    gy = torch.randn(13, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    wrt = [x] + list(layer.parameters())
    got = torch.autograd.grad((y.float() * gy).sum() + 2 * aux.loss, wrt)
    y32, aux32 = layer(x)  # the router in fp32 under autocast too: the same choices, probs and losses
    assert torch.equal(aux.loss, aux32.loss) and torch.equal(aux.tokens_per_expert, aux32.tokens_per_expert)
    assert not torch.equal(y.float(), y32)  # the experts did run in bf16
    # the float64 oracle of the experts' bf16 inputs: x and the experts' weights rounded to bf16, the router not
    xd = x.detach().double().requires_grad_(True)
    params = {k: v if k in ("router", "expert_bias") or v is None else
              tuple(t.detach().bfloat16().double().requires_grad_(True) for t in v) if isinstance(v, tuple) else
              v.detach().bfloat16().double().requires_grad_(True) for k, v in _params(layer).items()}
    params["router"] = params["router"].detach().double().requires_grad_(True)
    ref = moe_reference([xd], params, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    assert ref["kept"] == aux.tokens_per_expert.tolist()
    assert_close(y, ref["ys"][0], torch.bfloat16, "y")
    flat = [params["router"], params["w1"], params["w3"], params["w2"], *(params["shared"] or ())]
    exp = torch.autograd.grad((ref["ys"][0] * gy.double()).sum() + 2 * ref["aux_loss"], [xd, *flat])
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for n, a, b, w in zip(names, got, exp, wrt):
        assert a.dtype == w.dtype == torch.float32, n
        assert_close(a, b, torch.bfloat16, f"{n}.grad")
