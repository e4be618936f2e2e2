"""Benchmark: DeepSeek Sparse Attention (docs/dsa.md) forward + backward with its indexer, against dense causal SDPA.

One sequence, fp32, on the CPU (2 torch threads unless ``--threads``): MQA, N1 = 16 query heads over one KV head,
Dqk = Dv = 128, ``topk = 2048``, an indexer of Hi = 4 heads x Di = 64. *Ours* is one training step of the attention:
``indexer_topk`` (exact, chunked), ``sparse_attention`` (``nsa_selected_attention`` at token granularity) forward
with the loss's target and backward (q, k, v), and ``indexer_kl_loss`` forward and backward (into the indexer's
q, k, weights), as ``DeepSeekSparseAttention`` runs them. *Dense* is
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` forward and backward on the same q, k, v.
The two are measured in one process, after an untimed warm-up call of each (a training step's steady state),
alternating, so a loaded machine slows both alike; the load average is recorded. Goals (docs/perf.md): at least
1.0x at T = 8192 and 3x at T = 32768.

The dense warm-up's loss beside it (full runs, T = 8192; ``--warmup-lengths``): ``indexer_dense_kl_loss`` forward
and backward against the listed-keys path it replaces, ``indexer_topk`` with ``topk = T`` and ``indexer_kl_loss``
forward and backward, the same shapes, alternating.

Correctness first: the same step at T = 96 (``topk`` 24) in float64 against dense references
(``index_scores``, a stable sort, the masked softmax over the selected keys, the dense KL), and the dense
warm-up loss against the listed-keys one at T = 96 in float64.
Run: ``python benchmarks/dsa.py [--quick | --smoke] [--out DIR] [--threads N] [--lengths T ...]
[--warmup-lengths T ...]``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

if __package__:
    from . import _common
else:
    import _common

from sparseops.dsa import (  # noqa: E402
    index_scores,
    indexer_dense_kl_loss,
    indexer_kl_loss,
    indexer_topk,
    sparse_attention,
)
from sparseops.testing import TOLERANCES, rel_rms_error  # noqa: E402

NAME = "dsa"
SHAPE = {"N1": 16, "D": 128, "topk": 2048, "Hi": 4, "Di": 64}
GOALS = {8192: 1.0, 32768: 3.0}
WARMUP_LENGTHS = [8192]


def make_inputs(T, shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    N1, D, Hi, Di = shape["N1"], shape["D"], shape["Hi"], shape["Di"]
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return {"q": r(T, N1, D), "k": r(T, 1, D), "v": r(T, 1, D), "qi": r(T, Hi, Di), "ki": r(T, Di), "wi": r(T, Hi)}


def ours(x, shape, dout):
    """One DSA step: the indexer's top-k, the attention forward + backward, the indexer loss forward + backward."""
    N1, D, topk = shape["N1"], shape["D"], shape["topk"]
    idx, sc = indexer_topk(x["qi"], x["ki"], x["wi"], topk)
    o, p = sparse_attention(x["q"], x["k"], x["v"], idx, scale=D ** -0.5, return_target=True, validate=False)
    o.backward(dout)
    loss = indexer_kl_loss(x["q"].detach(), x["k"].detach(), idx, sc, scale=D ** -0.5, head_num=N1, target=p)
    loss.backward()
    return o.detach(), loss.detach()


