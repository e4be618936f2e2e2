"""CPU speed of the NSA torch backend (fwd + bwd through autograd) against the fp32 matmul rate.

Shapes of project issue #7: one sequence of T tokens, N1=16, N2=1, Dqk=192, Dv=128, bs=64, causal, fp32.
Timed in CPU time (``time.process_time``) with one thread, so that other jobs on a shared machine do not
distort it; the wall time with the default thread count and the load average are printed alongside.
"visible" FLOPs: 2*(Dqk+Dv) per visible (query head, key) pair in the forward, 2*(3*Dqk+2*Dv) in the backward.

    python benchmarks/cpu_nsa.py [--T 256 1024 2048] [--K 4 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import sparseops
from sparseops.testing import make_nsa_inputs


def matmul_rate(n: int = 2048, reps: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        a @ b
        best = min(best, time.process_time() - t)
    return 2 * n**3 / best


def visible_pairs(a) -> int:
    topk, bs = a["topk_indices"].long(), a["selected_block_size"]
    T1, N1 = a["query"].shape[:2]
    pos = torch.arange(T1)[:, None, None]
    keys = topk[..., None] * bs + torch.arange(bs)
    vis = (topk[..., None] >= 0) & (keys <= pos[..., None]) & (keys < a["key"].shape[0])
    return int(vis.sum()) * (N1 // topk.shape[1])


def run(a, backward=True):
    q, k, v = (a[n].clone().requires_grad_() for n in ("query", "key", "value"))
    kw = {n: x for n, x in a.items() if n not in ("query", "key", "value")}
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    if backward:
        out.backward(torch.ones_like(out))


def timed(fn, reps, clock):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--K", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rate = matmul_rate()
    print(f"loadavg {os.getloadavg()}  matmul 1 thread: {rate / 1e9:.0f} GFLOP/s")
    print("T     K   fwd+bwd ms (1 thr CPU)  % matmul   fwd ms  % matmul   wall ms (2 thr)")
    Dqk, Dv = 192, 128
    for T in args.T:
        for K in args.K:
            a = make_nsa_inputs([T], N1=16, N2=1, Dqk=Dqk, Dv=Dv, bs=64, K=K, causal=True)
            pairs = visible_pairs(a)
            f_fl = 2 * (Dqk + Dv) * pairs
            b_fl = 2 * (3 * Dqk + 2 * Dv) * pairs
            torch.set_num_threads(1)
            tb = timed(lambda a=a: run(a), args.reps, time.process_time)
            tf = timed(lambda a=a: run(a, False), args.reps, time.process_time)
            torch.set_num_threads(threads)
            tw = timed(lambda a=a: run(a), args.reps, time.perf_counter)
            torch.set_num_threads(1)
            print(f"{T:<5} {K:<3} {tb * 1e3:10.1f} {100 * (f_fl + b_fl) / tb / rate:18.1f} %"
                  f" {tf * 1e3:9.1f} {100 * f_fl / tf / rate:8.1f} % {tw * 1e3:12.1f}")
    print(f"loadavg {os.getloadavg()}  matmul 1 thread: {matmul_rate() / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
