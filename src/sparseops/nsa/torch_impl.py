"""Vectorized PyTorch NSA selected attention: the CPU path and the fallback on every device (docs/nsa.md).

Arguments arrive validated (docs/internals.md). :class:`~.torch_plan.Plan` cuts the tokens into chunks and
lays out each chunk's work (:mod:`.torch_jobs`); this module runs the jobs:

1. the softmax is split like flash-decoding: each slot row gives its max, ``sum exp`` and unnormalised
   ``P V``; a token combines its slots by a gather over its slot rows (fixed slot order: deterministic), the
   same way ``dQ`` sums its slots. A duplicated block id is two slots, so it counts twice;
2. exponents are clamped at -80 before ``exp`` and invisible keys are multiplied by 0 afterwards: ``exp`` of
   a number below -87 (an fp32 denormal or 0) takes a slow path on x86 CPUs;
3. a row with no visible key gives ``out = 0``, ``m = 0``, ``l = 0`` (no NaN).

Each layout has one forward and one backward function of the same signature (:data:`_FORWARD`,
:data:`_BACKWARD`, keyed by ``job.layout``). Math is fp32 (float64 for float64 inputs); each output is rounded
once to its input's dtype.
"""

from __future__ import annotations

import torch

from .._numerics import acc_dtype, exp_floor, row_dot
from . import cpu_gather, torch_gather
from .torch_plan import SETTINGS, NsaTorchSettings, Plan

__all__ = ["SETTINGS", "NsaTorchSettings", "backward", "forward"]

_NEG_INF = float("-inf")


# The score-matrix elementwise chains, in place. Shapes: ``x [A, G, R, KB]`` scores, ``w [A, 1, R, KB]`` key
# weight (0 invisible, else the multiplicity), ``m [A, G, R, 1]`` row max. The backward needs no -inf mask:
# its weight zeroes the invisible keys. They stay eager: in place, inductor stores the probabilities twice and
# sums them in a second loop, which costs more than it fuses.


def _mask_(x, w):
    """``x`` <- -inf where ``w == 0`` (the mask is built at ``w``'s size, 1/G of ``x``, and added: a
    ``masked_fill_`` with a mask broadcast over G is several times slower). Scores are first clamped to the
    largest finite value, so a finite key whose score overflowed to +inf gives -inf where it is masked, not
    NaN (NaN stays NaN)."""
    return x.clamp_(max=torch.finfo(x.dtype).max).add_(torch.where(w == 0, _NEG_INF, 0.0))


def _softmax_fwd(x, w, acc):
    """``(mx, sm)`` ``[A, G, R, 1]``: the max over visible keys (0 when none) and the row sum of ``x``, which
    becomes ``exp(clamp(x - mx)) * w``."""
    mx = torch.amax(_mask_(x, w), dim=-1, keepdim=True)
    mx.masked_fill_(mx == _NEG_INF, 0.0)
    x.sub_(mx).clamp_(exp_floor(acc), 80.0).exp_().mul_(w)
    return mx, x.sum(dim=-1, keepdim=True)


def _probs(x, w, m, inv, acc, sum_out=None):
    """``x`` <- ``exp(clamp(x - m)) * w * inv`` (``w``, ``inv`` may be None: 1); its row sum into ``sum_out``."""
    x.sub_(m).clamp_(exp_floor(acc), 80.0).exp_()
    if w is not None:
        x.mul_(w)
    if inv is not None:
        x.mul_(inv)
    if sum_out is not None:
        torch.sum(x, dim=-1, keepdim=True, out=sum_out)


def _masked_max(x, w, out):
    """``out`` = max over keys with ``w > 0`` (``-inf`` when none; ``w`` None: all keys); ``x`` keeps -inf on
    the others."""
    torch.amax(x if w is None else _mask_(x, w), dim=-1, keepdim=True, out=out)


def _dsoftmax(ds, d, p):
    """``ds`` <- ``(ds - d) * p``."""
    return ds.sub_(d).mul_(p)


def _zero_hidden_(x, part):
    """``x [R, G, 1, BS]`` <- 0 on the invisible keys of the partial rows ``part`` (:meth:`TileBatch.partial_rows`;
    None: none). Their other rows went through ``exp`` unmasked, clamped to ``[floor, 80]``: finite."""
    if part is not None:
        rows, w = part
        x.index_copy_(0, rows, x.index_select(0, rows).mul_(w))


