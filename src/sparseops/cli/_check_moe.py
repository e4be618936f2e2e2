"""``sparseops check`` for the MoE ops: the cases and one check per (op, case, backend, dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sparseops
from sparseops import testing
from sparseops.moe import reference as moe_ref

from ._check_common import EXACT, Cmp, Timer, f64, grad_or_zeros, norm_range, oracle, rand, tolerance

OPS = (
    "moe_token_permute_with_ep",
    "moe_token_unpermute_with_ep",
    "moe_token_unpermute_with_ep_grad",
    "moe_token_permute_with_ep_grad",
    "moe_token_permute_with_ep.backward",
    "moe_token_unpermute_with_ep.backward",
)

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



def cases(tiny: bool) -> list[MoeCase]:
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



def _setup(case: MoeCase, dtype, seed, device):
    inp = testing.make_moe_inputs(
        case.T, case.K, case.H, num_experts=case.E, dtype=dtype, probs_dtype=case.probs_dtype or dtype,
        index_dtype=case.index_dtype, seed=seed,
    )
    N = case.T * case.K
    if case.range is not None:
        s, e = norm_range(case.range, N)
    elif case.num_out_tokens > 0:
        s, e = 0, min(case.num_out_tokens, N)
    else:
        s, e = 0, N
    si = oracle(moe_ref.sorted_indices_from, inp["indices"])  # int32, CPU: the oracle's slot -> row map
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


def check(op: str, case: MoeCase, backend: str, dtype, seed: int, device) -> tuple[list[Cmp], float]:
    d = _setup(case, dtype, seed, device)
    K, s, e, R, H, T = case.K, d["s"], d["e"], d["R"], case.H, case.T
    probs, rng, si, si_ref, g = d["probs"], d["range"], d["si"], d["si_ref"], d["g"]
    kw = {"backend": backend, "validate": True}
    tm = Timer(device)
    pdt = probs.dtype if probs is not None else dtype

    if op == "moe_token_permute_with_ep":
        with tm:
            pt, si_out, pp = sparseops.moe_token_permute_with_ep(
                d["tokens"], d["indices"], probs, rng, case.num_out_tokens, False, **kw
            )
        ept, epp = oracle(moe_ref.permute, f64(d["tokens"]), si_ref, f64(probs), K, s, e)
        si_cmp = si_out.to("cpu", torch.int64) if isinstance(si_out, torch.Tensor) else si_out
        return [
            ("sorted_indices", si_cmp, si_ref.to(torch.int64), EXACT, None),
            ("permuted_tokens", pt, ept, tolerance(dtype, pt), None),
            ("permuted_probs", pp, epp, tolerance(pdt, pp), None),
        ], tm.ms

    if op == "moe_token_unpermute_with_ep":
        pt = rand((R, H), dtype, g, device)
        with tm:
            out = sparseops.moe_token_unpermute_with_ep(pt, si, probs, K, rng, False, None, **kw)
        exp = oracle(moe_ref.unpermute, f64(pt), si_ref, f64(probs), K, s, e)
        return [("unpermuted_tokens", out, exp, tolerance(dtype, out), None)], tm.ms

    if op == "moe_token_unpermute_with_ep_grad":
        grad = rand((T, H), dtype, g, device)
        pt = rand((R, H), dtype, g, device) if probs is not None else None
        with tm:
            ptg, pg = sparseops.moe_token_unpermute_with_ep_grad(grad, si, pt, probs, False, None, rng, K, **kw)
        eptg, epg = oracle(moe_ref.unpermute_grad, f64(grad), si_ref, f64(pt), f64(probs), K, s, e)
        return [
            ("permuted_tokens_grad", ptg, eptg, tolerance(dtype, ptg), None),
            ("probs_grad", pg, epg, tolerance(pdt, pg), None),
        ], tm.ms

    if op == "moe_token_permute_with_ep_grad":
        ptg = rand((R, H), dtype, g, device)
        ppg = rand((R,), pdt, g, device) if probs is not None else None
        with tm:
            tg, pg = sparseops.moe_token_permute_with_ep_grad(ptg, si, ppg, K, rng, False, **kw)
        etg, epg = oracle(moe_ref.permute_grad, f64(ptg), si_ref, f64(ppg), K, s, e)
        return [
            ("tokens_grad", tg, etg, tolerance(dtype, tg), None),
            ("probs_grad", pg, epg, tolerance(pdt, pg), None),
        ], tm.ms

    if op == "moe_token_permute_with_ep.backward":
        tokens = d["tokens"].clone().requires_grad_(True)
        p = None if probs is None else probs.clone().requires_grad_(True)
        gpt = rand((R, H), dtype, g, device)
        gpp = rand((R,), pdt, g, device) if probs is not None else None
        with tm:
            pt, _, pp = sparseops.moe_token_permute_with_ep(tokens, d["indices"], p, rng, case.num_out_tokens, False, **kw)
            outs = [(pt, gpt), (pp, gpp)]
            outs = [(o, go) for o, go in outs if o is not None and o.requires_grad]
            if outs:
                torch.autograd.backward([o for o, _ in outs], [go for _, go in outs])
        etg, epg = oracle(moe_ref.permute_grad, f64(gpt), si_ref, f64(gpp), K, s, e)
        return [
            ("tokens.grad", grad_or_zeros(tokens), etg, tolerance(dtype, tokens), None),
            ("probs.grad", None if p is None else grad_or_zeros(p), epg, tolerance(pdt, p), None),
        ], tm.ms

    if op == "moe_token_unpermute_with_ep.backward":
        pt = rand((R, H), dtype, g, device).requires_grad_(True)
        p = None if probs is None else probs.clone().requires_grad_(True)
        gout = rand((T, H), dtype, g, device)
        with tm:
            out = sparseops.moe_token_unpermute_with_ep(pt, si, p, K, rng, False, None, **kw)
            if out.requires_grad:
                out.backward(gout)
        eptg, epg = oracle(moe_ref.unpermute_grad, f64(gout), si_ref, f64(pt), f64(p), K, s, e)
        return [
            ("permuted_tokens.grad", grad_or_zeros(pt), eptg, tolerance(dtype, pt), None),
            ("probs.grad", None if p is None else grad_or_zeros(p), epg, tolerance(pdt, p), None),
        ], tm.ms

    raise KeyError(op)


