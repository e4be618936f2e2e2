"""The DeepSeek Sparse Attention rows of the whole-stack GPU check (docs/dsa.md, docs/perf.md "The GPU check").

Two checks in the GPU check's row contract (``check(ctx) -> (worst error / tolerance or None, detail)``, raising
``Skip`` when a row cannot run), usable from ``benchmarks/gpu_check.py`` and on their own:

- ``check_dsa_module(ctx, dtype)``: ``sparseops.nn.DeepSeekSparseAttention`` forward + backward (the output, the
  indexer loss, the input and every parameter gradient) on the device against the same module in float64 on the
  CPU (fp32 gated; bf16 reported, not gated: its roundings change near-tied selections); the share of indexer
  selections equal to float64's.
- ``check_dsa_speed(ctx)``: the DSA step of ``benchmarks/dsa.py`` (indexer top-k, attention forward + backward at
  token granularity, indexer loss forward + backward) in bf16 against dense causal SDPA forward + backward on the
  same q, k, v (MQA, 16 query heads, D 128, topk 2048) at T = 8192 and 32768; informational (no gate).

    python benchmarks/gpu_dsa.py          # both rows on the GPU
    python benchmarks/gpu_dsa.py --cpu    # the module row on the CPU at tiny sizes (the plumbing)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from sparseops.nn import DeepSeekSparseAttention  # noqa: E402
from sparseops.testing import TOLERANCES, rel_rms_error  # noqa: E402

#: the module row's sizes by device type
SIZES = {"cuda": dict(cu=[0, 1000, 1999, 3072], hidden=256, topk=256),
         "cpu": dict(cu=[0, 40, 75], hidden=32, topk=8)}


class Skip(Exception):
    """A row that cannot run here; the message says why."""


def _worst(pairs, dtype) -> tuple[float, str]:
    """The largest error / tolerance over ``pairs`` and its name."""
    tol = TOLERANCES[dtype]
    ratio, name = max((rel_rms_error(a, b) / tol, n) for n, a, b in pairs)
    return ratio, f"worst {name} at {ratio:.3g} x tol"


def _module(s: dict) -> DeepSeekSparseAttention:
    torch.manual_seed(0)
    m = DeepSeekSparseAttention(s["hidden"], 16, 1, 32, topk=s["topk"], index_heads=4, index_head_dim=32,
                                rope_theta=10000.0, dtype=torch.float64)
    with torch.no_grad():  # spread the indexer scores so that the selection is decided by clear margins
        m.index_q_proj.weight.mul_(4)
    return m


def check_dsa_module(ctx: dict, dtype: torch.dtype, autocast: bool = False):
    """The layer in ``dtype`` (``autocast``: fp32 parameters, the forward under ``torch.autocast(bf16)``, where
    CUDA runs the indexer's LayerNorm in fp32) against float64 on the CPU."""
    dev = ctx["device"]
    s = SIZES["cuda" if dev.type == "cuda" else "cpu"]
    cu = s["cu"]
    ref_m = _module(s)
    m = copy.deepcopy(ref_m).to(dev, dtype)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(cu[-1], s["hidden"], generator=g, dtype=torch.float64)
    dy = torch.randn(x0.shape, generator=g, dtype=torch.float64)

    def run(mod, d, dt, ac=False):
        x = x0.to(d, dt, copy=True).requires_grad_(True)
        with torch.autocast(d.type, dtype=torch.bfloat16, enabled=ac):
            y, info = mod(x, torch.tensor(cu, dtype=torch.int32, device=d), return_info=True)
        if ac and y.dtype != torch.bfloat16:
            raise RuntimeError(f"y: expected bfloat16 under autocast, got {y.dtype}")
        ((y * dy.to(d, y.dtype)).sum() + info["indexer_loss"]).backward()
        return (y.detach().cpu(), info["indexer_loss"].detach().cpu(), x.grad.cpu(),
                {n: p.grad.cpu() for n, p in mod.named_parameters()}, info["indices"].cpu())

    y, loss, gx, gp, idx = run(m, dev, dtype, autocast)
    y_r, loss_r, gx_r, gp_r, idx_r = run(ref_m, torch.device("cpu"), torch.float64)
    same = (idx == idx_r).float().mean().item()
    pairs = [("y", y, y_r), ("indexer_loss", loss, loss_r), ("x.grad", gx, gx_r)]
    params = [(f"{n}.grad", gp[n], gp_r[n]) for n in gp]
    r, what = _worst(pairs + params, torch.bfloat16 if autocast else dtype)  # autocast computes in bf16
    if dtype == torch.bfloat16 or autocast:
        # bf16 roundings of the indexer's scores change near-tied selections, and a different key set is a
        # different function: reported, not gated (the op itself is gated in bf16 by the NSA rows)
        r, what = None, "reported, not gated: " + what
    return r, (f"T = {cu[-1]} in {len(cu) - 1} sequences, MQA G = 16, topk {s['topk']}, vs float64 on the CPU: "
               f"{what}; indexer selections equal to float64's: {same:.1%}")


def _time(fn, runs=3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _speed_at(T: int, N1: int = 16, D: int = 128, topk: int = 2048) -> str:
    import sparseops
    from sparseops.dsa import indexer_kl_loss, indexer_topk

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, qi, ki, wi = (torch.randn(*sh, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
                           for sh in ((T, N1, D), (T, 1, D), (T, 1, D), (T, 4, 64), (T, 64), (T, 4)))
    dout = torch.randn(T, N1, D, device="cuda", dtype=torch.bfloat16)

    def ours():
        idx, sc = indexer_topk(qi, ki, wi, topk)
        o = sparseops.nsa_selected_attention(q, k, v, idx[:, None], D ** -0.5, N1, 1, topk, sparse_mode=2,
                                             validate=False)[0]
        o.backward(dout)
        indexer_kl_loss(q.detach(), k.detach(), idx, sc, scale=D ** -0.5, head_num=N1).backward()

    def dense():
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        o[0].transpose(0, 1).backward(dout)

    t_o, t_d = _time(ours), _time(dense)
    return f"T = {T}: DSA step {t_o * 1e3:.1f} ms, dense SDPA {t_d * 1e3:.1f} ms ({t_d / t_o:.2f}x)"


def check_dsa_speed(ctx: dict, lengths=(8192, 32768)):
    if ctx["device"].type != "cuda":
        raise Skip("needs CUDA (the CPU figures: benchmarks/dsa.py)")
    return None, "bf16, MQA 16 heads, D 128, topk 2048, indexer 4 x 64: " + "; ".join(_speed_at(T) for T in lengths)


#: (row name, check) for benchmarks/gpu_check.py's CHECKS
ROWS = [
    ("DeepSeekSparseAttention fp32 fwd+bwd", lambda c: check_dsa_module(c, torch.float32)),
    ("DeepSeekSparseAttention bf16 fwd+bwd", lambda c: check_dsa_module(c, torch.bfloat16)),
    ("DeepSeekSparseAttention fp32 under bf16 autocast", lambda c: check_dsa_module(c, torch.float32, autocast=True)),
    ("DSA step vs dense SDPA (timing)", check_dsa_speed),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU at tiny sizes (the plumbing)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_dsa: no CUDA device (use --cpu)", file=sys.stderr)
        return 2
    ctx = {"device": torch.device("cpu" if args.cpu else "cuda")}
    failed = False
    for name, fn in ROWS:
        t0 = time.perf_counter()
        try:
            ratio, detail = fn(ctx)
            status = "ok" if ratio is None or ratio <= 1.0 else "FAIL"
        except Skip as exc:
            ratio, detail, status = None, str(exc), "skip"
        failed |= status == "FAIL"
        e = "-" if ratio is None else f"{ratio:.3g}"
        print(f"| {name} | {status} | {e} | {time.perf_counter() - t0:.1f} | {detail} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