def _forward_global(job, q, kb, vb, scale, acc, out, m, l):
    """Writes ``out``, ``m``, ``l`` of ``job.tok`` from global tiles, in two passes over the tiles: each tile
    row's max, then (with each token's max over its slots) the probabilities, their sums and ``P V``, added into
    the token's row in tile order. The invisible keys are masked in the few partial rows only."""
    p, M = job.plan, job.M
    T1, N1, Dqk = q.shape
    G, N2, bs, Dv = p.G, p.N2, p.bs, vb.shape[-1]
    elt = torch.finfo(acc).bits // 8
    per_tile = (M * G * (Dqk + Dv + bs) + bs * (Dqk + Dv + M)) * elt
    batches = job.batches(per_tile, p.knobs.chunk_bytes)
    parts = [b.partial_rows(acc) for b in batches]
    qf = q.reshape(T1 * N2, G * Dqk)

    def scores(b):
        # the scale enters the matmul, not a pass over the gathered queries
        qt = b.rows(qf, acc)
        return torch.baddbmm(qt.new_empty(()), qt, b.gather(kb).transpose(1, 2), beta=0.0, alpha=scale)

    smax = torch.full((job.NT * M + 1, G), _NEG_INF, dtype=acc, device=q.device)
    i0 = 0
    for b, part in zip(batches, parts):
        s = scores(b).view(b.R, G, 1, bs)
        rmax = smax[i0:i0 + b.R].view(b.R, G, 1, 1)
        torch.amax(s, dim=-1, keepdim=True, out=rmax)
        if part is not None:
            rows, w = part
            rmax.index_copy_(0, rows, torch.amax(_mask_(s.index_select(0, rows), w), dim=-1, keepdim=True))
        i0 += b.R
    # a score that overflowed to +inf counts as the largest finite value (as in :func:`_mask_`)
    smax.clamp_(max=torch.finfo(acc).max)
    # [T1*N2, G]: the token's max over its slots; 0 when it has none
    mt = torch.nn.functional.embedding(job.slot_row, smax).view(T1 * N2, p.K, G).amax(dim=1)
    mt = torch.where(mt == _NEG_INF, 0.0, mt)
    # the sums, over the rows of job.tok (and one padding row)
    o = torch.zeros(job.n_acc + 1, G * Dv, dtype=acc, device=q.device)
    lt = torch.zeros(job.n_acc + 1, G, dtype=acc, device=q.device)
    for b, part in zip(batches, parts):
        s = scores(b)
        s4 = s.view(b.R, G, 1, bs)
        _probs(s4, None, b.rows(mt, acc).view(b.R, G, 1, 1), None, acc)
        _zero_hidden_(s4, part)
        lt.index_add_(0, b.row_acc, s4.sum(dim=-1).view(b.R, G))
        o.index_add_(0, b.row_acc, torch.bmm(s, b.gather(vb)).view(b.R, G * Dv))
    o[:-1].view(-1, G, Dv).mul_(torch.where(lt[:-1] > 0, 1.0 / lt[:-1], 0.0)[..., None])
    job.write(out, o)
    job.write(l, lt)
    m.index_copy_(0, job.tok, mt.view(T1, N1)[job.tok])


def _forward_union(job, q, kb, vb, scale, acc, out, m, l):
    """Writes ``out``, ``m``, ``l`` of the chunk's tokens from its union layout."""
    _write_chunk(job, out, m, l, *_union_chunk(job, q[job.t0:job.t0 + job.C].to(acc) * scale, kb, vb, acc))


def _union_chunk(job, qs, kb, vb, acc):
    """``(out [C, N1, Dv], m [C, N1], l [C, N1])`` of a union chunk, in ``acc``."""
    BB, G, R, KB = job.BB, job.plan.G, job.R, job.KB
    ks, vs = job.gather(kb), job.gather(vb)
    # [BB, G*R, KB]
    x = torch.bmm(job.to_rows(qs), ks.transpose(1, 2))
    mx, sm = _softmax_fwd(x.view(BB, G, R, KB), job.weight(acc), acc)
    inv = torch.where(sm > 0, 1.0 / sm, 0.0).view(BB, G * R, 1)
    o = torch.bmm(x, vs).mul_(inv)
    return job.from_rows(o), job.from_rows(mx.view(BB, G * R, 1))[..., 0], job.from_rows(sm.view(BB, G * R, 1))[..., 0]


def _forward_tiles(job, q, kb, vb, scale, acc, out, m, l):
    """Writes ``out``, ``m``, ``l`` of the chunk's tokens from its block tiles."""
    _write_chunk(job, out, m, l, *_tile_chunk(job, q[job.t0:job.t0 + job.C].to(acc) * scale, kb, vb, acc))


