"""Chunked masked attention: the engine of the compressed and the sliding-window branches (docs/nsa-module.md).

Queries are cut into chunks of consecutive tokens of one sequence; a chunk attends one contiguous range of key
rows, and a positional rule masks what each query may see: key row ``r`` of a chunk has the *key position*
``kstart + r * kstep`` (a token's position for the window, the last position of a compressed block for the
compressed branch), and query position ``p`` sees it iff ``0 <= p - key_position < span``. A chunk's scores are
one batched matmul ``[N2, Tq*G, Dqk] x [N2, Dqk, Tk]``; its size is bounded by :class:`ChunkSettings`, so no
``[T, T]`` (or ``[T, C]``) tensor is ever made. The backward recomputes each chunk's probabilities from the
saved log-sum-exp (flash-attention style) instead of saving them.

Arithmetic is fp32 (float64 for float64 inputs). A query that sees no key gets ``o = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _autograd
from .. import _cpu_attention as cpu_attention
from .._numerics import exp_floor, row_dot, without_autocast
from .._settings import Settings
from .._varlen import seq_lengths, token_seq_positions
from .checks import stats_dtype


@dataclasses.dataclass(frozen=True)
class ChunkSettings:
    #: bytes of one chunk's score tensor; the backward holds about three of them
    chunk_bytes: int = 16 << 20
    #: most query tokens per window chunk: a chunk computes ``rows + w - 1`` keys for ``w`` useful ones, so
    #: smaller chunks waste less, larger ones make larger matmuls
    window_rows: int = 256
    #: and at most this many matmul rows (tokens x G query heads of a KV head): with G = 16, chunks of 64
    #: tokens still make 1024-row matmuls and waste 12 % of the keys instead of 50 %
    window_matrix_rows: int = 1024
    #: on the CPU, the C++ attention kernels in range mode (``sparseops._cpu_attention``: each
    #: token's contiguous keys read in place, its query heads in vector lanes) where they build and either the
    #: query heads per KV head fill a vector (16 fp32, 8 float64) or the cost model below expects them to be
    #: faster than the chunks; the chunks otherwise
    cpu_kernels: bool = True
    #: the cost model (docs/perf.md, "Window and compressed branches: kernels or chunks"), in ns on one thread:
    #: a kernel (token, key, KV head) triple per element of ``Dqk + Dv`` (forward and backward; about constant
    #: below a vector of query heads, whose lanes then idle)
    kernel_pair_ns: float = 1.5
    #: a chunk's score entry (query head x key row it computes, the masked ones included) per element of
    #: ``Dqk + Dv`` (matmuls, forward and backward)
    chunk_entry_ns: float = 0.2
    #: a chunk's fixed cost (its Python, small tensors and calls, forward and backward)
    chunk_call_ns: float = 200_000.0
    #: ``select_blocks``: a sequence whose queries that see a compressed block take at most this many bytes (rows x
    #: N1 x Dqk in the score dtype) is scored with sequences of like length in one padded batch, a larger one alone:
    #: gathering its rows into a batch would cost more than a chunk's fixed cost (docs/perf.md, "select_blocks: batches
    #: of sequences")
    select_group_bytes: int = 8 << 20


SETTINGS = Settings(ChunkSettings())

#: one chunk: query rows ``[q0, q1)``, key rows ``[k0, k1)``, the in-sequence position of query row q0, and the
#: key position of key row k0
Chunk = tuple[int, int, int, int, int, int]


def window_chunks(cu: list[int], window: int, n1: int, elt: int, g: int = 1) -> list[Chunk]:
    """Chunks of the sliding window: a chunk of positions ``[p0, p1)`` sees keys ``[max(0, p0 - w + 1), p1)``;
    ``g`` query heads per KV head."""
    cfg = SETTINGS.get()
    cap = max(1, min(cfg.window_rows, cfg.window_matrix_rows // g))
    rows = max(1, min(cap, cfg.chunk_bytes // max(1, n1 * elt * (cap + window - 1))))
    chunks = []
    for b in range(len(cu) - 1):
        s, L = cu[b], cu[b + 1] - cu[b]
        for p0 in range(0, L, rows):
            p1 = min(L, p0 + rows)
            lo = max(0, p0 - window + 1)
            chunks.append((s + p0, s + p1, s + lo, s + p1, p0, lo))
    return chunks


def compressed_chunks(cu: list[int], cu_cmp: list[int], l: int, d: int, n1: int, elt: int) -> list[Chunk]:
    """Chunks of the compressed branch: position ``p`` sees blocks ``j`` with ``j*d + l - 1 <= p``; positions
    ``p < l - 1`` see none and belong to no chunk."""
    budget = SETTINGS.get().chunk_bytes
    chunks = []
    for b in range(len(cu) - 1):
        s, L, c, C = cu[b], cu[b + 1] - cu[b], cu_cmp[b], cu_cmp[b + 1] - cu_cmp[b]
        if C == 0:
            continue
        rows = max(1, budget // (n1 * elt * C))
        for p0 in range(l - 1, L, rows):
            p1 = min(L, p0 + rows)
            nv = (p1 - 1 - (l - 1)) // d + 1
            chunks.append((s + p0, s + p1, c, c + nv, p0, l - 1))
    return chunks


def _heads_first(x: torch.Tensor, n2: int) -> torch.Tensor:
    """``[Tq, N1, D]`` -> ``[N2, Tq*G, D]`` (query head ``n2*G + g`` of token t at row ``t*G + g``); ``[M, Tq, N1, D]``
    (M sequences of Tq tokens) -> ``[M*N2, Tq*G, D]``, sequence i's KV head n2 at ``i*N2 + n2``."""
    *lead, Tq, N1, D = x.shape
    G = N1 // n2
    return x.view(*lead, Tq, n2, G, D).transpose(-4, -3).reshape(-1, Tq * G, D)


