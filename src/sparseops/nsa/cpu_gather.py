"""The C++ CPU path of NSA selected attention: each (query token, KV head) with its gathered keys in the cache and
its query heads in the lanes of one vector register (``cpu_gather.cpp``; docs/nsa.md, "The C++ CPU path").

The torch paths (:mod:`.torch_impl` for blocks, :mod:`.torch_gather` for token granularity) run every product
as a torch matmul on gathered copies of the keys; with G query heads per KV head those are ``[G, D] x [D, n]``
products, far below the matmul rate on a CPU, plus a pass over memory per elementwise op. This path computes a
token's scores, softmax, ``P V`` and, in the backward, ``dQ`` and its rows of dK / dV in one visit of its keys,
without copying them. Same contract and numerics as the torch path (fp32 math, float64 for float64; exponents
clamped to ``[exp_floor, 80]``; a row with no visible key gives 0).

Built on first use (:mod:`sparseops._cpp`); when it cannot be built the torch path runs.
``SPARSEOPS_CPU_KERNELS=0`` or the torch backend's ``cpu_kernels=False`` knob turns it off.

Determinism: dK / dV go into one buffer per task (``tasks``: the torch thread count, fewer when the buffers
would pass :data:`TASK_BYTES`), each task handles a fixed set of tokens, and the buffers are added in task
order: repeated calls with the same thread count give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .._cpp import TASK_BYTES, Extension
from .._numerics import acc_dtype, exp_floor, row_dot
from .._varlen import token_key_rows

EXTENSION = Extension("nsa_cpu", Path(__file__).with_name("cpu_gather.cpp"), "NSA selected attention")


def _module():
    return EXTENSION.module()


def available(q: torch.Tensor) -> bool:
    """Whether a call with query ``q`` can run here: a CPU tensor of a supported dtype, enabled, and built."""
    return EXTENSION.available(q)


def suits(q: torch.Tensor, k: torch.Tensor, bs: int) -> bool:
    """Whether this path is the faster one for the call's shape: token granularity (the torch path gathers per
    token too), or at least a vector's lanes of query heads per KV head (16 in fp32, 8 in float64); fewer heads
    leave lanes idle, where the torch path's block tiles share a block among tokens."""
    lanes = 8 if q.dtype == torch.float64 else 16
    return bs < 16 or q.shape[1] // max(1, k.shape[1]) >= lanes


def _flat(x, acc):
    return x.to(acc).contiguous()


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal, target=False):
    """``(out [T1, N1, Dv]`` in q's dtype, ``m [T1, N1]``, ``l [T1, N1])`` (fp32, float64 for float64).

    ``target=True`` (token granularity, ``bs = 1``) appends ``p [T1, K]`` in m's dtype: the DSA indexer loss's
    target (docs/dsa.md), ``p[t, i] = (1 / N1) sum_h P[t, h, key of slot i]`` summed over the KV heads' slots
    ``topk[t, :, i]``, 0 where a slot sees no key, from the same probabilities as ``out``."""
    acc = acc_dtype(q)
    T1, N1, _ = q.shape
    N2, Dv = v.shape[1], v.shape[2]
    K = topk.shape[2]
    if target and bs != 1:
        raise ValueError(f"target: the loss's target is defined at token granularity (bs = 1), got bs = {bs}")
    out = torch.zeros(T1, N1, Dv, dtype=acc)
    m = torch.zeros(T1, N1, dtype=acc)
    l = torch.zeros(T1, N1, dtype=acc)
    lanes = 8 if acc == torch.float64 else 16
    parts = N2 * -(-(N1 // N2) // lanes)  # work items per token: KV heads x vectors of query heads
    tgt = torch.zeros(T1, parts, K, dtype=acc) if target else None
    if T1 > 0 and k.shape[0] > 0:
        starts, lens, pos = token_key_rows(cu_q, cu_kv)
        qa = torch.mul(q.to(acc), scale).contiguous()
        _module().forward(qa, _flat(k, acc), _flat(v, acc), topk.to(torch.int64).contiguous(), starts, lens, pos,
                          bs, causal, exp_floor(acc), out, m, l, tgt, torch.get_num_threads())
    if not target:
        return out.to(q.dtype), m, l
    return out.to(q.dtype), m, l, tgt[:, 0] if parts == 1 else tgt.sum(dim=1)


def _tasks(rows_kv: int, D: int, Dv: int, elt: int) -> int:
    per_task = max(1, rows_kv * (D + Dv) * elt)
    return max(1, min(torch.get_num_threads(), TASK_BYTES // per_task))


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    """``(dq, dk, dv)`` in the dtypes of q, k, v, from the forward's ``out`` and stats ``m``, ``l`` ``[T1, N1]``.
    Always bitwise repeatable for a given thread count (``deterministic`` is accepted for the contract)."""
    acc = acc_dtype(q)
    T1, N1, D = q.shape
    T2, N2, Dv = v.shape
    dq = torch.zeros(T1, N1, D, dtype=acc)
    if T1 == 0 or T2 == 0:
        return dq.to(q.dtype), torch.zeros_like(k), torch.zeros_like(v)
    elt = torch.finfo(acc).bits // 8
    P = _tasks(T2 * N2, D, Dv, elt)
    dk = torch.zeros(P, T2 * N2, D, dtype=acc)
    dv = torch.zeros(P, T2 * N2, Dv, dtype=acc)
    starts, lens, pos = token_key_rows(cu_q, cu_kv)
    qa = torch.mul(q.to(acc), scale).contiguous()
    delta = row_dot(dout, out, acc).contiguous()
    lse = torch.where(l > 0, m.to(acc) + torch.log(l.to(acc)), 0.0).contiguous()
    _module().backward(qa, _flat(k, acc), _flat(v, acc), _flat(dout, acc), lse, delta,
                       topk.to(torch.int64).contiguous(), starts, lens, pos, bs, causal, exp_floor(acc), float(scale),
                       dq, dk, dv, P)
    dk = dk[0] if P == 1 else dk.sum(dim=0)
    dv = dv[0] if P == 1 else dv.sum(dim=0)
    return dq.to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


def head_mean_probs(q, k, indices, scale, cu):
    """``p [T, topk]`` (fp32, float64 for float64): the head-averaged softmax of ``scale * q . k`` over each token's
    selected keys ``indices [T, topk]`` (in-sequence positions, -1 unused: 0 there), the DSA indexer loss's target
    (:mod:`sparseops.dsa.loss`); ``k [T, N2, D]`` by KV head."""
    acc = acc_dtype(q)
    T = q.shape[0]
    p = torch.zeros(T, indices.shape[1], dtype=acc)
    if T > 0:
        start, _, _ = token_key_rows(cu, cu)
        qa = torch.mul(q.to(acc), scale).contiguous()
        _module().head_mean_probs(qa, _flat(k, acc), indices.to(torch.int64).contiguous(), start, exp_floor(acc), p,
                                  torch.get_num_threads())
    return p
