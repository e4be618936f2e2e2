"""The ``sparseops`` command: ``info``, ``check`` and ``bench``.

``sparseops check`` runs every public op on every available backend against the reference oracle (run in
float64 on the upcast inputs) and prints one row per (op, backend, dtype, case); it exits 1 on any mismatch
or exception. ``sparseops bench`` runs the benchmark scripts of a source checkout (``benchmarks/*.py``).
``sparseops info`` prints versions, the device and which backend ``auto`` picks. ``python -m sparseops``
is the same command.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import sparseops
from sparseops import _checks, _compile, testing
from sparseops.moe import reference as moe_ref
from sparseops.nsa import reference as nsa_ref

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: exact outputs (index maps, bitwise-determinism) are held to this tolerance
EXACT = 0.0


def _prog() -> str:
    return "sparseops"


# ----------------------------------------------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _triton_version() -> str:
    if not _checks.triton_available():
        return "not installed"
    import triton

    return triton.__version__


def _auto_pick(device_type: str) -> str:
    picked = _checks.resolve_backend("auto", torch.device(device_type))
    if device_type == "cuda" and not torch.cuda.is_available():
        return f"{picked} (no CUDA device on this machine)"
    return picked


def info_lines() -> list[str]:
    cuda = torch.cuda.is_available()
    lines = [
        f"sparseops     {sparseops.__version__}  ({Path(sparseops.__file__).resolve().parent})",
        f"torch         {torch.__version__}",
        f"triton        {_triton_version()}",
        f"python        {platform.python_version()} ({sys.executable})",
        f"platform      {platform.platform()}",
        f"cpu           {_cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
    ]
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}        {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
        lines.append(f"cuda runtime  {torch.version.cuda}")
    else:
        lines.append("cuda          no CUDA device")
    interp = _checks.triton_interpret()
    lines += [
        f"triton usable {'yes' if _checks.triton_available() else 'no'}"
        f" (TRITON_INTERPRET={'1: kernels run on CPU tensors' if interp else '0'})",
        f"auto backend  cpu tensors -> {_auto_pick('cpu')}; cuda tensors -> {_auto_pick('cuda')}",
        f"cpu kernels   {_compile.status()}",
        f"deterministic sparseops.is_deterministic()={sparseops.is_deterministic()}, "
        f"torch.are_deterministic_algorithms_enabled()={torch.are_deterministic_algorithms_enabled()}",
    ]
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# check: cases
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class MoeCase:
    name: str
    T: int
    K: int
    H: int
    E: int = 8
    range: tuple[int, int] | None = None
    num_out_tokens: int = 0
    probs: bool = True
    probs_dtype: torch.dtype | None = None  # None: the tokens dtype
    index_dtype: torch.dtype = torch.int32


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


def moe_cases(tiny: bool) -> list[MoeCase]:
    """Edges each case covers: full window; a partial EP window given with negative ends; an empty EP window
    (a rank with no tokens); capacity truncation (``num_out_tokens``) with int64 ids and fp32 router probs;
    no probs (plain sums / exact copies) with an odd hidden size; and (not tiny) a shape large enough for the
    compiled CPU kernels."""
    if tiny:
        T, K, H = 7, 2, 9
    else:
        T, K, H = 61, 4, 72
    N = T * K
    return [
        MoeCase("full", T, K, H),
        MoeCase("ep-partial", T, K, H, range=(N // 4 - N, -(N // 5))),
        MoeCase("ep-empty", T, K, H, range=(N // 3, N // 3)),
        MoeCase("capacity", T, K, H, num_out_tokens=N - N // 3, probs_dtype=torch.float32, index_dtype=torch.int64),
        MoeCase("no-probs", T + 2, K, H + 24 + 1, probs=False, range=(1, N - 1)),
    ] + ([] if tiny else [
        # large enough (T * H, R * H >= 65,536) for the compiled CPU kernels; H not a multiple of the vector
        # width, a window inside the buffer
        MoeCase("fused-cpu", 257, 4, 258, range=(37, 257 * 4 - 41)),
    ])


def nsa_cases(tiny: bool) -> list[NsaCase]:
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


# ----------------------------------------------------------------------------------------------------------------
# check: one row = one op x backend x dtype x case
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    op: str
    backend: str
    dtype: str
    case: str
    err: float = math.nan
    tol: float = math.nan
    ms: float = math.nan
    worst: str = ""
    ok: bool = False
    error: str | None = None
    trace: str | None = None


# an output check: (name, actual, expected float64 or exact, tolerance, mask of elements to compare or None)
Cmp = tuple[str, "torch.Tensor | None", "torch.Tensor | None", float, "torch.Tensor | None"]


def _tol(in_dtype: torch.dtype, out: torch.Tensor | None) -> float:
    """The looser of the inputs' and the output's tolerance (an output is rounded once to its dtype)."""
    t = testing.TOLERANCES[in_dtype]
    if out is not None and out.dtype in testing.TOLERANCES:
        t = max(t, testing.TOLERANCES[out.dtype])
    return t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _norm_range(rng, N: int) -> tuple[int, int]:
    s, e = rng
    s, e = (s + N if s < 0 else s), (e + N if e < 0 else e)
    return min(max(s, 0), N), min(max(e, 0), N)


def _oracle(fn, *args):
    """Run the reference on one thread: it is thousands of tiny ops, which threads only slow down (and a
    busy machine makes an OpenMP pool crawl)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(n)


