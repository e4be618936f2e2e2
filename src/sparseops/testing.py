"""Test and benchmark helpers: the one tolerance table, a verbose comparison, input builders.

Tolerances (docs/nsa.md) are relative RMS errors against a float64 reference computed from the
same inputs. They are used for every op, MoE and NSA, and never tuned per test.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

#: relative RMS error allowed against a float64 reference, by the dtype of the inputs
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

#: relative error allowed for a distributed float64 training run (losses, gradients, parameters after several
#: optimizer steps) against the same run in one process: Adam's division by sqrt(v) amplifies the rounding of
#: the other summation orders of the data-parallel reductions
TRAINING_TOLERANCE = 1e-9


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCES[dtype]


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in float64; absolute RMS when ``expected`` is all zeros.
    NaN/inf in ``actual`` where ``expected`` is finite gives ``inf``; where ``expected`` is NaN/inf, ``actual`` must
    hold the same (NaN, or inf of the same sign), else ``inf``; the RMS is over the finite elements. Computed on
    ``actual``'s device (a host copy of GPU-sized results would take tens of seconds)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    if a.numel() == 0:
        return 0.0
    fin = torch.isfinite(e)
    if not fin.all():
        if not torch.equal(torch.isnan(a[~fin]), torch.isnan(e[~fin])):
            return math.inf
        nan = torch.isnan(e[~fin])
        if not torch.equal(a[~fin][~nan], e[~fin][~nan]):
            return math.inf
        a, e = a[fin], e[fin]
        if a.numel() == 0:
            return 0.0
    if not torch.isfinite(a).all():
        return math.inf
    num = (a - e).pow(2).mean().sqrt().item()
    den = e.pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, name: str = "output") -> None:
    """Assert ``rel_rms_error <= TOLERANCES[dtype]`` (dtype defaults to ``actual.dtype``), with a useful message."""
    dtype = dtype or actual.dtype
    tol = TOLERANCES[dtype]
    err = rel_rms_error(actual, expected)
    if not err <= tol:
        a = actual.detach().to("cpu", torch.float64)
        e = expected.detach().to("cpu", torch.float64)
        diff = (a - e).abs().nan_to_num(nan=math.inf)
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
        raise AssertionError(
            f"{name}: relative RMS error {err:.3e} > tolerance {tol:.0e} for {dtype}; "
            f"max |diff| {diff.max().item():.3e} at {where} (got {a[where].item() if where else '?'}, "
            f"expected {e[where].item() if where else '?'}); shape {tuple(a.shape)}"
        )


@contextlib.contextmanager
def torch_threads(n: int):
    """``torch.set_num_threads(n)`` for the block, the previous count restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh output with NaN (or -1 for ints) so that an unwritten element fails loudly."""
    return t.fill_(float("nan") if t.dtype.is_floating_point else -1)


# MoE inputs


def make_moe_inputs(
    T: int,
    K: int,
    H: int,
    *,
    num_experts: int = 8,
    dtype: torch.dtype = torch.float32,
    probs_dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    device="cpu",
    distinct_experts: bool = True,
) -> dict:
    """Random tokens ``[T, H]``, expert ids ``[T, K]`` (distinct per token when ``K <= num_experts`` and
    ``distinct_experts``), and router probs ``[T, K]`` (softmax over the K picks)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=g, dtype=torch.float64)
    if distinct_experts and K <= num_experts:
        scores = torch.rand(T, num_experts, generator=g)
        indices = scores.topk(K, dim=1).indices if T else torch.empty(0, K, dtype=torch.int64)
    else:
        indices = torch.randint(0, num_experts, (T, K), generator=g)
    probs = torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), dim=-1)
    return {
        "tokens": tokens.to(dtype).to(device),
        "indices": indices.to(index_dtype).to(device),
        "probs": probs.to(probs_dtype or dtype).to(device),
    }


