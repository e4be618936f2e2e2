"""The indexer's dense warm-up loss (docs/dsa.md, "The dense warm-up loss"): the KL over every visible key, from
chunks of query rows, never ``[T, T]`` and never a list of every key.

A chunk is the query rows ``[t0, t1)`` and the keys ``[k0, k1)`` they can see (from the first row's sequence start
to the last row's last visible key; rows of several sequences share a chunk, masked by sequence), sized so that
its ``[rows, keys]`` work (the main attention's ``N1`` logit rows, the indexer's ``Hi`` dot rows and a few more)
fits :data:`CHUNK_BYTES`. The forward keeps each row's log-sum-exp of the indexer's scores; the backward recomputes
each chunk's target and scores and writes ``dq_idx``, ``dweights`` and the chunk's slice of ``dk_idx``, so neither
pass holds more than a chunk, and nothing is held between them but ``[T]`` statistics. The backward recomputes
rather than the forward computing the gradients ahead: a layer's loss is taken in the model's forward and
differentiated after it, and gradients held in between would be ``[T, Hi, Di]`` per layer.
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from .. import _autograd, _checks
from .._numerics import without_autocast
from .._varlen import token_seq_positions
from .checks import DTYPES, acc_dtype, check_attention_qk, check_indexer_args

#: bytes of one chunk's ``[rows, keys]`` work tensors, on the CPU and on other devices (where a chunk's launches
#: cost more)
CHUNK_BYTES = 16 * 2**20
DEVICE_CHUNK_BYTES = 256 * 2**20

_NEG_INF = float("-inf")


def _check(q, k, q_idx, k_idx, weights, scale, head_num, cu_seqlens, causal):
    scale = check_attention_qk(q, k, scale, head_num)
    _checks.check_tensor("q_idx", q_idx, ndim=3, dtypes=DTYPES)
    _checks.check_shape("q_idx", q_idx, [("T", q.shape[0]), ("Hi", -1), ("Di", -1)])
    cu, causal = check_indexer_args(q_idx, k_idx, weights, cu_seqlens, causal)
    _checks.check_same_device(q=q, k=k, q_idx=q_idx)
    return scale, cu, causal


def plan_chunks(cu: list[int], causal: bool, pair_bytes: int, budget: int) -> list[tuple[int, int, int, int]]:
    """``[(t0, t1, k0, k1), ...]``: consecutive query rows ``[t0, t1)`` covering ``[0, T)`` and the keys
    ``[k0, k1)`` they see, each chunk the most rows whose ``rows * keys * pair_bytes`` fits ``budget`` (at least
    one row). A chunk's keys run from its first row's sequence start to its last row (causal) or to the end of
    its last row's sequence; ``rows * keys`` grows with the rows, so a binary search finds each chunk's end.
    """
    T = cu[-1]
    pairs = max(1, budget // max(1, pair_bytes))
    chunks = []
    t0 = 0
    while t0 < T:
        k0 = cu[bisect_right(cu, t0) - 1]

        def end(t1: int) -> int:  # the keys' end for the rows [t0, t1)
            return t1 if causal else cu[bisect_right(cu, t1 - 1)]

        lo, hi = t0 + 1, T  # the largest t1 in [lo, hi] that fits, or lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - t0) * (end(mid) - k0) <= pairs:
                lo = mid
            else:
                hi = mid - 1
        chunks.append((t0, lo, k0, end(lo)))
        t0 = lo
    return chunks


class _Chunk:
    """One chunk's target ``p [C, W]`` (no gradient) and the indexer's scores ``I [C, W]`` (the dtype's lowest
    finite value at the keys the rows do not see: no weight in a softmax, and ``p * I = 0`` there), with the
    indexer's ``relu`` dots ``[C, Hi, W]`` for the backward, all in the run's buffers."""

    def __init__(self, run: _Run, t0: int, t1: int, k0: int, k1: int):
        q, k, q_idx, k_idx, w = run.q, run.k, run.q_idx, run.k_idx, run.weights
        C, W = t1 - t0, k1 - k0
        N1, D = q.shape[1], q.shape[2]
        N2 = k.shape[1]
        Hi, Di = q_idx.shape[1], q_idx.shape[2]
        self.C, self.W = C, W
        # the main attention's logits [N1, C, W]: head h = n2 * G + g against k's head n2
        qs = torch.mul(q[t0:t1], run.scale).transpose(0, 1).reshape(N2, N1 // N2 * C, D)
        x = torch.bmm(qs, k[k0:k1].permute(1, 2, 0), out=run.buf("x", C * W, N1).view(N2, -1, W)).view(N1, C, W)
        d = torch.mm(q_idx[t0:t1].reshape(C * Hi, Di), k_idx[k0:k1].T, out=run.buf("d", C * W, Hi).view(C * Hi, W))
        self.dots = d.view(C, Hi, W).relu_()
        self.scores = torch.bmm(w[t0:t1, None, :], self.dots, out=run.buf("s", C * W).view(C, 1, W)).view(C, W)
        # the keys every row sees, [a, b) (the last row's sequence start to the first row's last key), need no mask
        a = run.cu[bisect_right(run.cu, t1 - 1) - 1] - k0
        b = (t0 + 1 if run.causal else run.cu[bisect_right(run.cu, t0)]) - k0
        for lo, hi in ((0, a), (b, W)) if a < b else ((0, W),):
            if lo < hi:
                n = C * (hi - lo)
                hide = torch.ne(run.seq[t0:t1, None], run.seq[None, k0 + lo:k0 + hi],
                                out=run.buf("hide", n, dtype=torch.bool).view(C, hi - lo))
                if run.causal:  # only keys at or before each row
                    hide.logical_or_(torch.gt(run.pos[None, k0 + lo:k0 + hi], run.pos[t0:t1, None],
                                              out=run.buf("later", n, dtype=torch.bool).view(C, hi - lo)))
                x[:, :, lo:hi].masked_fill_(hide, _NEG_INF)
                self.scores[:, lo:hi].masked_fill_(hide, torch.finfo(x.dtype).min)
        x.sub_(x.amax(dim=2, keepdim=True)).exp_()
        x.div_(x.sum(dim=2, keepdim=True))
        self.p = torch.mean(x, dim=0, out=run.buf("p", C * W).view(C, W))  # 0 where unseen


class _Run:
    """One call's inputs in the arithmetic dtype, its chunk plan, each token's sequence id and position, and its
    work buffers: every ``[rows, keys]`` tensor of a chunk is written with ``out=`` into a buffer of the call,
    sized by the largest chunk (a fresh tensor per chunk faults its pages in)."""

    def __init__(self, q, k, q_idx, k_idx, weights, scale, cu, causal, budget, acc):
        T, N1 = q.shape[:2]
        Hi = q_idx.shape[1]
        elt = torch.finfo(acc).bits // 8
        dev = q.device
        self.acc, self.dev = acc, dev
        self.q, self.k, self.q_idx, self.k_idx, self.weights = (t.to(acc) for t in (q, k, q_idx, k_idx, weights))
        self.scale, self.cu, self.causal = scale, cu, causal
        # per (row, key): N1 logits, Hi dots, the scores, p and two work values (acc), two masks (bool)
        self.chunks = plan_chunks(cu, causal, (N1 + Hi + 4) * elt + 2, budget)
        self.seq = token_seq_positions(cu, device=dev)[0]
        self.pos = torch.arange(T, device=dev)
        self.pairs = max((t1 - t0) * (k1 - k0) for t0, t1, k0, k1 in self.chunks)
        self.bufs: dict[str, torch.Tensor] = {}

    def buf(self, name: str, n: int, per_pair: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The first ``n * per_pair`` elements of the buffer ``name``: ``per_pair`` values for each (row, key) of
        the largest chunk, allocated on first use."""
        b = self.bufs.get(name)
        if b is None:
            b = self.bufs[name] = torch.empty(per_pair * self.pairs, dtype=dtype or self.acc, device=self.dev)
        return b[:n * per_pair]


