"""A small causal language model built from the library's layers: NSA attention (or DeepSeek Sparse Attention,
``attention="dsa"``) and MoE FFNs (docs/demo.md, docs/dsa.md).

``embedding -> num_layers x [RMSNorm -> NativeSparseAttention -> RMSNorm -> FFN] -> RMSNorm -> tied head``,
each sub-layer residual. The FFN of the first ``dense_layers`` layers is a dense SwiGLU MLP (as DeepSeek does),
the others a :class:`sparseops.nn.MoELayer`. Sequences are packed: one ``[T]`` token vector and flash-attention
``cu_seqlens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import DeepSeekSparseAttention, MoELayer, NativeSparseAttention, SharedExpert

ATTENTIONS = ("nsa", "dsa")


@dataclass(frozen=True)
class LMConfig:
    """The model's sizes. ``window_only`` computes only the sliding-window branch (the other gates are 0).

    ``attention="dsa"`` replaces NSA by :class:`sparseops.nn.DeepSeekSparseAttention` (``dsa_topk`` keys per query,
    an indexer of ``index_heads`` x ``index_head_dim``, MQA over ``num_kv_heads``); each layer's indexer loss,
    times ``indexer_loss_coeff``, is added to the aux loss (it trains only the indexers: their input is detached).
    """

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 16
    dense_layers: int = 1
    ffn_size: int = 128
    num_experts: int = 4
    top_k: int = 2
    expert_ffn_size: int = 64
    aux_loss_coeff: float = 1e-2
    compress_block_size: int = 16
    compress_stride: int = 16
    select_block_size: int = 16
    select_count: int = 4
    window_size: int = 32
    rope_theta: float = 10000.0
    window_only: bool = False
    attention: str = "nsa"
    dsa_topk: int = 16
    index_heads: int = 2
    index_head_dim: int = 16
    indexer_loss_coeff: float = 1.0

    def replace(self, **changes) -> LMConfig:
        return dataclasses.replace(self, **changes)


class Block(nn.Module):
    """``h + attn(norm(h))``, then ``h + ffn(norm(h))``; returns the new ``h`` and the FFN's aux loss."""

    def __init__(self, cfg: LMConfig, moe: bool, ep_group=None, replicated_tokens=False, dispatcher="alltoall",
                 device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, **kw)
        if cfg.attention not in ATTENTIONS:
            raise ValueError(f"cfg.attention: expected one of {ATTENTIONS}, got {cfg.attention!r}")
        self.indexer_loss_coeff = cfg.indexer_loss_coeff if cfg.attention == "dsa" else None
        if cfg.attention == "dsa":
            self.attn = DeepSeekSparseAttention(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, topk=cfg.dsa_topk,
                index_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, rope_theta=cfg.rope_theta, **kw)
        else:
            self.attn = NativeSparseAttention(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                compress_block_size=cfg.compress_block_size, compress_stride=cfg.compress_stride,
                select_block_size=cfg.select_block_size, select_count=cfg.select_count,
                window_size=cfg.window_size, rope_theta=cfg.rope_theta,
                branches=("win",) if cfg.window_only else ("cmp", "slc", "win"), **kw)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, **kw)
        if moe:
            self.ffn = MoELayer(cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts, cfg.top_k,
                                ep_group=ep_group, replicated_tokens=replicated_tokens, dispatcher=dispatcher,
                                aux_loss_coeff=cfg.aux_loss_coeff, **kw)
        else:
            self.ffn = SharedExpert(cfg.hidden_size, cfg.ffn_size, **kw)

    def forward(self, h: torch.Tensor, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor | None]:
        index_loss = None
        if self.indexer_loss_coeff is None:
            h = h + self.attn(self.attn_norm(h), cu_seqlens)
        else:
            a, info = self.attn(self.attn_norm(h), cu_seqlens, return_info=True)
            h = h + a
            index_loss = self.indexer_loss_coeff * info["indexer_loss"].to(h.dtype)
        if isinstance(self.ffn, MoELayer):
            moe = _moe_eager if torch.compiler.is_compiling() else _moe
            y, loss = moe(self.ffn, self.ffn_norm(h))
            return h + y, loss if index_loss is None else loss.to(h.dtype) + index_loss
        return h + self.ffn(self.ffn_norm(h)), index_loss


def _moe(ffn: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, aux = ffn(x)
    return y, aux.loss


@torch._disable_dynamo  # torch.compiler.disable, which imports torch._dynamo at the first call, not at import
def _moe_eager(ffn: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer, eager also inside ``torch.compile``: its forward syncs with the host once (the routing
    statistics) and sizes the dispatch and the per-expert GEMMs by those numbers, which would graph-break there
    and recompile whenever the per-expert counts change (docs/demo.md, "`--compile`")."""
    return _moe(ffn, x)


class CausalLM(nn.Module):
    """The demo language model on packed sequences.

    Args:
        cfg: the sizes (:class:`LMConfig`).
        ep_group: the expert-parallel group of the MoE layers (None: every expert in this process). Under EP
            each rank holds ``num_experts / ep`` experts per MoE layer.
        replicated_tokens: under EP, every rank runs the whole batch (the layers other than the routed experts
            compute it alike on every rank, the MoE layers split its tokens over the group): every number is
            the one-process number and no gradient needs an all-reduce. False: each rank runs its own
            sequences (data parallelism); see :func:`expert_parameter` for which gradients to all-reduce.
        dispatcher: of the MoE layers under EP, ``"alltoall"`` (each token's expert outputs are summed on its
            own rank in k order: the one-process arithmetic) or ``"allgather"`` (the ranks' partial sums are
            added in rank order: equal up to rounding).
        device, dtype: of every parameter.
    """

    def __init__(self, cfg: LMConfig, ep_group=None, replicated_tokens: bool = False, dispatcher: str = "alltoall",
                 device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=cfg.hidden_size ** -0.5)
        self.blocks = nn.ModuleList(
            Block(cfg, i >= cfg.dense_layers, ep_group, replicated_tokens, dispatcher, device, dtype)
            for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the summed aux loss of the MoE layers.

        Args:
            tokens: ``[T]`` int64, the packed sequences.
            cu_seqlens: ``[B+1]`` int32 cumulative lengths with the leading 0 (None: one sequence).

        Returns:
            ``logits [T, vocab_size]`` in the parameters' dtype, ``aux_loss`` a 0-dim tensor.
        """
        h = self.embed(tokens)
        aux = h.new_zeros(())
        for block in self.blocks:
            h, block_aux = block(h, cu_seqlens)
            if block_aux is not None:
                aux = aux + block_aux.to(h.dtype)
        return F.linear(self.norm(h), self.embed.weight), aux


def expert_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` is a routed expert's weight (local to its EP rank, not all-reduced)."""
    return ".ffn.experts." in f".{name}"


def load_full_state(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Load a one-process ``state_dict`` into ``model``, keeping only this rank's experts of each MoE layer."""
    own = {}
    for name, value in state.items():
        if expert_parameter(name):
            layer = model.get_submodule(name.rsplit(".experts.", 1)[0])
            r = layer.local_experts
            value = value[r.start:r.stop]
        own[name] = value
    model.load_state_dict(own)
