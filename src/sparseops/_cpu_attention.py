"""The C++ CPU attention kernels (``csrc/attention.cpp``; docs/nsa.md, "The C++ CPU path"), shared by the NSA
op's CPU path (:mod:`sparseops.nsa.cpu_gather`: key rows gathered by block ids, and DSA's loss target), and the
NSA module's sliding-window and compressed branches (:mod:`sparseops.nsa_branches.chunked_attention`: a
contiguous key range per token, here). One work item is a (query token, KV head) with its keys read in place and
its query heads in the lanes of one vector register; fp32 math (float64 for float64), exponents clamped to
``[exp_floor, 80]``, a row with no key gives 0.

Determinism: dK / dV go into one buffer per task (the torch thread count, fewer when the buffers would pass
``TASK_BYTES``), each task handles a fixed set of tokens, and the buffers are added in task order: repeated
calls with the same thread count give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._cpp import TASK_BYTES, Extension
from ._numerics import acc_dtype, exp_floor

EXTENSION = Extension("nsa_cpu", Path(__file__).parent / "csrc" / "attention.cpp", "NSA selected attention")


def available(q: torch.Tensor) -> bool:
    """Whether a call with query ``q`` can run here: a CPU tensor of a supported dtype, enabled, and built."""
    return EXTENSION.available(q)


def lanes(dtype: torch.dtype) -> int:
    """Query heads per vector register of the kernels: 16 in fp32 (and fp16 / bf16 inputs), 8 in float64."""
    return 8 if dtype == torch.float64 else 16


def fills_lanes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """At least a vector's lanes of query heads per KV head (16 in fp32, 8 in float64)."""
    return q.shape[1] // max(1, k.shape[1]) >= lanes(q.dtype)


def flat(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return x.to(acc).contiguous()


def tasks(rows_kv: int, D: int, Dv: int, elt: int) -> int:
    per_task = max(1, rows_kv * (D + Dv) * elt)
    return max(1, min(torch.get_num_threads(), TASK_BYTES // per_task))


def uninitialised(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor the kernel writes whole (each row, 0 for a row with no key): no zero pass over fresh pages."""
    return torch.empty(*shape, dtype=dtype)


def outputs(T1: int, N1: int, Dv: int, acc: torch.dtype, run: bool):
    """``(out [T1, N1, Dv], m [T1, N1], l [T1, N1])`` in ``acc`` for a forward call: :func:`uninitialised` when the
    kernel runs, zeros when it does not (``run`` false)."""
    new = uninitialised if run else torch.zeros
    return new(T1, N1, Dv, dtype=acc), new(T1, N1, dtype=acc), new(T1, N1, dtype=acc)


def run_backward(q, k, v, out, dout, lse, scale, call):
    """The shared backward: buffers, one ``call(qa, k, v, dout, lse, out, dq, dk, dv, P)`` of the kernel (which
    computes each row's ``delta = rowsum(dout * out)`` from the rows it loads) and the per-task sums, in task
    order."""
    acc = acc_dtype(q)
    T1, N1, D = q.shape
    T2, N2, Dv = v.shape
    if T1 == 0 or T2 == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = uninitialised(T1, N1, D, dtype=acc)
    elt = torch.finfo(acc).bits // 8
    P = tasks(T2 * N2, D, Dv, elt)
    dk = torch.zeros(P, T2 * N2, D, dtype=acc)
    dv = torch.zeros(P, T2 * N2, Dv, dtype=acc)
    qa = flat(q, acc)  # the kernels apply the scale as they load q
    call(qa, flat(k, acc), flat(v, acc), flat(dout, acc), lse.to(acc).contiguous(), flat(out, acc), dq, dk, dv, P)
    dk = dk[0] if P == 1 else dk.sum(dim=0)
    dv = dv[0] if P == 1 else dv.sum(dim=0)
    return dq.to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


def forward_ranges(q, k, v, lo, hi, scale):
    """Attention of each query token over the contiguous key rows ``[lo[t], hi[t])`` (int64 ``[T1]``, rows of
    ``k [T2, N2, D]``, for every KV head): ``(out [T1, N1, Dv]`` in q's dtype, ``lse [T1, N1])`` (fp32, float64
    for float64; ``-inf`` and ``out = 0`` for an empty range). The NSA module's sliding-window and compressed
    branches (:mod:`sparseops.nsa_branches.chunked_attention`)."""
    acc = acc_dtype(q)
    T1, N1, _ = q.shape
    K = int((hi - lo).max()) if T1 > 0 else 0
    run = K > 0 and k.shape[0] > 0
    out, m, l = outputs(T1, N1, v.shape[2], acc, run)
    if run:
        EXTENSION.module().forward_ranges(flat(q, acc), flat(k, acc), flat(v, acc), lo.contiguous(), hi.contiguous(),
                                          K, exp_floor(acc), float(scale), out, m, l, torch.get_num_threads())
    lse = torch.where(l > 0, m + torch.log(l), float("-inf"))
    return out.to(q.dtype), lse


def backward_ranges(q, k, v, out, lse, dout, lo, hi, scale):
    """``(dq, dk, dv)`` of :func:`forward_ranges` from its ``out`` and ``lse``; bitwise repeatable for a given
    thread count."""
    K = int((hi - lo).max()) if q.shape[0] > 0 else 0
    ls = torch.where(torch.isinf(lse), 0.0, lse)

    def call(qa, kf, vf, df, ls_, of, dq, dk, dv, P):
        EXTENSION.module().backward_ranges(qa, kf, vf, df, ls_, of, lo.contiguous(), hi.contiguous(), K,
                                           exp_floor(acc_dtype(q)), float(scale), dq, dk, dv, P)

    return run_backward(q, k, v, out, dout, ls, scale, call)