def _write_chunk(job, out, m, l, o, mc, lc):
    t0, t1 = job.t0, job.t0 + job.C
    out[t0:t1], m[t0:t1], l[t0:t1] = o.to(out.dtype), mc, lc


def _tile_chunk(job, qs, kb, vb, acc):
    """``(out [C, N1, Dv], m [C, N1], l [C, N1])`` of a block-centric chunk, in ``acc``."""
    G, bs, N1, Dv = job.plan.G, job.plan.bs, job.plan.N1, vb.shape[-1]
    rows = job.NT * job.M
    ks, vs = job.gather(kb), job.gather(vb)
    # [NT, M*G, BS]
    s = torch.bmm(job.to_tiles(qs), ks.transpose(1, 2))
    s4, w = s.view(rows, G, 1, bs), job.weight(acc)
    # [NT*M + 1, G]: each slot row's max over its block (the extra row stands for dead slots)
    smax = job.new_rows(s, 1, float("-inf"))
    _masked_max(s4, w, smax[:-1].view(rows, G, 1, 1))
    # [C*N2, G]: the token's max over its slots; 0 when it has none
    mt = job.per_token(smax, 1).amax(dim=1)
    mt = torch.where(mt == float("-inf"), 0.0, mt)
    ssum = job.new_rows(s, 1, 0.0)
    _probs(s4, w, job.to_tiles(mt.view(job.C, N1, 1)).view(rows, G, 1, 1), None, acc,
           sum_out=ssum[:-1].view(rows, G, 1, 1))
    o = job.new_rows(s, Dv, 0.0)
    torch.bmm(s, vs, out=o[:-1].view(job.NT, job.M * G, Dv))
    lt = job.per_token(ssum, 1).sum(dim=1)
    ot = job.per_token(o, Dv).sum(dim=1).view(-1, G, Dv)
    inv = torch.where(lt > 0, 1.0 / lt, 0.0)
    return job.from_tokens(ot.mul_(inv[..., None])), job.from_tokens(mt)[..., 0], job.from_tokens(lt)[..., 0]


def uses_cpu_kernels(q, k, bs) -> bool:
    """Whether the C++ CPU path (:mod:`.cpu_gather`) runs this call: enabled, built, and the faster one here."""
    return SETTINGS.get().cpu_kernels and cpu_gather.suits(q, k, bs) and cpu_gather.available(q)