def _tokens_first(x: torch.Tensor, tq: int) -> torch.Tensor:
    """``[N2, Tq*G, D]`` -> ``[Tq, N1, D]``."""
    n2, _, D = x.shape
    return x.view(n2, tq, -1, D).transpose(0, 1).reshape(tq, -1, D)


def _edges(chunk, kstep, span, tq, dev):
    """``[(c0, c1, hidden [Tq, c1 - c0])]``: the key columns some query of the chunk does not see, and which.

    Column ``r`` (key position ``kp = kstart + r * kstep``) is seen by every query of positions ``[p0, p0 + Tq)``
    iff ``p0 + Tq - 1 - span < kp <= p0``; the others lie in at most two ranges, before (the window's older
    keys) and after (the causal triangle). Only those are masked: for the window they are ``2 * Tq`` of
    ``Tq + w - 1`` columns, for the compressed blocks the last ``Tq / d``."""
    _, _, k0, k1, qpos0, kstart = chunk
    tk = k1 - k0
    hi = min(tk, max(0, (qpos0 - kstart) // kstep + 1))
    lo = 0 if span is None else min(hi, max(0, (qpos0 + tq - 1 - span - kstart) // kstep + 1))
    out = []
    for c0, c1 in ((0, lo), (hi, tk)):
        if c1 > c0:
            diff = (torch.arange(qpos0, qpos0 + tq, device=dev)[:, None]
                    - torch.arange(kstart + c0 * kstep, kstart + c1 * kstep, kstep, device=dev)[None, :])
            hidden = diff < 0
            if span is not None:
                hidden |= diff >= span
            out.append((c0, c1, hidden[None, :, None, :]))
    return out


def _exp_(s, edges, floor):
    """``s`` <- ``exp(s)``, 0 on the hidden keys of ``edges``. The edge columns are clamped to ``[floor, 80]``
    first: ``exp`` of -inf or of anything that underflows takes a slow path on x86 CPUs (docs/perf.md), and their
    hidden keys may hold any value, as they are set to 0 after."""
    for c0, c1, _ in edges:
        s[..., c0:c1].clamp_(floor, 80.0)
    s.exp_()
    for c0, c1, hidden in edges:
        s[..., c0:c1].masked_fill_(hidden, 0.0)
    return s


def _scores(qh, kc, chunk, tq):
    """Scaled scores ``[N2, Tq, G, Tk]``, every key included."""
    _, _, k0, k1, _, _ = chunk
    return torch.bmm(qh, kc.permute(1, 2, 0)).view(kc.shape[1], tq, -1, k1 - k0)


def attention_forward(q, k, v, chunks, kstep, span, scale):
    """``(o [T, N1, Dv]`` in q's dtype, ``lse [T, N1]`` fp32/float64) over ``chunks``."""
    T, N1, _ = q.shape
    n2, Dv = k.shape[1], v.shape[2]
    cdt = stats_dtype(q.dtype)
    o = q.new_zeros((T, N1, Dv))
    lse = q.new_full((T, N1), float("-inf"), dtype=cdt)
    floor = exp_floor(cdt)
    for chunk in chunks:
        q0, q1, k0, k1 = chunk[:4]
        tq = q1 - q0
        qh = _heads_first(q[q0:q1].to(cdt), n2) * scale
        s = _scores(qh, k[k0:k1].to(cdt), chunk, tq)
        edges = _edges(chunk, kstep, span, tq, q.device)
        for c0, c1, hidden in edges:
            s[..., c0:c1].masked_fill_(hidden, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(m == float("-inf"), 0.0, m)
        p = _exp_(s.sub_(m), edges, floor)
        den = p.sum(-1)
        oc = torch.bmm(p.view(n2, tq * (N1 // n2), k1 - k0), v[k0:k1].to(cdt).transpose(0, 1))
        oc = oc / torch.where(den > 0, den, 1.0).view(n2, -1, 1)
        o[q0:q1] = _tokens_first(oc, tq).to(o.dtype)
        lse[q0:q1] = (m.squeeze(-1) + den.log()).transpose(0, 1).reshape(tq, N1)
    return o, lse


def attention_backward(q, k, v, o, lse, do, chunks, kstep, span, scale):
    """``(dq, dk, dv)`` of :func:`attention_forward`, recomputing each chunk's probabilities from ``lse``."""
    n2 = k.shape[1]
    cdt = stats_dtype(q.dtype)
    dq = torch.zeros_like(q)
    # [N2, T, D]: the chunks' dK, dV are added in place by baddbmm_ (no per-chunk product and add)
    dk = torch.zeros((n2, k.shape[0], k.shape[2]), dtype=cdt, device=k.device)
    dv = torch.zeros((n2, v.shape[0], v.shape[2]), dtype=cdt, device=v.device)
    delta = row_dot(do, o, cdt)
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse)
    floor = exp_floor(cdt)
    for chunk in chunks:
        q0, q1, k0, k1 = chunk[:4]
        tq, tk = q1 - q0, k1 - k0
        qh = _heads_first(q[q0:q1].to(cdt), n2) * scale
        kc, vc = k[k0:k1].to(cdt), v[k0:k1].to(cdt)
        s = _scores(qh, kc, chunk, tq)
        p = _exp_(s.sub_(lse_safe[q0:q1].view(tq, n2, -1).transpose(0, 1)[..., None]),
                  _edges(chunk, kstep, span, tq, q.device), floor)
        doh = _heads_first(do[q0:q1].to(cdt), n2)
        dp = torch.bmm(doh, vc.permute(1, 2, 0)).view(p.shape)
        ds = dp.sub_(delta[q0:q1].view(tq, n2, -1).transpose(0, 1)[..., None]).mul_(p).view(n2, -1, tk)
        p = p.view(n2, -1, tk)
        dq[q0:q1] = (_tokens_first(torch.bmm(ds, kc.transpose(0, 1)), tq) * scale).to(dq.dtype)
        dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), qh)
        dv[:, k0:k1].baddbmm_(p.transpose(1, 2), doh)
    return dq, dk.transpose(0, 1).to(k.dtype).contiguous(), dv.transpose(0, 1).to(v.dtype).contiguous()


def _plan(q, k, cu, cu_k, l, d, window):
    """The chunks and the key rule: ``window > 0`` the sliding window, else the compressed blocks of ``(l, d)``."""
    elt = 8 if q.dtype == torch.float64 else 4
    if window > 0:
        return window_chunks(cu, window, q.shape[1], elt, q.shape[1] // k.shape[1]), 1, window
    return compressed_chunks(cu, cu_k, l, d, q.shape[1], elt), d, None


def _route(q, k, v, cu, cu_k, l, d, window):
    """``("ranges", lo, hi)``: the C++ kernels over each token's key rows, or ``("chunks", chunks, kstep, span)``.
    Below a vector of query heads per KV head the kernels' lanes idle, while the chunks pay a fixed cost per chunk
    (at least one per sequence) and compute masked keys (a window chunk ``rows + w - 1`` keys for ``w`` useful):
    the cheaper by :class:`ChunkSettings`' cost model runs (many short sequences, small windows: the kernels)."""
    cfg = SETTINGS.get()
    kernels = cfg.cpu_kernels and cpu_attention.available(q)
    if kernels and cpu_attention.fills_lanes(q, k):
        return ("ranges", *key_ranges(cu, cu_k, l, d, window))
    chunks, kstep, span = _plan(q, k, cu, cu_k, l, d, window)
    if kernels and chunks:
        lo, hi = key_ranges(cu, cu_k, l, d, window)
        width = q.shape[2] + v.shape[2]
        chunk_ns = sum(
            cfg.chunk_call_ns + (c[1] - c[0]) * (c[3] - c[2]) * q.shape[1] * width * cfg.chunk_entry_ns
            for c in chunks)
        if int((hi - lo).sum()) * k.shape[1] * width * cfg.kernel_pair_ns < chunk_ns:
            return "ranges", lo, hi
    return "chunks", chunks, kstep, span


def key_ranges(cu: list[int], cu_k: list[int], l: int, d: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token the key rows it sees, ``[lo, hi)`` (int64, CPU): the window's ``w`` latest tokens up to
    itself (``window > 0``), else the compressed blocks ``j`` of its sequence with ``j*d + l - 1 <= p``."""
    seq, pos = token_seq_positions(cu)
    start = torch.tensor(cu_k[:-1], dtype=torch.int64)[seq]
    if window > 0:
        return start + (pos - window + 1).clamp_(min=0), start + pos + 1
    count = torch.tensor(seq_lengths(cu_k), dtype=torch.int64)[seq]
    seen = torch.where(pos >= l - 1, torch.div(pos - (l - 1), d, rounding_mode="floor") + 1, 0)
    return start, start + torch.minimum(seen, count)


# Custom ops: torch.compile sees one opaque node per call (the chunk plan reads the settings and loops in Python).
# Autocast off inside: the products are in the inputs' dtype with fp32 accumulation, by choice.
@torch.library.custom_op("sparseops::nsa_chunked_attention_fwd", mutates_args=())
@without_autocast
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], cu_k: list[int], l: int, d: int,
            window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    path, *plan = _route(q, k, v, cu, cu_k, l, d, window)
    if path == "ranges":
        return cpu_attention.forward_ranges(q, k, v, *plan, scale)
    return attention_forward(q, k, v, *plan, scale)


@_fwd_op.register_fake
def _(q, k, v, cu, cu_k, l, d, window, scale):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(q.shape[:2], dtype=stats_dtype(q.dtype))


@torch.library.custom_op("sparseops::nsa_chunked_attention_bwd", mutates_args=())
@without_autocast
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
            cu: list[int], cu_k: list[int], l: int, d: int, window: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path, *plan = _route(q, k, v, cu, cu_k, l, d, window)
    if path == "ranges":
        return cpu_attention.backward_ranges(q, k, v, o, lse, do, *plan, scale)
    return attention_backward(q, k, v, o, lse, do, *plan, scale)


@_bwd_op.register_fake
def _(q, k, v, o, lse, do, cu, cu_k, l, d, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu, cu_k, l, d, window, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (cu, cu_k, l, d, window, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _bwd_op(q, k, v, o, lse, do.contiguous(), *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_autograd.register(_bwd_op, "the backward of sliding_window_attention / compressed_attention")


def chunked_attention(q, k, v, cu: list[int], cu_k: list[int], l: int, d: int, window: int, scale: float):
    """``(o [T, N1, Dv], lse [T, N1])``: the sliding window of ``window`` keys (``window > 0``, keys are tokens,
    ``cu_k = cu``), else the compressed blocks ``(l, d)`` (keys are blocks, ``cu_k`` their cumulative counts).
    Differentiable in q, k and v; ``lse`` is not."""
    return _fwd_op(q, k, v, list(cu), list(cu_k), l, d, window, float(scale))