@without_autocast  # the products in the arithmetic dtype, which autocast would lower
def _forward(q, k, q_idx, k_idx, weights, scale, cu, causal, budget):
    """``(loss, lse [T])``: the loss and the log-sum-exp of each row's scores."""
    T = q.shape[0]
    acc = acc_dtype(q.dtype, q_idx.dtype)
    run = _Run(q, k, q_idx, k_idx, weights, scale, cu, causal, budget, acc)
    lse = torch.empty(T, dtype=acc, device=q.device)
    total = torch.zeros((), dtype=acc, device=q.device)
    for t0, t1, k0, k1 in run.chunks:
        c = _Chunk(run, t0, t1, k0, k1)
        C, W = c.C, c.W
        mx = c.scores.amax(dim=1, keepdim=True)
        m = torch.sub(c.scores, mx, out=run.buf("w1", C * W).view(C, W)).exp_().sum(dim=1).log_().add_(mx[:, 0])
        lse[t0:t1] = m
        # p (log p - I + lse) per key, 0 where p = 0
        pi = torch.sub(c.scores, m[:, None], out=run.buf("w1", C * W).view(C, W)).mul_(c.p)
        total += torch.special.xlogy(c.p, c.p, out=run.buf("w2", C * W).view(C, W)).sub_(pi).sum()
    return total / T, lse