def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def _cpu(t):
    return None if t is None else t.detach().cpu()


def _rand(shape, dtype, g, device):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


class _Timer:
    def __init__(self, device):
        self.device, self.ms = device, 0.0

    def __enter__(self):
        _sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        self.ms += (time.perf_counter() - self.t0) * 1e3


def _moe_setup(case: MoeCase, dtype, seed, device):
    inp = testing.make_moe_inputs(
        case.T, case.K, case.H, num_experts=case.E, dtype=dtype, probs_dtype=case.probs_dtype or dtype,
        index_dtype=case.index_dtype, seed=seed,
    )
    N = case.T * case.K
    if case.range is not None:
        s, e = _norm_range(case.range, N)
    elif case.num_out_tokens > 0:
        s, e = 0, min(case.num_out_tokens, N)
    else:
        s, e = 0, N
    si = _oracle(moe_ref.sorted_indices_from, inp["indices"])  # int32, CPU: the oracle's slot -> row map
    probs = inp["probs"] if case.probs else None
    g = torch.Generator().manual_seed(seed + 7)
    return {
        "tokens": inp["tokens"].to(device),
        "indices": inp["indices"].to(device),
        "probs": None if probs is None else probs.to(device),
        "si_ref": si,
        "si": si.to(device),
        "s": s,
        "e": e,
        "R": e - s,
        "N": N,
        "range": None if case.range is None else list(case.range),
        "g": g,
    }