def make_moe_case(
    T: int,
    K: int,
    H: int,
    window: tuple[int, int] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    probs_dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    device="cpu",
) -> dict:
    """The arguments of the MoE backend functions (``permute``, ``unpermute``, ``unpermute_grad``,
    ``permute_grad``) for one window ``[s, e)`` (None: all ``N = T*K`` rows), as tests and benchmarks call them.

    Returns ``tokens [T, H]``, ``indices [T, K]``, ``probs [T, K]`` (``probs_dtype``, default ``dtype``),
    ``si [N]`` (the slot -> row map of the indices, ``index_dtype``), ``x [R, H]`` (rows of the window, for
    unpermute / permute_grad), ``grad [T, H]``, ``ppg [R]`` (``probs_dtype``), and ``K``, ``s``, ``e``.
    """
    d = make_moe_inputs(T, K, H, dtype=dtype, probs_dtype=probs_dtype, index_dtype=index_dtype, seed=seed)
    flat = d["indices"].reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # row -> slot; its inverse is slot -> row
    si = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel())).to(index_dtype)
    s, e = (0, T * K) if window is None else window
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(e - s, H, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    ppg = torch.randn(e - s, generator=g, dtype=torch.float64).to(probs_dtype or dtype)
    out = {**d, "si": si, "x": x, "grad": grad, "ppg": ppg}
    return {**{k: v.to(device) for k, v in out.items()}, "K": K, "s": s, "e": e}


# NSA inputs


def _same_count(seq_lens_q, seq_lens_kv) -> None:
    if len(seq_lens_q) != len(seq_lens_kv):
        raise ValueError(f"seq_lens_kv: expected as many sequences as seq_lens_q ({len(seq_lens_q)}), "
                         f"got {len(seq_lens_kv)}")


def make_topk_indices(
    seq_lens_q: list[int],
    seq_lens_kv: list[int],
    N2: int,
    K: int,
    bs: int,
    *,
    causal: bool = True,
    empty_frac: float = 0.0,
    duplicates: bool = False,
    seed: int = 0,
    device="cpu",
    chunk: int = 4096,
    pattern: str = "uniform",
    window: int = 64,
) -> torch.Tensor:
    """Block ids ``[T1, N2, K]`` int32 local to each token's sequence, drawn without replacement from the blocks
    a query can use.

    ``seq_lens_q`` / ``seq_lens_kv`` are the per-sequence lengths (``[64, 32]``: two sequences), not the
    cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen`` of the ops (``[64, 96]`` for the same two).

    The blocks a query can use: causal, those that start at or before its position; else all of its sequence's.
    Slots with no block to draw are -1; ``empty_frac`` turns a random share of the others into -1;
    ``duplicates`` copies slot 0 into slot K-1 for a random half of the rows. Drawn on ``device`` (fast on a GPU
    at long sequences); on the CPU the draws depend only on ``seed``.

    ``pattern="uniform"``: every token draws its own blocks (neighbours rarely share one at long sequences).
    ``pattern="nsa"``: like NSA's selection, the first block and the token's own and previous blocks are always
    taken, and the rest are the best of scores shared by each ``window`` consecutive query tokens (NSA ranks
    blocks by compressed-attention scores, which change slowly from token to token), so neighbours share most
    of their blocks."""
    if pattern not in ("uniform", "nsa"):
        raise ValueError(f"pattern: expected 'uniform' or 'nsa', got {pattern!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected a positive int, got {window!r}")
    _same_count(seq_lens_q, seq_lens_kv)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    ar = functools.partial(torch.arange, device=device)
    if pattern == "nsa":
        chunk = max(window, chunk // window * window)  # whole windows per chunk: one score draw per window
    out = []
    for S1, S2 in zip(seq_lens_q, seq_lens_kv):
        nblk = max(1, -(-S2 // bs))
        for c0 in range(0, S1, chunk):
            c1 = min(S1, c0 + chunk)
            pos = ar(c0, c1)
            if pattern == "uniform":
                scores = torch.rand(c1 - c0, N2, nblk, generator=g, device=device)
            else:
                shared = torch.rand(-(-(c1 - c0) // window), N2, nblk, generator=g, device=device)
                scores = shared[torch.div(pos - c0, window, rounding_mode="floor")]
                own = torch.clamp(torch.div(pos, bs, rounding_mode="floor"), max=nblk - 1)
                for b in (torch.zeros_like(own), own, torch.clamp(own - 1, min=0)):
                    scores = scores.scatter(-1, b[:, None, None].expand(-1, N2, 1), 2.0)
            allowed = ar(nblk) * bs < S2
            allowed = allowed.expand(c1 - c0, nblk)
            if causal:
                allowed = allowed & (ar(nblk)[None, :] * bs <= pos[:, None])
            scores = scores.masked_fill(~allowed[:, None, :], -1.0)
            kk = min(K, nblk)
            val, idx = scores.topk(kk, dim=-1)
            idx = torch.where(val >= 0, idx, torch.full_like(idx, -1))
            if kk < K:
                idx = torch.cat([idx, idx.new_full((c1 - c0, N2, K - kk), -1)], dim=-1)
            out.append(idx)
    if not out:
        return torch.empty(0, N2, K, dtype=torch.int32, device=device)
    idx = torch.cat(out)
    if empty_frac > 0:
        drop = torch.rand(idx.shape, generator=g, device=device) < empty_frac
        idx = idx.masked_fill(drop, -1)
    if duplicates and K > 1:
        rows = torch.rand(idx.shape[:2], generator=g, device=device) < 0.5
        idx[..., K - 1] = torch.where(rows, idx[..., 0], idx[..., K - 1])
    return idx.to(torch.int32)


def make_nsa_inputs(
    seq_lens_q: list[int],
    seq_lens_kv: list[int] | None = None,
    *,
    N1: int = 4,
    N2: int = 2,
    Dqk: int = 32,
    Dv: int = 16,
    bs: int = 16,
    K: int = 2,
    dtype: torch.dtype = torch.float32,
    causal: bool = True,
    empty_frac: float = 0.0,
    duplicates: bool = False,
    seed: int = 0,
    device="cpu",
) -> dict:
    """Packed TND inputs for ``nsa_selected_attention``: q ``[T1,N1,Dqk]``, k ``[T2,N2,Dqk]``, v ``[T2,N2,Dv]``,
    topk ``[T1,N2,K]``, CANN cumulative lengths (no leading 0), and the keyword arguments of the op.

    ``seq_lens_q`` / ``seq_lens_kv`` (None: ``seq_lens_q``) are per-sequence lengths; the returned
    ``actual_seq_qlen`` / ``actual_seq_kvlen`` are their cumulative sums, as the ops take them."""
    seq_lens_kv = list(seq_lens_q) if seq_lens_kv is None else list(seq_lens_kv)
    _same_count(seq_lens_q, seq_lens_kv)
    g = torch.Generator().manual_seed(seed)
    T1, T2 = sum(seq_lens_q), sum(seq_lens_kv)
    q = torch.randn(T1, N1, Dqk, generator=g, dtype=torch.float64)
    k = torch.randn(T2, N2, Dqk, generator=g, dtype=torch.float64)
    v = torch.randn(T2, N2, Dv, generator=g, dtype=torch.float64)
    topk = make_topk_indices(
        seq_lens_q, seq_lens_kv, N2, K, bs, causal=causal, empty_frac=empty_frac, duplicates=duplicates,
        seed=seed + 1, device=device,
    )
    cq, ckv, a, b = [], [], 0, 0
    for s1, s2 in zip(seq_lens_q, seq_lens_kv):
        a += s1
        b += s2
        cq.append(a)
        ckv.append(b)
    return {
        "query": q.to(dtype).to(device),
        "key": k.to(dtype).to(device),
        "value": v.to(dtype).to(device),
        "topk_indices": topk,
        "scale_value": 1.0 / math.sqrt(Dqk),
        "head_num": N1,
        "selected_block_size": bs,
        "selected_block_count": K,
        "actual_seq_qlen": cq,
        "actual_seq_kvlen": ckv,
        "sparse_mode": 2 if causal else 0,
    }
