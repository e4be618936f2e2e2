"""The C++ CPU path of NSA selected attention: each (query token, KV head) with its gathered keys in the cache and
its query heads in the lanes of one vector register (the kernels of :mod:`sparseops._cpu_attention`,
``csrc/attention.cpp``; docs/nsa.md, "The C++ CPU path").

The torch paths (:mod:`.torch_impl` for blocks, :mod:`.torch_gather` for token granularity) run every product
as a torch matmul on gathered copies of the keys; with G query heads per KV head those are ``[G, D] x [D, n]``
products, far below the matmul rate on a CPU, plus a pass over memory per elementwise op. This path computes a
token's scores, softmax, ``P V`` and, in the backward, ``dQ`` and its rows of dK / dV in one visit of its keys,
without copying them. Same contract and numerics as the torch path (fp32 math, float64 for float64; exponents
clamped to ``[exp_floor, 80]``; a row with no visible key gives 0).

Built on first use (:mod:`sparseops._cpp`); when it cannot be built the torch path runs.
``SPARSEOPS_CPU_KERNELS=0`` or the torch backend's ``cpu_kernels=False`` knob turns it off.

Determinism: dK / dV go into one buffer per task, added in task order (:mod:`sparseops._cpu_attention`):
repeated calls with the same thread count give the same bits.
"""

from __future__ import annotations

import torch

from .._cpu_attention import EXTENSION, available, fills_lanes, lanes  # noqa: F401  (this path's names for them)
from .._cpu_attention import flat as _flat
from .._cpu_attention import outputs as _outputs
from .._cpu_attention import run_backward as _backward
from .._numerics import acc_dtype, exp_floor
from .._varlen import token_key_rows


def _module():
    return EXTENSION.module()


def suits(q: torch.Tensor, k: torch.Tensor, bs: int) -> bool:
    """Whether this path is the faster one for the call's shape: token granularity (the torch path gathers per
    token too), or at least a vector's lanes of query heads per KV head (16 in fp32, 8 in float64); fewer heads
    leave lanes idle, where the torch path's block tiles share a block among tokens."""
    return bs < 16 or fills_lanes(q, k)


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
    run = T1 > 0 and k.shape[0] > 0
    out, m, l = _outputs(T1, N1, Dv, acc, run)
    parts = N2 * -(-(N1 // N2) // lanes(acc))  # work items per token: KV heads x vectors of query heads
    tgt = torch.zeros(T1, parts, K, dtype=acc) if target else None
    if run:
        starts, lens, pos = token_key_rows(cu_q, cu_kv)
        _module().forward(_flat(q, acc), _flat(k, acc), _flat(v, acc), topk.to(torch.int64).contiguous(), starts,
                          lens, pos, bs, causal, exp_floor(acc), float(scale), out, m, l, tgt, torch.get_num_threads())
    if not target:
        return out.to(q.dtype), m, l
    return out.to(q.dtype), m, l, tgt[:, 0] if parts == 1 else tgt.sum(dim=1)


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    """``(dq, dk, dv)`` in the dtypes of q, k, v, from the forward's ``out`` and stats ``m``, ``l`` ``[T1, N1]``.
    Always bitwise repeatable for a given thread count (``deterministic`` is accepted for the contract)."""
    acc = acc_dtype(q)
    lse = torch.where(l > 0, m.to(acc) + torch.log(l.to(acc)), 0.0)
    starts, lens, pos = token_key_rows(cu_q, cu_kv)
    ids = topk.to(torch.int64).contiguous()

    def call(qa, kf, vf, df, ls, of, dq, dk, dv, P):
        _module().backward(qa, kf, vf, df, ls, of, ids, starts, lens, pos, bs, causal, exp_floor(acc),
                           float(scale), dq, dk, dv, P)

    return _backward(q, k, v, out, dout, lse, scale, call)


def head_mean_probs(q, k, indices, scale, cu):
    """``p [T, topk]`` (fp32, float64 for float64): the head-averaged softmax of ``scale * q . k`` over each token's
    selected keys ``indices [T, topk]`` (in-sequence positions, -1 unused: 0 there, as at any entry outside
    ``[0, S)``, unchecked under torch.compile), the DSA indexer loss's target
    (:mod:`sparseops.dsa.loss`); ``k [T, N2, D]`` by KV head."""
    acc = acc_dtype(q)
    T = q.shape[0]
    p = torch.zeros(T, indices.shape[1], dtype=acc)
    if T > 0:
        start, lens, _ = token_key_rows(cu, cu)
        _module().head_mean_probs(_flat(q, acc), _flat(k, acc), indices.to(torch.int64).contiguous(), start, lens,
                                  exp_floor(acc), float(scale), p, torch.get_num_threads())
    return p