def _moe_check(op: str, case: MoeCase, backend: str, dtype, seed: int, device) -> tuple[list[Cmp], float]:
    d = _moe_setup(case, dtype, seed, device)
    K, s, e, R, H, T = case.K, d["s"], d["e"], d["R"], case.H, case.T
    probs, rng, si, si_ref, g = d["probs"], d["range"], d["si"], d["si_ref"], d["g"]
    kw = {"backend": backend, "validate": True}
    tm = _Timer(device)
    pdt = probs.dtype if probs is not None else dtype

    if op == "moe_token_permute_with_ep":
        with tm:
            pt, si_out, pp = sparseops.moe_token_permute_with_ep(
                d["tokens"], d["indices"], probs, rng, case.num_out_tokens, False, **kw
            )
        ept, epp = _oracle(moe_ref.permute, _f64(d["tokens"]), si_ref, _f64(probs), K, s, e)
        si_cmp = si_out.to("cpu", torch.int64) if isinstance(si_out, torch.Tensor) else si_out
        return [
            ("sorted_indices", si_cmp, si_ref.to(torch.int64), EXACT, None),
            ("permuted_tokens", pt, ept, _tol(dtype, pt), None),
            ("permuted_probs", pp, epp, _tol(pdt, pp), None),
        ], tm.ms

    if op == "moe_token_unpermute_with_ep":
        pt = _rand((R, H), dtype, g, device)
        with tm:
            out = sparseops.moe_token_unpermute_with_ep(pt, si, probs, K, rng, False, None, **kw)
        exp = _oracle(moe_ref.unpermute, _f64(pt), si_ref, _f64(probs), K, s, e)
        return [("unpermuted_tokens", out, exp, _tol(dtype, out), None)], tm.ms

    if op == "moe_token_unpermute_with_ep_grad":
        grad = _rand((T, H), dtype, g, device)
        pt = _rand((R, H), dtype, g, device) if probs is not None else None
        with tm:
            ptg, pg = sparseops.moe_token_unpermute_with_ep_grad(grad, si, pt, probs, False, None, rng, K, **kw)
        eptg, epg = _oracle(moe_ref.unpermute_grad, _f64(grad), si_ref, _f64(pt), _f64(probs), K, s, e)
        return [
            ("permuted_tokens_grad", ptg, eptg, _tol(dtype, ptg), None),
            ("probs_grad", pg, epg, _tol(pdt, pg), None),
        ], tm.ms

    if op == "moe_token_permute_with_ep_grad":
        ptg = _rand((R, H), dtype, g, device)
        ppg = _rand((R,), pdt, g, device) if probs is not None else None
        with tm:
            tg, pg = sparseops.moe_token_permute_with_ep_grad(ptg, si, ppg, K, rng, False, **kw)
        etg, epg = _oracle(moe_ref.permute_grad, _f64(ptg), si_ref, _f64(ppg), K, s, e)
        return [
            ("tokens_grad", tg, etg, _tol(dtype, tg), None),
            ("probs_grad", pg, epg, _tol(pdt, pg), None),
        ], tm.ms

    if op == "moe_token_permute_with_ep.backward":
        tokens = d["tokens"].clone().requires_grad_(True)
        p = None if probs is None else probs.clone().requires_grad_(True)
        gpt = _rand((R, H), dtype, g, device)
        gpp = _rand((R,), pdt, g, device) if probs is not None else None
        with tm:
            pt, _, pp = sparseops.moe_token_permute_with_ep(tokens, d["indices"], p, rng, case.num_out_tokens, False, **kw)
            outs = [(pt, gpt), (pp, gpp)]
            outs = [(o, go) for o, go in outs if o is not None and o.requires_grad]
            if outs:
                torch.autograd.backward([o for o, _ in outs], [go for _, go in outs])
        etg, epg = _oracle(moe_ref.permute_grad, _f64(gpt), si_ref, _f64(gpp), K, s, e)
        return [
            ("tokens.grad", _grad_or_zeros(tokens), etg, _tol(dtype, tokens), None),
            ("probs.grad", None if p is None else _grad_or_zeros(p), epg, _tol(pdt, p), None),
        ], tm.ms

    if op == "moe_token_unpermute_with_ep.backward":
        pt = _rand((R, H), dtype, g, device).requires_grad_(True)
        p = None if probs is None else probs.clone().requires_grad_(True)
        gout = _rand((T, H), dtype, g, device)
        with tm:
            out = sparseops.moe_token_unpermute_with_ep(pt, si, p, K, rng, False, None, **kw)
            if out.requires_grad:
                out.backward(gout)
        eptg, epg = _oracle(moe_ref.unpermute_grad, _f64(gout), si_ref, _f64(pt), _f64(p), K, s, e)
        return [
            ("permuted_tokens.grad", _grad_or_zeros(pt), eptg, _tol(dtype, pt), None),
            ("probs.grad", None if p is None else _grad_or_zeros(p), epg, _tol(pdt, p), None),
        ], tm.ms

    raise KeyError(op)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """No gradient reached ``t`` (e.g. an empty EP window): that is a zero gradient."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _nsa_setup(case: NsaCase, dtype, seed, device):
    inp = testing.make_nsa_inputs(
        case.seqlens_q, case.seqlens_kv, N1=case.N1, N2=case.N2, Dqk=case.Dqk, Dv=case.Dv, bs=case.bs, K=case.K,
        dtype=dtype, causal=case.causal, empty_frac=case.empty_frac, duplicates=case.duplicates, seed=seed,
    )
    cu_q = [0] + list(inp["actual_seq_qlen"])
    cu_kv = [0] + list(inp["actual_seq_kvlen"])
    ref_args = (inp["topk_indices"], inp["scale_value"], case.bs, cu_q, cu_kv, case.causal)
    q64, k64, v64 = _f64(inp["query"]), _f64(inp["key"]), _f64(inp["value"])
    out64, m64, l64 = _oracle(nsa_ref.forward, q64, k64, v64, *ref_args)
    dev = {n: inp[n].to(device) for n in ("query", "key", "value", "topk_indices")}
    kwargs = {
        "actual_seq_qlen": inp["actual_seq_qlen"],
        "actual_seq_kvlen": inp["actual_seq_kvlen"],
        "sparse_mode": inp["sparse_mode"],
    }
    g = torch.Generator().manual_seed(seed + 11)
    dout = _rand(out64.shape, dtype, g, device)
    return inp, dev, kwargs, ref_args, (q64, k64, v64), (out64, m64, l64), dout


def _lanes(x: torch.Tensor) -> torch.Tensor:
    """``[T1, N1]`` -> CANN's ``[T1, N1, 8]`` stats layout."""
    return x[..., None].expand(*x.shape, 8)


