"""DeepSeek Sparse Attention (DeepSeek-V3.2, arXiv 2512.02556) as a ``torch.nn.Module`` (docs/dsa.md)."""

from __future__ import annotations

import torch
from torch import nn

from .. import _checks
from .._varlen import token_seq_positions
from ..dsa import indexer_dense_kl_loss, indexer_kl_loss, indexer_topk, sparse_attention
from ..dsa.checks import DTYPES, cu_seqlens_list
from ..nsa_branches import sliding_window_attention
from .rope import apply_rope

#: the most query heads per KV head of the chunked dense attention (``sliding_window_attention``)
_DENSE_MAX_G = 32


class DeepSeekSparseAttention(nn.Module):
    """DSA on packed sequences: a lightning indexer picks ``topk`` keys per query, attention runs over them.

    ``q = q_proj(x) [T, N1, Dqk]``, ``k, v = kv_proj(x)`` (``N2`` KV heads, MQA by default); the indexer sees
    ``x_i = x`` (``x.detach()`` when ``detach_indexer_input``): ``q_idx = index_q_proj(x_i) * Di^-0.5
    [T, Hi, Di]``, ``k_idx = LayerNorm(index_k_proj(x_i)) [T, Di]``, ``weights = index_w_proj(x_i) * Hi^-0.5
    [T, Hi]``; with ``rope_theta`` set, RoPE rotates ``q``, ``k``, ``q_idx`` and ``k_idx`` at their in-sequence
    positions. Each query attends (causally) the ``topk`` keys of :func:`sparseops.dsa.indexer_topk`, all KV
    heads sharing the selection, through :func:`sparseops.dsa.sparse_attention` (the selected-attention op at
    token granularity); ``y = o_proj(o)``.

    The indexer's selection is not differentiable, so the output trains everything but the indexer; the indexer
    trains on ``info["indexer_loss"]`` (:func:`sparseops.dsa.indexer_kl_loss`, the attention's head-averaged
    distribution over the selected keys as its target, from the attention's own pass on the CPU). With
    ``detach_indexer_input`` that loss reaches only the indexer's parameters (the paper's sparse stage). A
    ``topk`` at least the longest sequence selects every visible key: dense attention, the paper's warm-up
    selection.

    ``dense_warmup`` (an attribute, to switch stages) runs the paper's dense warm-up at any sequence length: the
    attention is dense and causal over every visible key (chunked, never ``[T, T]``), no key is selected, and
    ``info["indexer_loss"]`` is :func:`sparseops.dsa.indexer_dense_kl_loss` (the KL over every visible key,
    without listing them); ``topk`` is not used.

    Args:
        hidden_size: model width. num_heads, num_kv_heads: ``N1``, ``N2`` with ``G = N1 / N2 <= 128``.
        head_dim, v_head_dim: ``Dqk <= 256`` and ``Dv <= Dqk`` (default ``Dqk``).
        topk: keys per query, ``1 <= topk <= 2048``.
        index_heads, index_head_dim: the indexer's ``Hi`` and ``Di``.
        rope_theta: None (no RoPE) or the RoPE base (``Dqk`` and ``Di`` even).
        detach_indexer_input: the indexer reads ``x.detach()``.
        dense_warmup: the dense warm-up stage (dense attention, the dense indexer loss) instead of top-k keys.
        backend: of the attention op (``"auto"``, ``"torch"``, ``"reference"``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int = 1, head_dim: int = 64,
                 v_head_dim: int | None = None, *, topk: int = 2048, index_heads: int = 4, index_head_dim: int = 64,
                 rope_theta: float | None = None, detach_indexer_input: bool = True, dense_warmup: bool = False,
                 backend: str = "auto", device=None, dtype=None):
        super().__init__()
        H = _checks.check_int("hidden_size", hidden_size, lo=1)
        N1 = _checks.check_int("num_heads", num_heads, lo=1)
        N2 = _checks.check_int("num_kv_heads", num_kv_heads, lo=1)
        if N1 % N2 or N1 // N2 > 128:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {N1} with num_heads / num_kv_heads "
                             f"<= 128, got {N2}")
        Dqk = _checks.check_int("head_dim", head_dim, lo=1, hi=256)
        Dv = Dqk if v_head_dim is None else _checks.check_int("v_head_dim", v_head_dim, lo=1, hi=Dqk)
        self.topk = _checks.check_int("topk", topk, lo=1, hi=2048)
        Hi = _checks.check_int("index_heads", index_heads, lo=1)
        Di = _checks.check_int("index_head_dim", index_head_dim, lo=1)
        if rope_theta is not None:
            rope_theta = _checks.check_float("rope_theta", rope_theta)
            if rope_theta <= 0:
                raise ValueError(f"rope_theta: expected > 0, got {rope_theta}")
            for name, d in (("head_dim", Dqk), ("index_head_dim", Di)):
                if d % 2:
                    raise ValueError(f"{name}: expected an even size with rope_theta set, got {d}")
        self.detach_indexer_input = _checks.check_bool("detach_indexer_input", detach_indexer_input)
        self.dense_warmup = _checks.check_bool("dense_warmup", dense_warmup)
        _checks.resolve_backend(backend, torch.device("cpu") if device is None else torch.device(device))
        _checks.check_param_dtype(dtype, DTYPES)
        self.hidden_size, self.num_heads, self.num_kv_heads = H, N1, N2
        self.head_dim, self.v_head_dim, self.index_heads, self.index_head_dim = Dqk, Dv, Hi, Di
        self.rope_theta, self.backend = rope_theta, backend
        self.scale = Dqk ** -0.5
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(H, N1 * Dqk, bias=False, **kw)
        self.kv_proj = nn.Linear(H, N2 * (Dqk + Dv), bias=False, **kw)
        self.o_proj = nn.Linear(N1 * Dv, H, bias=False, **kw)
        self.index_q_proj = nn.Linear(H, Hi * Di, bias=False, **kw)
        self.index_k_proj = nn.Linear(H, Di, bias=False, **kw)
        self.index_k_norm = nn.LayerNorm(Di, **kw)
        self.index_w_proj = nn.Linear(H, Hi, bias=False, **kw)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, topk={self.topk}, "
                f"index_heads={self.index_heads}, index_head_dim={self.index_head_dim}, rope_theta={self.rope_theta}"
                + (", dense_warmup=True" if self.dense_warmup else ""))

    def indexer_parameters(self):
        """The indexer's parameters (``index_q_proj``, ``index_k_proj``, ``index_k_norm``, ``index_w_proj``): the
        ones its loss trains, and the only ones the paper's dense warm-up trains (docs/dsa.md)."""
        for m in (self.index_q_proj, self.index_k_proj, self.index_k_norm, self.index_w_proj):
            yield from m.parameters()

    def indexer(self, x: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_idx [T, Hi, Di], k_idx [T, Di], weights [T, Hi])`` of ``x`` (detached when configured), scaled."""
        T, Hi, Di = x.shape[0], self.index_heads, self.index_head_dim
        if self.detach_indexer_input:
            x = x.detach()
        q_idx = self.index_q_proj(x).view(T, Hi, Di) * Di ** -0.5
        # in q_idx's dtype: under CUDA autocast the LayerNorm comes out in fp32 beside the bf16 projections
        k_idx = self.index_k_norm(self.index_k_proj(x)).to(q_idx.dtype)
        if pos is not None:
            q_idx = apply_rope(q_idx, pos, self.rope_theta)
            k_idx = apply_rope(k_idx[:, None], pos, self.rope_theta)[:, 0]
        return q_idx, k_idx, self.index_w_proj(x) * Hi ** -0.5

    def forward(self, x: torch.Tensor, cu_seqlens=None, return_info: bool = False):
        """``x [T, hidden_size]`` (packed sequences, the parameters' dtype) -> ``y [T, hidden_size]``.

        Args:
            cu_seqlens: flash-attention cumulative lengths with the leading 0, or None for one sequence.
            return_info: also return a dict with ``indices [T, topk]`` int32 (in-sequence, -1 unused),
                ``scores [T, topk]`` (the indexer's, differentiable) and ``indexer_loss`` (0-dim); with
                ``dense_warmup``, ``indexer_loss`` alone.

        Returns:
            ``y`` or ``(y, info)``.
        """
        x = _checks.check_hidden_states(x, self.hidden_size, self.q_proj.weight.dtype, DTYPES, self.q_proj.weight.device)
        _checks.check_has_data("x", x, module=True)  # the indexer's top-k reads the scores
        return_info = _checks.check_bool("return_info", return_info)
        T = x.shape[0]
        # a tensor under torch.compile: its lengths are read in an eager region, so no graph depends on the packing
        eager_region = isinstance(cu_seqlens, torch.Tensor) and torch.compiler.is_compiling()
        cu = cu_seqlens if eager_region else cu_seqlens_list(cu_seqlens, T)
        N1, N2, Dqk, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        q = self.q_proj(x).view(T, N1, Dqk)
        k, v = self.kv_proj(x).split([N2 * Dqk, N2 * Dv], dim=-1)
        k, v = k.reshape(T, N2, Dqk), v.reshape(T, N2, Dv)
        attend = _attend_eager if eager_region else DeepSeekSparseAttention._attend
        o, indices, scores, loss = attend(self, cu, x, q, k, v, return_info)
        y = self.o_proj(o.flatten(1))  # not T: after the eager region an int would specialise the graph
        if not return_info:
            return y
        if indices is None:  # the dense warm-up: no key is selected
            return y, {"indexer_loss": loss}
        return y, {"indices": indices, "scores": scores, "indexer_loss": loss}

    def _attend(self, cu: list[int], x, q, k, v, with_loss: bool):
        """Everything that reads the packed layout ``cu``: RoPE, the indexer and its top-k, the attention and (when
        ``with_loss``) the indexer's loss: ``(o [T, N1, Dv], indices, scores, loss or None)``."""
        pos = None
        if self.rope_theta is not None:
            pos = token_seq_positions(cu, device=x.device)[1]
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        if _checks.check_bool("dense_warmup", self.dense_warmup):
            return self._dense(x, q, k, v, pos, cu, with_loss)
        indices, scores = indexer_topk(*self.indexer(x, pos), self.topk, cu_seqlens=cu, causal=True)
        # with the loss's target from the attention's own pass when the loss is asked for
        res = sparse_attention(q, k, v, indices, scale=self.scale, cu_seqlens=cu, return_target=with_loss,
                               backend=self.backend, validate=False)
        if not with_loss:
            return res, indices, scores, None
        o, p = res
        loss = indexer_kl_loss(q.detach(), k.detach(), indices, scores, scale=self.scale, head_num=self.num_heads,
                               cu_seqlens=cu, target=p)
        return o, indices, scores, loss

    def _dense(self, x, q, k, v, pos, cu, with_loss: bool):
        """The warm-up stage: causal attention over every visible key, the sliding window as long as the longest
        sequence (chunked); its groups hold at most :data:`_DENSE_MAX_G` query heads, so larger ones attend
        repeated KV heads (the same keys and values). ``(o, None, None, loss or None)``."""
        G = self.num_heads // self.num_kv_heads
        rep = next(f for f in range(1, G + 1) if G % f == 0 and G // f <= _DENSE_MAX_G)
        kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
        longest = max([b - a for a, b in zip(cu[:-1], cu[1:])] + [1])
        o = sliding_window_attention(q, kr, vr, cu, window=longest, scale=self.scale)
        if not with_loss:
            return o, None, None, None
        loss = indexer_dense_kl_loss(q.detach(), k.detach(), *self.indexer(x, pos), scale=self.scale,
                                     head_num=self.num_heads, cu_seqlens=cu)
        return o, None, None, loss


@torch._disable_dynamo  # torch.compiler.disable, which imports torch._dynamo at the first call, not at import
def _attend_eager(layer: DeepSeekSparseAttention, cu_seqlens: torch.Tensor, x, *rest):
    """``layer._attend`` eager also inside ``torch.compile``, on the lengths of the tensor ``cu_seqlens`` read here:
    traced, each packing would be a new graph (docs/dsa.md, "`torch.compile`")."""
    return layer._attend(cu_seqlens_list(cu_seqlens, x.shape[0]), x, *rest)