def dense(x, dout):
    o = F.scaled_dot_product_attention(x["q"].transpose(0, 1)[None], x["k"].transpose(0, 1)[None],
                                       x["v"].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    o = o[0].transpose(0, 1)
    o.backward(dout)
    return o.detach()


def _reference(x, shape):
    """Dense float64: the step's output and loss from [T, T] matrices."""
    D, topk = shape["D"], shape["topk"]
    T = x["q"].shape[0]
    I = index_scores(x["qi"], x["ki"], x["wi"])
    order = torch.sort(I.detach(), dim=1, descending=True, stable=True).indices[:, :topk]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    sel = torch.zeros(T, T, dtype=torch.bool).scatter_(1, order, True) & causal
    logits = torch.einsum("thd,sd->hts", x["q"], x["k"][:, 0]) * D ** -0.5
    att = torch.softmax(logits.masked_fill(~sel, float("-inf")), dim=-1)
    out = torch.einsum("hts,sd->thd", att, x["v"][:, 0])
    p = att.mean(0)
    logq = torch.log_softmax(I.masked_fill(~sel, float("-inf")), dim=-1)
    loss = torch.where(sel, p * (torch.log(p.clamp_min(1e-300)) - logq), 0.0).sum() / T
    return out, loss


def warmup_dense(x, shape):
    """The dense warm-up loss forward + backward into the indexer's inputs."""
    D = shape["D"]
    loss = indexer_dense_kl_loss(x["q"].detach(), x["k"].detach(), x["qi"], x["ki"], x["wi"], scale=D ** -0.5,
                                 head_num=shape["N1"])
    loss.backward()
    return loss.detach()


def warmup_listed(x, shape):
    """The same loss over indexer_topk's every key (topk = T): the path the dense loss replaces."""
    D, T = shape["D"], x["q"].shape[0]
    idx, sc = indexer_topk(x["qi"], x["ki"], x["wi"], T)
    loss = indexer_kl_loss(x["q"].detach(), x["k"].detach(), idx, sc, scale=D ** -0.5, head_num=shape["N1"])
    loss.backward()
    return loss.detach()


def gate_correctness() -> list[dict]:
    shape = dict(SHAPE, N1=4, D=16, topk=24, Hi=2, Di=8)
    x = make_inputs(96, shape, torch.float64)
    dout = torch.randn(96, 4, 16, dtype=torch.float64)
    out, loss = ours(x, shape, dout)
    r_out, r_loss = _reference({n: t.detach() for n, t in x.items()}, shape)
    checks = [{"name": "out", "err": rel_rms_error(out, r_out)}, {"name": "loss", "err": rel_rms_error(loss, r_loss)}]
    w = make_inputs(96, shape, torch.float64)
    checks.append({"name": "warm-up loss", "err": rel_rms_error(warmup_dense(w, shape), warmup_listed(w, shape))})
    for c in checks:
        if not c["err"] <= TOLERANCES[torch.float64]:
            raise AssertionError(f"correctness gate: {c['name']} off by {c['err']:.3g} relative RMS")
    return checks


def bench(T, shape, runs) -> dict:
    x = make_inputs(T, shape)
    dout = torch.randn(T, shape["N1"], shape["D"], generator=torch.Generator().manual_seed(1))
    times = {"ours": [], "dense": []}
    for side in ("ours", "dense"):  # untimed warm-up: the first call faults in every fresh page of its buffers
        for t in x.values():
            t.grad = None
        ours(x, shape, dout) if side == "ours" else dense(x, dout)
    for _ in range(runs):  # alternating: load on the machine hits both sides alike
        for side in ("ours", "dense"):
            for t in x.values():
                t.grad = None
            t0 = time.perf_counter()
            ours(x, shape, dout) if side == "ours" else dense(x, dout)
            times[side].append(time.perf_counter() - t0)
    o, d = min(times["ours"]), min(times["dense"])
    return {"T": T, "ours_fwdbwd_s": o, "dense_fwdbwd_s": d, "speedup": d / o, "goal": GOALS.get(T),
            "runs": runs, "loadavg": _common.loadavg()}


def bench_warmup(T, shape, runs) -> dict:
    x = make_inputs(T, shape)
    times = {"dense": [], "listed": []}
    sides = {"dense": warmup_dense, "listed": warmup_listed}
    for name, fn in list(sides.items()) * (runs + 1):  # the first round untimed: fresh pages
        for t in x.values():
            t.grad = None
        t0 = time.perf_counter()
        fn(x, shape)
        times[name].append(time.perf_counter() - t0)
    d, li = min(times["dense"][1:]), min(times["listed"][1:])
    return {"T": T, "dense_loss_s": d, "listed_loss_s": li, "speedup": li / d, "runs": runs,
            "loadavg": _common.loadavg()}


def table(rows, env, warmup=()) -> str:
    lines = [f"DSA step (indexer top-k + attention fwd+bwd + indexer loss fwd+bwd) vs dense causal SDPA fwd+bwd, "
             f"fp32, MQA 16 heads, D 128, topk 2048 ({_common.env_line(env)})", "",
             "| T | ours (s) | dense SDPA (s) | speedup | goal | load average after |", "|---|---|---|---|---|---|"]
    for r in rows:
        goal = f"{r['goal']}x" if r["goal"] else "—"
        lines.append(f"| {r['T']} | {r['ours_fwdbwd_s']:.2f} | {r['dense_fwdbwd_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{goal} | {r['loadavg']} |")
    if warmup:
        lines += ["", "The dense warm-up's indexer loss fwd+bwd: indexer_dense_kl_loss vs indexer_topk(topk = T) + "
                  "indexer_kl_loss", "", "| T | dense loss (s) | listed keys (s) | speedup | load average after |",
                  "|---|---|---|---|---|"]
        for r in warmup:
            lines.append(f"| {r['T']} | {r['dense_loss_s']:.2f} | {r['listed_loss_s']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['loadavg']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _common.make_parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="*", default=None, help="override the sequence lengths")
    p.add_argument("--warmup-lengths", type=int, nargs="*", default=None,
                   help="override the dense warm-up loss's sequence lengths (none in --quick)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per side and length (the minimum is kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or 2)
    if args.report:
        rec = _common.last_record(_common.report_dir(args) / f"{NAME}.json")
        print(table(rec["rows"], rec["env"], rec.get("warmup", ())))
        return 0
    env = _common.environment()
    checks = gate_correctness()
    print(f"correctness gate: {len(checks)} checks within the float64 tolerance", flush=True)
    shape = dict(SHAPE)
    if args.smoke:
        lengths, runs, shape, warm_lengths = [128], 1, dict(SHAPE, topk=64), [128]
    elif args.quick:
        lengths, runs, warm_lengths = [8192], 1, []
    else:
        lengths, runs, warm_lengths = [8192, 32768], 1, WARMUP_LENGTHS
    rows = []
    for T in args.lengths or lengths:
        r = bench(T, shape, args.runs or runs)
        print(f"  T = {T}: ours {r['ours_fwdbwd_s']:.2f} s, dense {r['dense_fwdbwd_s']:.2f} s, "
              f"speedup {r['speedup']:.2f}x (load {r['loadavg']})", flush=True)
        rows.append(r)
    warmup = []
    for T in args.warmup_lengths if args.warmup_lengths is not None else warm_lengths:
        r = bench_warmup(T, shape, args.runs or runs)
        print(f"  warm-up loss, T = {T}: dense {r['dense_loss_s']:.2f} s, listed keys {r['listed_loss_s']:.2f} s, "
              f"speedup {r['speedup']:.2f}x (load {r['loadavg']})", flush=True)
        warmup.append(r)
    print(table(rows, env, warmup))
    _common.save_run(NAME, "dsa", quick=args.quick, smoke=args.smoke, env=env, out=_common.out_dir(args),
                     rows=rows, plot=None, shape=shape, checks=checks, warmup=warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