def _nsa_check(op: str, case: NsaCase, backend: str, dtype, seed: int, device) -> tuple[list[Cmp], float]:
    inp, dev, kwargs, ref_args, (q64, k64, v64), (out64, m64, l64), dout = _nsa_setup(case, dtype, seed, device)
    kw = {"backend": backend, "validate": True}
    static = {
        "scale_value": inp["scale_value"],
        "head_num": case.N1,
        "selected_block_size": case.bs,
        "selected_block_count": case.K,
    }
    tm = _Timer(device)

    if op == "nsa_selected_attention":
        with tm:
            out, smax, ssum = sparseops.nsa_selected_attention(
                dev["query"], dev["key"], dev["value"], dev["topk_indices"], inp["scale_value"], case.N1, case.bs,
                case.K, **kwargs, **kw,
            )
        seen = _lanes(l64 > 0)  # stats of a row that sees no key are implementation-defined (spec/nsa.md §3)
        return [
            ("attention_out", out, out64, _tol(dtype, out), None),
            ("softmax_max", smax, _lanes(m64), _tol(dtype, smax), seen),
            ("softmax_sum", ssum, _lanes(l64), _tol(dtype, ssum), seen),
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
        edq, edk, edv = _oracle(
            nsa_ref.backward, q64, k64, v64, _f64(att), _f64(dout), _f64(smax[..., 0]), _f64(ssum[..., 0]), *ref_args
        )
        return [
            ("dq", dq, edq, _tol(dtype, dq), None),
            ("dk", dk, edk, _tol(dtype, dk), None),
            ("dv", dv, edv, _tol(dtype, dv), None),
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
        edq, edk, edv = _oracle(nsa_ref.backward, q64, k64, v64, out64, _f64(dout), m64, l64, *ref_args)
        return [
            ("query.grad", _grad_or_zeros(q), edq, _tol(dtype, q), None),
            ("key.grad", _grad_or_zeros(k), edk, _tol(dtype, k), None),
            ("value.grad", _grad_or_zeros(v), edv, _tol(dtype, v), None),
        ], tm.ms

    raise KeyError(op)


MOE_OPS = (
    "moe_token_permute_with_ep",
    "moe_token_unpermute_with_ep",
    "moe_token_unpermute_with_ep_grad",
    "moe_token_permute_with_ep_grad",
    "moe_token_permute_with_ep.backward",
    "moe_token_unpermute_with_ep.backward",
)
NSA_OPS = (
    "nsa_selected_attention",
    "nsa_selected_attention_grad",
    "nsa_selected_attention_grad[deterministic]",
    "nsa_selected_attention.backward",
)


def _compare(cmps: list[Cmp]) -> tuple[float, float, str, bool, str | None]:
    """Worst output by err/tol. A missing output where one is expected (or the reverse) fails."""
    worst = (0.0, 0.0, "", -1.0)
    problems = []
    for name, actual, expected, tol, mask in cmps:
        if actual is None and expected is None:
            continue
        if actual is None or expected is None:
            problems.append(f"{name}: expected {'None' if expected is None else 'a tensor'}, got "
                            f"{'None' if actual is None else 'a tensor'}")
            worst = max(worst, (math.inf, tol, name, math.inf), key=lambda w: w[3])
            continue
        if tuple(actual.shape) != tuple(expected.shape):
            problems.append(f"{name}: expected shape {list(expected.shape)}, got {list(actual.shape)}")
            worst = max(worst, (math.inf, tol, name, math.inf), key=lambda w: w[3])
            continue
        a, e = _cpu(actual), _cpu(expected)
        if mask is not None:
            m = mask.cpu()
            a, e = a[m], e[m]
        if tol == EXACT:
            err = 0.0 if torch.equal(a.to(e.dtype) if a.dtype != e.dtype else a, e) else _exact_err(a, e)
        else:
            err = testing.rel_rms_error(a, e)
        ratio = (0.0 if err == 0 else math.inf) if tol == 0 else err / tol
        if not err <= tol:
            ratio = max(ratio, 1.0 + 1e-9) if ratio == ratio else math.inf
        if ratio > worst[3]:
            worst = (err, tol, name, ratio)
    err, tol, name, ratio = worst
    ok = not problems and ratio <= 1.0
    return err, tol, name, ok, "; ".join(problems) or None


def _exact_err(a: torch.Tensor, e: torch.Tensor) -> float:
    """For an exact output: the share of elements that differ (nonzero means FAIL)."""
    if a.numel() == 0:
        return 0.0
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    same = (a64 == e64) | (torch.isnan(a64) & torch.isnan(e64))
    return float((~same).sum()) / a.numel()


def run_one(family: str, op: str, case, backend: str, dtype, seed: int, device) -> Result:
    res = Result(op=op, backend=backend, dtype=DTYPE_NAMES[dtype], case=case.name)
    try:
        fn = _moe_check if family == "moe" else _nsa_check
        cmps, ms = fn(op, case, backend, dtype, seed, device)
        res.ms = ms
        res.err, res.tol, res.worst, res.ok, res.error = _compare(cmps)
    except Exception as exc:  # report it, keep going, exit 1 at the end
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}"
        res.trace = traceback.format_exc()
    return res


# ----------------------------------------------------------------------------------------------------------------
# check: the command
# ----------------------------------------------------------------------------------------------------------------

COLUMNS = ("op", "backend", "dtype", "case", "worst output", "rel RMS err", "tol", "ms", "result")
WIDTHS = (42, 7, 5, 18, 28, 11, 7, 9, 6)


def _fmt_row(cells) -> str:
    return "  ".join(str(c).ljust(w) if i < 5 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, WIDTHS))).rstrip()