#: the forward of each layout, by ``job.layout``: ``(job, q, kb, vb, scale, acc, out, m, l)``, writing the job's rows
_FORWARD = {"union": _forward_union, "tiles": _forward_tiles, "global": _forward_global}


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    """``(out [T1, N1, Dv]`` in q's dtype, ``m [T1, N1]``, ``l [T1, N1])`` (fp32, float64 for float64)."""
    if uses_cpu_kernels(q, k, bs):
        return cpu_gather.forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal)
    if bs < 16:  # token granularity: a per-query gather (torch_gather)
        return torch_gather.forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal)
    acc = acc_dtype(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    out = torch.zeros(T1, N1, Dv, dtype=q.dtype, device=q.device)
    m = torch.zeros(T1, N1, dtype=acc, device=q.device)
    l = torch.zeros(T1, N1, dtype=acc, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return out, m, l
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    elt = torch.finfo(acc).bits // 8
    share = plan.knobs.global_fwd_share
    for _, _, job in plan.jobs(plan.G * (Dqk + 2 * Dv + bs) * elt, bs * (Dqk + Dv) * elt, share):
        _FORWARD[job.layout](job, q, kb, vb, scale, acc, out, m, l)
    return out, m, l


def _accumulate(buf, rows, src, deterministic):
    """``buf[rows[i]] += src[i]`` over whole blocks. CPU ``index_add_`` adds in index order (reproducible);
    on CUDA the deterministic path uses ``index_put_(accumulate=True)``, which sorts the destinations and adds
    each one's contributions in a fixed order."""
    flat = buf.view(buf.shape[0], -1)
    src = src.reshape(src.shape[0], -1)
    if deterministic and buf.device.type != "cpu":
        flat.index_put_((rows,), src, accumulate=True)
    else:
        flat.index_add_(0, rows, src)


def _chunk_inputs(job, q, dout, out, m, l, scale, acc):
    """The chunk's ``(q * scale, dY, O, m, l)`` in ``acc`` (the stats ``[C, N1, 1]``)."""
    t0, t1 = job.t0, job.t0 + job.C
    return (q[t0:t1].to(acc) * scale, dout[t0:t1].to(acc), out[t0:t1].to(acc), m[t0:t1, :, None].to(acc),
            l[t0:t1, :, None].to(acc))


def _backward_union(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic):
    """Writes ``dq`` of the chunk's tokens and adds dK, dV into ``dkb``, ``dvb`` from its union layout."""
    dqc, dkt, dvt = _union_chunk_grad(job, *_chunk_inputs(job, q, dout, out, m, l, scale, acc), kb, vb, acc, dkb,
                                      dvb)
    _write_chunk_grad(job, dq, dqc, scale, dkb, dvb, dkt, dvt, deterministic)


def _backward_tiles(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic):
    """Writes ``dq`` of the chunk's tokens and adds dK, dV into ``dkb``, ``dvb`` from its block tiles."""
    dqc, dkt, dvt = _tile_chunk_grad(job, *_chunk_inputs(job, q, dout, out, m, l, scale, acc), kb, vb, acc)
    _write_chunk_grad(job, dq, dqc, scale, dkb, dvb, dkt, dvt, deterministic)


def _write_chunk_grad(job, dq, dqc, scale, dkb, dvb, dkt, dvt, deterministic):
    dq[job.t0:job.t0 + job.C] = dqc.mul_(scale).to(dq.dtype)
    if dkt is not None:
        _accumulate(dkb, job.rows, dkt, deterministic)
        _accumulate(dvb, job.rows, dvt, deterministic)


def _union_chunk_grad(job, qs, dy, o, mc, lc, kb, vb, acc, dkb, dvb):
    """``(dq / scale [C, N1, Dqk], dK per gathered block, dV per gathered block)`` of a union chunk; for a span,
    ``(dq / scale, None, None)``: dK and dV are added into ``dkb``, ``dvb`` here."""
    BB, G, R, KB = job.BB, job.plan.G, job.R, job.KB
    ks, vs = job.gather(kb), job.gather(vb)
    qs, dy, o, mc = job.to_rows(qs), job.to_rows(dy), job.to_rows(o), job.to_rows(mc)
    inv = job.to_rows(torch.where(lc > 0, 1.0 / lc, 0.0))
    # [BB, G*R, KB]: P recomputed from the given stats, 0 on invisible keys
    p = torch.bmm(qs, ks.transpose(1, 2))
    _probs(p.view(BB, G, R, KB), job.weight(acc), mc.view(BB, G, R, 1), inv.view(BB, G, R, 1), acc)
    bs = job.plan.bs
    # [BB, G*R, KB]: dS = P * (dP - rowsum(dY * O))
    ds = _dsoftmax(torch.bmm(dy, vs.transpose(1, 2)), (dy * o).sum(dim=-1, keepdim=True), p)
    dqs = job.from_rows(torch.bmm(ds, ks))
    if job.span is not None:
        # the keys are a view of the block buffer: dV += Pᵀ dY and dK += dSᵀ Q in place, in chunk order
        job.view(dvb).baddbmm_(p.transpose(1, 2), dy)
        job.view(dkb).baddbmm_(ds.transpose(1, 2), qs)
        return dqs, None, None
    # [BB, KB, Dv], [BB, KB, Dqk] per gathered block
    dvs = torch.bmm(p.transpose(1, 2), dy)
    dks = torch.bmm(ds.transpose(1, 2), qs)
    return dqs, dks.view(-1, bs, dks.shape[-1]), dvs.view(-1, bs, dvs.shape[-1])


def _tile_chunk_grad(job, qs, dy, o, mc, lc, kb, vb, acc):
    """``(dq / scale [C, N1, Dqk], dK per tile, dV per tile)`` of a block-centric chunk."""
    G, bs, Dqk = job.plan.G, job.plan.bs, kb.shape[-1]
    rows = job.NT * job.M
    ks, vs = job.gather(kb), job.gather(vb)
    qt, dyt = job.to_tiles(qs), job.to_tiles(dy)
    # [NT, M*G, BS]: P recomputed from the given stats, 0 on invisible keys
    p = torch.bmm(qt, ks.transpose(1, 2))
    _probs(p.view(rows, G, 1, bs), job.weight(acc), job.to_tiles(mc).view(rows, G, 1, 1),
           job.to_tiles(torch.where(lc > 0, 1.0 / lc, 0.0)).view(rows, G, 1, 1), acc)
    # [NT, BS, Dv]
    dvt = torch.bmm(p.transpose(1, 2), dyt)
    # [NT, M*G, BS]: dS = P * (dP - rowsum(dY * O))
    ds = _dsoftmax(torch.bmm(dyt, vs.transpose(1, 2)), job.to_tiles((dy * o).sum(dim=-1, keepdim=True)), p)
    dqs = job.new_rows(ds, Dqk, 0.0)
    torch.bmm(ds, ks, out=dqs[:-1].view(job.NT, job.M * G, Dqk))
    # [NT, BS, Dqk]
    dkt = torch.bmm(ds.transpose(1, 2), qt)
    return job.from_tokens(job.per_token(dqs, Dqk).sum(dim=1)), dkt, dvt


def _backward_global(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic):
    """Writes ``dq`` of ``job.tok`` and adds dK, dV into ``dkb``, ``dvb`` from global tiles: each tile row's dQ
    is added into its token's row in tile order."""
    p, M = job.plan, job.M
    T1, N1, Dqk = q.shape
    G, N2, bs, Dv = p.G, p.N2, p.bs, vb.shape[-1]
    elt = torch.finfo(acc).bits // 8
    per_tile = (M * G * (2 * Dqk + Dv + 3 * bs) + 2 * bs * (Dqk + Dv + M)) * elt
    qf, dyf = q.reshape(T1 * N2, G * Dqk), dout.reshape(T1 * N2, G * Dv)
    # [T1*N2, G*2]: per row the log-sum-exp m + log(l) (0 where l = 0: such a row has no visible key, its
    # weights are 0) and D = rowsum(dY * O)
    lse = torch.where(l > 0, m.to(acc) + torch.log(l.to(acc)), 0.0)
    stats = torch.stack([lse, row_dot(dout, out, acc)], dim=-1).view(T1 * N2, G * 2)
    dqa = torch.zeros(job.n_acc + 1, G * Dqk, dtype=acc, device=q.device)  # over the rows of job.tok
    for b in job.batches(per_tile, p.knobs.chunk_bytes):
        # Q unscaled: the scale enters the scores' matmul and the small dK per tile, not a pass over Q
        qt, dyt = b.rows(qf, acc), b.rows(dyf, acc)
        st = b.rows(stats, acc).view(b.R, G, 2)
        ks, vs = b.gather(kb), b.gather(vb)
        pr = torch.baddbmm(qt.new_empty(()), qt, ks.transpose(1, 2), beta=0.0, alpha=scale)
        # P = exp(S - lse): the normalisation is in the exponent, not a further pass
        _probs(pr.view(b.R, G, 1, bs), None, st[..., 0, None, None], None, acc)
        _zero_hidden_(pr.view(b.R, G, 1, bs), b.partial_rows(acc))
        ds = _dsoftmax(torch.bmm(dyt, vs.transpose(1, 2)), st[..., 1].reshape(b.n, M * G, 1), pr)
        dqa.index_add_(0, b.row_acc, torch.bmm(ds, ks).view(b.R, G * Dqk))
        _accumulate(dkb, b.tile_blk, torch.bmm(ds.transpose(1, 2), qt).mul_(scale), deterministic)
        _accumulate(dvb, b.tile_blk, torch.bmm(pr.transpose(1, 2), dyt), deterministic)
    job.write(dq, dqa, scale)


#: the backward of each layout, by ``job.layout``: ``(job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb,
#: deterministic)``, writing the job's dq rows and adding into the dK / dV block buffers
_BACKWARD = {"union": _backward_union, "tiles": _backward_tiles, "global": _backward_global}


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    """``(dq, dk, dv)`` in the dtypes of q, k, v, from the forward's ``out`` and stats ``m``, ``l`` ``[T1, N1]``."""
    if uses_cpu_kernels(q, k, bs):
        return cpu_gather.backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic)
    if bs < 16:
        return torch_gather.backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic)
    acc = acc_dtype(q)
    T1, N1, Dqk = q.shape
    Dv = v.shape[2]
    plan = Plan(q, k, topk, bs, cu_q, cu_kv, causal)
    G = plan.G
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if T1 == 0 or plan.NB == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    kb = plan.to_blocks(k, acc)
    vb = plan.to_blocks(v, acc)
    dkb = torch.zeros_like(kb)
    dvb = torch.zeros_like(vb)
    elt = torch.finfo(acc).bits // 8
    share = plan.knobs.global_bwd_share
    for _, _, job in plan.jobs(G * (3 * Dqk + 2 * Dv + 3 * bs) * elt, 2 * bs * (Dqk + Dv) * elt, share):
        _BACKWARD[job.layout](job, q, dout, out, m, l, kb, vb, scale, acc, dq, dkb, dvb, deterministic)
    return dq, plan.from_blocks(dkb, k.dtype), plan.from_blocks(dvb, v.dtype)
