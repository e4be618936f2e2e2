"""``sparseops check`` for the NSA ops: the cases and one check per (op, case, backend, dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import sparseops
from sparseops import testing
from sparseops.nsa import reference as nsa_ref

from ._check_common import EXACT, Cmp, Timer, f64, grad_or_zeros, oracle, rand, tolerance

OPS = (
    "nsa_selected_attention",
    "nsa_selected_attention_grad",
    "nsa_selected_attention_grad[deterministic]",
    "nsa_selected_attention.backward",
)



@dataclass
class NsaCase:
    name: str
    seqlens_q: list[int]
    seqlens_kv: list[int]
    N1: int
    N2: int
    Dqk: int
    Dv: int
    K: int
    bs: int = 16
    causal: bool = True
    empty_frac: float = 0.0
    duplicates: bool = False
    extra: dict = field(default_factory=dict)



def cases(tiny: bool) -> list[NsaCase]:
    """Varlen causal GQA with empty slots (some rows see no key); non-causal MQA with S2 != S1, S2 not a
    multiple of bs, duplicate block ids; one sequence with Dv < Dqk."""
    if tiny:
        return [
            NsaCase("varlen-causal-gqa", [3, 18], [3, 18], N1=2, N2=1, Dqk=16, Dv=16, K=2, empty_frac=0.2),
            NsaCase("noncausal-dup", [5], [21], N1=2, N2=1, Dqk=16, Dv=16, K=2, causal=False, duplicates=True),
        ]
    return [
        NsaCase("varlen-causal-gqa", [7, 50, 1, 24], [7, 50, 1, 24], N1=4, N2=2, Dqk=32, Dv=32, K=3, empty_frac=0.15),
        NsaCase("noncausal-mqa-dup", [19, 12], [37, 70], N1=4, N2=1, Dqk=32, Dv=16, K=3, causal=False, duplicates=True),
        NsaCase("one-seq-dv<dqk", [40], [40], N1=2, N2=2, Dqk=64, Dv=48, K=2, bs=32),
    ]


def _setup(case: NsaCase, dtype, seed, device):
    inp = testing.make_nsa_inputs(
        case.seqlens_q, case.seqlens_kv, N1=case.N1, N2=case.N2, Dqk=case.Dqk, Dv=case.Dv, bs=case.bs, K=case.K,
        dtype=dtype, causal=case.causal, empty_frac=case.empty_frac, duplicates=case.duplicates, seed=seed,
    )
    cu_q = [0] + list(inp["actual_seq_qlen"])
    cu_kv = [0] + list(inp["actual_seq_kvlen"])
    ref_args = (inp["topk_indices"], inp["scale_value"], case.bs, cu_q, cu_kv, case.causal)
    q64, k64, v64 = f64(inp["query"]), f64(inp["key"]), f64(inp["value"])
    out64, m64, l64 = oracle(nsa_ref.forward, q64, k64, v64, *ref_args)
    dev = {n: inp[n].to(device) for n in ("query", "key", "value", "topk_indices")}
    kwargs = {
        "actual_seq_qlen": inp["actual_seq_qlen"],
        "actual_seq_kvlen": inp["actual_seq_kvlen"],
        "sparse_mode": inp["sparse_mode"],
    }
    g = torch.Generator().manual_seed(seed + 11)
    dout = rand(out64.shape, dtype, g, device)
    return inp, dev, kwargs, ref_args, (q64, k64, v64), (out64, m64, l64), dout


def _lanes(x: torch.Tensor) -> torch.Tensor:
    """``[T1, N1]`` -> CANN's ``[T1, N1, 8]`` stats layout."""
    return x[..., None].expand(*x.shape, 8)


def check(op: str, case: NsaCase, backend: str, dtype, seed: int, device) -> tuple[list[Cmp], float]:
    inp, dev, kwargs, ref_args, (q64, k64, v64), (out64, m64, l64), dout = _setup(case, dtype, seed, device)
    kw = {"backend": backend, "validate": True}
    static = {
        "scale_value": inp["scale_value"],
        "head_num": case.N1,
        "selected_block_size": case.bs,
        "selected_block_count": case.K,
    }
    tm = Timer(device)

    if op == "nsa_selected_attention":
        with tm:
            out, smax, ssum = sparseops.nsa_selected_attention(
                dev["query"], dev["key"], dev["value"], dev["topk_indices"], inp["scale_value"], case.N1, case.bs,
                case.K, **kwargs, **kw,
            )
        seen = _lanes(l64 > 0)  # stats of a row that sees no key are implementation-defined (docs/nsa.md)
        return [
            ("attention_out", out, out64, tolerance(dtype, out), None),
            ("softmax_max", smax, _lanes(m64), tolerance(dtype, smax), seen),
            ("softmax_sum", ssum, _lanes(l64), tolerance(dtype, ssum), seen),
        ], tm.ms

    # the seed op's inputs: the forward's outputs from the float64 oracle, rounded as a caller would hold them
    att = out64.to(dtype).to(device)
    smax = _lanes(m64.float()).contiguous().to(device)
    ssum = _lanes(l64.float()).contiguous().to(device)
    grad_kw = {k: static[k] for k in ("scale_value", "selected_block_size", "selected_block_count", "head_num")}

    if op == "nsa_selected_attention_grad":
        with tm:
            dq, dk, dv = sparseops.nsa_selected_attention_grad(
                dev["query"], dev["key"], dev["value"], att, dout, smax, ssum, dev["topk_indices"],
                **grad_kw, **kwargs, **kw,
            )
        edq, edk, edv = oracle(
            nsa_ref.backward, q64, k64, v64, f64(att), f64(dout), f64(smax[..., 0]), f64(ssum[..., 0]), *ref_args
        )
        return [
            ("dq", dq, edq, tolerance(dtype, dq), None),
            ("dk", dk, edk, tolerance(dtype, dk), None),
            ("dv", dv, edv, tolerance(dtype, dv), None),
        ], tm.ms

    if op == "nsa_selected_attention_grad[deterministic]":
        runs = []
        for _ in range(2):
            with tm:
                runs.append(
                    sparseops.nsa_selected_attention_grad(
                        dev["query"], dev["key"], dev["value"], att, dout, smax, ssum, dev["topk_indices"],
                        **grad_kw, **kwargs, deterministic=True, **kw,
                    )
                )
        return [
            (f"{n} (run 2 vs 1, bitwise)", b, a, EXACT, None) for n, a, b in zip(("dq", "dk", "dv"), runs[0], runs[1])
        ], tm.ms / 2

    if op == "nsa_selected_attention.backward":
        q = dev["query"].clone().requires_grad_(True)
        k = dev["key"].clone().requires_grad_(True)
        v = dev["value"].clone().requires_grad_(True)
        with tm:
            out, _, _ = sparseops.nsa_selected_attention(
                q, k, v, dev["topk_indices"], inp["scale_value"], case.N1, case.bs, case.K, **kwargs, **kw
            )
            if out.requires_grad:
                out.backward(dout)
        edq, edk, edv = oracle(nsa_ref.backward, q64, k64, v64, out64, f64(dout), m64, l64, *ref_args)
        return [
            ("query.grad", grad_or_zeros(q), edq, tolerance(dtype, q), None),
            ("key.grad", grad_or_zeros(k), edk, tolerance(dtype, k), None),
            ("value.grad", grad_or_zeros(v), edv, tolerance(dtype, v), None),
        ], tm.ms

    raise KeyError(op)