def _fmt_result(r: Result) -> str:
    err = "exception" if r.error and math.isnan(r.err) else (f"{r.err:.2e}" if r.err == r.err else "-")
    tol = "exact" if r.tol == 0 else (f"{r.tol:.0e}" if r.tol == r.tol else "-")
    ms = f"{r.ms:.2f}" if r.ms == r.ms else "-"
    return _fmt_row((r.op, r.backend, r.dtype, r.case, r.worst or "-", err, tol, ms, "PASS" if r.ok else "FAIL"))


def check_device(want: str = "auto") -> torch.device:
    """The device of the checked inputs: CUDA when available (``auto``) or asked for, else CPU."""
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit(f"{_prog()} check: --device cuda asked for but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def available_backends(choice: str, device: torch.device | None = None) -> tuple[list[str], list[str]]:
    """(backends to run, notes on skipped ones). torch always; triton for CUDA tensors, or for CPU tensors
    under TRITON_INTERPRET=1 (set before triton is imported)."""
    device = check_device() if device is None else device
    notes = []
    triton_ok = _checks.triton_available() and (device.type == "cuda" or _checks.triton_interpret())
    if not _checks.triton_available():
        why = "triton does not import (pip install sparseops[triton])"
    elif not triton_ok:
        why = f"inputs on {device} need TRITON_INTERPRET=1 (no CUDA device, or --device cpu)"
    else:
        why = ""
    if choice == "torch":
        return ["torch"], notes
    if choice == "triton":
        if not triton_ok:
            raise SystemExit(f"{_prog()} check: --backend triton is not available here: {why}")
        return ["triton"], notes
    out = ["torch"]
    if triton_ok:
        out.append("triton")
    else:
        notes.append(f"triton backend skipped: {why}")
    return out, notes


def _progress(total: int):
    """A tqdm bar on a terminal (if tqdm is installed); None means plain prints."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, leave=False, file=sys.stderr, unit="check")


def cmd_check(args: argparse.Namespace) -> int:
    device = check_device(args.device)
    backends, notes = available_backends(args.backend, device)
    dtypes = list(DTYPES.values()) if not args.dtype or "all" in args.dtype else [DTYPES[d] for d in args.dtype]
    families = ("moe", "nsa") if args.op == "all" else (args.op,)
    plan = []
    for backend in backends:
        # the Triton interpreter is slow: tiny shapes on CPU tensors
        tiny = args.tiny or (backend == "triton" and device.type == "cpu")
        for family in families:
            ops = MOE_OPS if family == "moe" else NSA_OPS
            cases = moe_cases(tiny) if family == "moe" else nsa_cases(tiny)
            for op in ops:
                for case in cases:
                    for dtype in dtypes:
                        plan.append((family, op, case, backend, dtype, device))
    for n in notes:
        print(f"note: {n}")
    devs = sorted({str(p[5]) for p in plan})
    print(f"{_prog()} check: {len(plan)} checks, backends {', '.join(backends)} on {', '.join(devs)}, "
          f"reference in float64 on CPU, seed {args.seed}")
    print(_fmt_row(COLUMNS))
    print(_fmt_row(tuple("-" * w for w in WIDTHS)))
    bar = _progress(len(plan))
    emit: Callable[[str], None] = bar.write if bar is not None else (lambda s: print(s, flush=True))
    results = []
    t0 = time.perf_counter()
    for family, op, case, backend, dtype, device in plan:
        if bar is not None:
            bar.set_description(f"{op} {backend} {DTYPE_NAMES[dtype]} {case.name}")
        r = run_one(family, op, case, backend, dtype, args.seed, device)
        results.append(r)
        if not (args.failures_only and r.ok):
            emit(_fmt_result(r))
        if r.error:
            emit(f"    error: {r.error}")
            if args.verbose and getattr(r, "trace", None):
                emit("    " + r.trace.rstrip().replace("\n", "\n    "))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    failed = [r for r in results if not r.ok]
    took = time.perf_counter() - t0
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {took:.1f} s"
          + (f"; {len(failed)} FAILED:" if failed else ""))
    for r in failed:
        print(f"  FAIL {r.op} [{r.backend}, {r.dtype}, {r.case}]: "
              + (r.error or f"{r.worst}: rel RMS error {r.err:.3e} > tolerance {r.tol:.0e}"))
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------------------------


def benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the source checkout this package runs from (not part of an installed wheel)."""
    env = os.environ.get("SPARSEOPS_BENCHMARKS")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if (c / "moe.py").is_file() or (c / "nsa.py").is_file():
            return c
    return None


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module; SystemExit with a clear message when it is not there."""
    d = benchmarks_dir()
    if d is None or not (d / f"{name}.py").is_file():
        where = Path(__file__).resolve().parents[2] / "benchmarks"
        raise SystemExit(
            f"{_prog()} bench: benchmarks/{name}.py not found (looked in {where} and ./benchmarks). "
            "The benchmark scripts live in the source checkout, not in the installed package: run from a clone "
            "of the repository (pip install -e .), or set SPARSEOPS_BENCHMARKS=/path/to/benchmarks."
        )
    path = d / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"sparseops_benchmarks_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(d))  # let a script import its sibling helpers
    try:
        spec.loader.exec_module(mod)
    finally:
        if sys.path and sys.path[0] == str(d):
            sys.path.pop(0)
    if not callable(getattr(mod, "run", None)):
        raise SystemExit(f"{_prog()} bench: {path} has no run(quick, smoke, out) function")
    return mod


def _fmt_cell(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """Rows of dicts -> an aligned text table (columns in first-seen order)."""
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    cells = [[_fmt_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


_PATH_KEYS = ("json", "png", "csv", "path", "paths", "files", "written")


def summarize_bench(name: str, result, mod=None) -> list[str]:
    """Print-ready lines for one benchmark's ``run`` result: its side-by-side table (the script's own
    ``markdown_table(record) -> str`` or ``print_table(record)`` when it has one, else the rows), the
    correctness gate, and any file paths the result names."""
    lines = [f"== benchmarks/{name}.py"]
    if not isinstance(result, dict):
        lines.append(str(result))
        return lines
    formatter = next((getattr(mod, n) for n in ("markdown_table", "format_table") if callable(getattr(mod, n, None))), None)
    printer = getattr(mod, "print_table", None)
    if formatter is not None:
        lines += str(formatter(result)).rstrip("\n").splitlines()
    elif callable(printer):
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            printer(result)
        lines += buf.getvalue().rstrip("\n").splitlines()
    elif isinstance(result.get("table"), str):
        lines.append(result["table"])
    else:
        rows = result.get("rows") or result.get("results")
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            lines.append(format_table(rows))
    gate = result.get("gate")
    if isinstance(gate, list) and gate and all(isinstance(g, dict) and "err" in g and "tol" in g for g in gate):
        ok = sum(1 for g in gate if g["err"] <= g["tol"])
        worst = max(gate, key=lambda g: g["err"] / g["tol"] if g["tol"] else math.inf)
        lines.append(f"correctness gate vs reference: {ok}/{len(gate)} within tolerance "
                     f"(worst {worst.get('what', '?')}: {worst['err']:.2e} <= {worst['tol']:.0e})")
    files = []
    for k, v in result.items():
        if any(p == k.lower() or k.lower().endswith("_" + p) for p in _PATH_KEYS):
            if isinstance(v, (str, Path)):
                files.append(str(v))
            elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, Path)) for x in v):
                files += [str(x) for x in v]
    if files:
        lines.append("written: " + ", ".join(files))
    return lines


def _written_files(out: Path, name: str, since: float) -> list[str]:
    """The result files ``<out>/<name>.*`` the run wrote (modified since it started)."""
    if not out.is_dir():
        return []
    return sorted(str(p) for p in out.glob(f"{name}.*") if p.is_file() and p.stat().st_mtime >= since - 1)


def cmd_bench(args: argparse.Namespace) -> int:
    names = ["moe", "nsa"] if args.op == "all" else [args.op]
    mods = [(n, load_benchmark(n)) for n in names]  # fail before running anything
    status = 0
    for name, mod in mods:
        if args.out:
            out = Path(args.out)
        elif args.smoke:  # a plumbing check: its rows must not join the recorded results
            out = Path(tempfile.mkdtemp(prefix=f"sparseops-bench-smoke-{name}-"))
        else:
            out = Path(mod.__file__).resolve().parent / "results"
        t0 = time.perf_counter()
        started = time.time()
        try:
            result = mod.run(quick=args.quick, smoke=args.smoke, out=out)
        except Exception as exc:
            print(f"== benchmarks/{name}.py FAILED: {type(exc).__name__}: {exc}")
            status = 1
            continue
        for line in summarize_bench(name, result, mod):
            print(line)
        files = _written_files(out, name, started)
        print(f"results: {', '.join(files) if files else f'(nothing named {name}.* written in {out})'}")
        print(f"({name} took {time.perf_counter() - t0:.1f} s)")
        if isinstance(result, dict) and result.get("ok", True) is False:
            status = 1
    return status


# ----------------------------------------------------------------------------------------------------------------
# fit: which NSA kernels a GPU can hold, compiled offline
# ----------------------------------------------------------------------------------------------------------------


def fit_lines(rows: list[dict]) -> list[str]:
    """The rows of ``nsa.triton_impl.compile_report`` as a table, one launch per line."""
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['variant']:<14} does not fit: {r['error']}")
        else:
            rows = f"rows={r['rows']}" if r.get("rows") else ""
            keys = f"keys={r['keys']}" if r.get("keys") else ""
            lines.append(f"  {r['variant']:<14} {r['kernel']:<24} {rows:<7} {keys:<8} warps={r['warps']:<2} "
                         f"stages={r['stages']} "
                         f"smem={r['shared'] / 1024:>6.1f} KiB  regs={r['registers']:<3} spill={r['spill_bytes']} B")
    return lines


def cmd_fit(args: argparse.Namespace) -> int:
    if _checks.triton_interpret():
        print("sparseops fit compiles the kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    if not _checks.triton_available():
        print("sparseops fit needs triton (pip install sparseops[triton])", file=sys.stderr)
        return 2
    from . import _triton
    from .nsa import triton_impl

    arch = args.arch
    if arch is None:
        arch = _triton.arch(torch.device("cuda")) if torch.cuda.is_available() else 90
        if arch not in _triton.SHARED_LIMIT:
            print(f"sparseops fit: this GPU is sm_{arch}; pass --arch (one of {sorted(_triton.SHARED_LIMIT)})",
                  file=sys.stderr)
            return 2
    shape = dict(G=args.group, N2=args.kv_heads, Dqk=args.dqk, Dv=args.dv, bs=args.block_size, K=args.block_count)
    try:
        rows = triton_impl.compile_report(arch, **shape, dtype=DTYPES[args.dtype], causal=not args.no_causal)
    except (ValueError, TypeError) as e:
        print(f"sparseops fit: {e}", file=sys.stderr)
        return 2
    print(f"NSA selected attention, {args.dtype}, " + ", ".join(f"{k}={v}" for k, v in shape.items())
          + f", {'not ' if args.no_causal else ''}causal: compiled for sm_{arch} ({_triton.GPU_NAMES[arch]}, "
          f"{_triton.SHARED_LIMIT[arch] // 1024} KiB of shared memory per program), nothing run")
    for line in fit_lines(rows):
        print(line)
    bad = sorted({r["variant"] for r in rows if "error" in r})
    if bad:
        print(f"does not fit: {', '.join(bad)}. backend='triton' raises there; backend='auto' runs the torch path "
              "for what does not fit")
        return 1
    spill = max(r["spill_bytes"] for r in rows)
    print("fits: backend='triton' (and 'auto') runs every kernel on such a GPU"
          + (f"; up to {spill} bytes of register spill per thread" if spill else ", without register spills"))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="sparseops: MoE token permute/unpermute with EP ranges and NSA selected attention.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {sparseops.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{info,check,bench,fit}")

    pi = sub.add_parser("info", help="versions, device, backend availability",
                        description="Print versions, the device, triton availability and which backend auto picks.")
    pi.set_defaults(func=cmd_info)

    pc = sub.add_parser(
        "check", help="check every op and backend against the float64 reference",
        description="Run every public op (forward, seed grads, autograd backward) on every available backend "
        "against the reference oracle in float64 on random inputs (varlen, GQA, EP windows partial and empty, "
        "fp32/fp16/bf16). Exit status 1 on any mismatch or exception.",
    )
    pc.add_argument("--backend", choices=("torch", "triton", "all"), default="all",
                    help="backends to check; all = torch, plus triton when CUDA or TRITON_INTERPRET=1 (default)")
    pc.add_argument("--dtype", nargs="+", choices=(*DTYPES, "all"), default=None,
                    help="input dtypes (default: all = fp32 fp16 bf16)")
    pc.add_argument("--op", choices=("moe", "nsa", "all"), default="all", help="op family (default all)")
    pc.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    pc.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="device of the inputs (default: cuda when available; triton on CPU needs TRITON_INTERPRET=1)")
    pc.add_argument("--tiny", "--quick", dest="tiny", action="store_true",
                    help="tiny shapes for every backend (a fast smoke check)")
    pc.add_argument("--failures-only", action="store_true", help="print only the failing rows")
    pc.add_argument("-v", "--verbose", action="store_true", help="print the traceback of every exception")
    pc.set_defaults(func=cmd_check)

    pb = sub.add_parser(
        "bench", help="run the benchmark scripts of a source checkout",
        description="Run benchmarks/moe.py and/or benchmarks/nsa.py from the repository checkout (they are not "
        "installed with the package) and print their tables and where the JSON/PNG results were written.",
    )
    pb.add_argument("--op", choices=("moe", "nsa", "all"), default="all", help="which benchmark (default all)")
    pb.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    pb.add_argument("--smoke", action="store_true", help="the smallest run that exercises every code path (for CI)")
    pb.add_argument("--out", metavar="DIR", default=None, help="directory for the JSON/PNG results (default: benchmarks/results/, the recorded runs; with --smoke a new temporary directory)")
    pb.set_defaults(func=cmd_bench)

    pf = sub.add_parser(
        "fit", help="will the NSA Triton kernels fit a GPU at a shape (compiled offline, no GPU needed)",
        description="Compile the NSA selected-attention Triton kernels (forward; backward atomic, deterministic and "
        "DQ_ATOMIC) for a GPU architecture at one shape, without running them and without a GPU, and print each "
        "kernel's shared memory, registers and register spill. Exit status 1 when a kernel does not fit that "
        "GPU (backend='triton' would raise there, 'auto' runs the torch path).",
    )
    pf.add_argument("--arch", type=int, choices=(80, 86, 89, 90, 100, 120), default=None,
                    help="compute capability x10: 90 H100/H200, 100 B200, 80 A100, 86/89/120 consumer Ampere/Ada/"
                    "Blackwell (default: this machine's GPU, else 90)")
    pf.add_argument("--group", "-G", type=int, default=16, help="query heads per KV head, G = N1 / N2 (default 16)")
    pf.add_argument("--kv-heads", type=int, default=4, help="KV heads N2 (default 4)")
    pf.add_argument("--dqk", type=int, default=192, help="query/key head dim (default 192)")
    pf.add_argument("--dv", type=int, default=128, help="value head dim (default 128)")
    pf.add_argument("--block-size", type=int, default=64, help="selected_block_size (default 64)")
    pf.add_argument("--block-count", type=int, default=16, help="selected_block_count K (default 16)")
    pf.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="input dtype (default bf16)")
    pf.add_argument("--no-causal", action="store_true", help="sparse_mode 0 instead of 2")
    pf.set_defaults(func=cmd_fit)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``sparseops`` command line; returns the exit status (0 ok, 1 a check failed, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