@without_autocast
def _backward(q, k, q_idx, k_idx, weights, lse, g, scale, cu, causal, budget):
    """``(dq_idx, dk_idx, dweights)`` in the inputs' dtypes, each chunk recomputed."""
    T = q.shape[0]
    Hi, Di = q_idx.shape[1:]
    acc = lse.dtype
    run = _Run(q, k, q_idx, k_idx, weights, scale, cu, causal, budget, acc)
    dq = torch.empty(q_idx.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k_idx.shape, dtype=acc, device=q.device)
    dw = torch.empty(weights.shape, dtype=acc, device=q.device)
    gt = g.to(acc) / T
    for t0, t1, k0, k1 in run.chunks:
        c = _Chunk(run, t0, t1, k0, k1)
        C, W = c.C, c.W
        # d/dI of sum_s p (log p - I + lse(I)) = softmax(I) * mass(p) - p
        ds = torch.sub(c.scores, lse[t0:t1, None], out=run.buf("w1", C * W).view(C, W)).exp_()
        ds.mul_(c.p.sum(dim=1, keepdim=True)).sub_(c.p).mul_(gt)
        torch.bmm(c.dots, ds[:, :, None], out=dw[t0:t1, :, None])
        dr = c.dots.sign_().mul_(run.weights[t0:t1, :, None]).mul_(ds[:, None, :]).view(C * Hi, W)  # [x>0] w ds
        torch.mm(dr, run.k_idx[k0:k1], out=dq[t0:t1].view(C * Hi, Di))
        dk[k0:k1].addmm_(dr.T, run.q_idx[t0:t1].reshape(C * Hi, Di))
    return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype)


class _DenseKL(torch.autograd.Function):
    """``(1 / T) sum_t KL(p_t || softmax(I_t))`` by chunks; the backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, q, k, q_idx, k_idx, weights, scale, cu, causal, budget):
        loss, lse = _forward(q, k, q_idx, k_idx, weights, scale, cu, causal, budget)
        ctx.save_for_backward(q, k, q_idx, k_idx, weights, lse)
        ctx.args = (scale, cu, causal, budget)
        return loss

    @staticmethod
    @_autograd.once_differentiable("indexer_dense_kl_loss")
    def backward(ctx, g):
        q, k, q_idx, k_idx, weights, lse = ctx.saved_tensors
        dq, dk, dw = _backward(q, k, q_idx, k_idx, weights, lse, g, *ctx.args)
        return None, None, dq, dk, dw, None, None, None, None


# eager also inside torch.compile: the chunk plan is host work over cu_seqlens and the chunks a Python loop
@torch._disable_dynamo
def indexer_dense_kl_loss(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                          weights: torch.Tensor, *, scale: float, head_num: int, cu_seqlens=None,
                          causal: bool = True) -> torch.Tensor:
    """The lightning indexer's dense warm-up loss (DeepSeek-V3.2, docs/dsa.md): the KL over every visible key.

    ``(1 / T) sum_t KL(p_t || softmax_s(I[t, s]))`` over the keys ``s`` of ``t``'s sequence (``s <= t`` when
    causal), where ``I`` is :func:`index_scores`'s ``sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])`` and
    ``p_t(s) = (1 / N1) sum_h softmax_s(scale * q[t, h] . k[s, h // G])`` is the main attention's distribution
    averaged over its heads, a constant: the gradient flows to ``q_idx``, ``k_idx`` and ``weights``, never to
    ``q`` or ``k``. It equals :func:`indexer_kl_loss` over :func:`indexer_topk`'s keys with ``topk`` at least the
    longest sequence, without listing them: memory ``O(chunk * T)`` in the forward and the backward (which
    recomputes each chunk), for sequences of any length.

    Args:
        q: ``[T, N1, Dqk]`` the main attention's queries; k: ``[T, N2, Dqk]`` its keys (``N2`` divides ``N1``).
        q_idx: ``[T, Hi, Di]`` the indexer's queries; k_idx: ``[T, Di]`` its keys; weights: ``[T, Hi]`` its head
            weights (one dtype; scales folded in by the caller).
        scale: the attention's softmax scale. head_num: ``N1``.
        cu_seqlens: flash-attention cumulative lengths with the leading 0, or None for one sequence.
        causal: only keys at or before the query.

    Returns:
        a 0-dim tensor, fp32 (float64 when ``q`` or ``q_idx`` is float64).
    """
    scale, cu, causal = _check(q, k, q_idx, k_idx, weights, scale, head_num, cu_seqlens, causal)
    if q.shape[0] == 0:
        acc = acc_dtype(q.dtype, q_idx.dtype)
        return q_idx.new_zeros((), dtype=acc) + (q_idx.sum() + k_idx.sum() + weights.sum()).to(acc) * 0
    budget = CHUNK_BYTES if q.device.type == "cpu" else DEVICE_CHUNK_BYTES
    return _DenseKL.apply(q.detach(), k.detach(), q_idx, k_idx, weights, scale, cu, causal, budget)
