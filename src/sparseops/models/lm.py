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

from .. import _checks
from ..nn import DeepSeekSparseAttention, MoELayer, NativeSparseAttention, SharedExpert

ATTENTIONS = ("nsa", "dsa")
#: LMConfig's sizes that must be >= 1 (dense_layers: in [0, num_layers])
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size",
                   "num_experts", "top_k", "expert_ffn_size", "compress_block_size", "compress_stride",
                   "select_block_size", "select_count", "window_size", "dsa_topk", "index_heads", "index_head_dim")


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


def _int_field(name: str, v, lo: int, hi: int | None = None, hi_name: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__} ({v!r})")
    if v < lo or (hi is not None and v > hi):
        want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi_name} = {hi}]"
        raise ValueError(f"{name}: expected {want}, got {v}")
    return v


def check_config(cfg: LMConfig) -> None:
    """Every field of ``cfg`` alone, before any layer is built: a ``ValueError`` / ``TypeError`` whose message starts
    with the field's name and a colon (``num_layers: expected an int >= 1, got 0``; ``sparseops train`` maps that
    name to its flag). Constraints between fields that a layer states (``num_heads`` a multiple of ``num_kv_heads``,
    the NSA block sizes) are left to the layer, whose message names the same field (:class:`Block`)."""
    if not isinstance(cfg, LMConfig):
        raise TypeError(f"cfg: expected an LMConfig, got {type(cfg).__name__}")
    for name in POSITIVE_FIELDS:
        _int_field(name, getattr(cfg, name), 1)
    _int_field("dense_layers", cfg.dense_layers, 0, cfg.num_layers, "num_layers")
    for name in ("aux_loss_coeff", "indexer_loss_coeff"):
        if _checks.check_float(name, getattr(cfg, name)) < 0:
            raise ValueError(f"{name}: expected a float >= 0, got {getattr(cfg, name)}")
    _checks.check_bool("window_only", cfg.window_only)
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {ATTENTIONS}, got {cfg.attention!r}")


def _as_field(fields: dict[str, str], build, *args, **kwargs):
    """``build(*args, **kwargs)``, a layer whose error names one of its own arguments where that argument is an
    LMConfig field of another name (``fields``: argument -> field): the message is given the field's name."""
    try:
        return build(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        name, colon, rest = str(exc).partition(":")
        if colon and name in fields:
            raise type(exc)(f"{fields[name]}:{rest}") from exc
        raise


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` with its weight drawn from N(0, 1/embedding_dim), in ``reset_parameters`` too, so that
    resetting every module after a meta-device build gives the built model's initialisation."""

    def reset_parameters(self) -> None:
        super().reset_parameters()  # nn.Embedding's N(0, 1) draw, kept: a seeded model's values stay the same
        nn.init.normal_(self.weight, std=self.embedding_dim ** -0.5)


class Block(nn.Module):
    """``h + attn(norm(h))``, then ``h + ffn(norm(h))``; returns the new ``h`` and the FFN's aux loss."""

    def __init__(self, cfg: LMConfig, moe: bool, ep_group=None, replicated_tokens=False, dispatcher="alltoall",
                 device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, **kw)
        self.indexer_loss_coeff = cfg.indexer_loss_coeff if cfg.attention == "dsa" else None
        if cfg.attention == "dsa":
            self.attn = _as_field(
                {"topk": "dsa_topk"}, DeepSeekSparseAttention,
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
            self.ffn = _as_field({"ffn_size": "expert_ffn_size"}, MoELayer,
                                 cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts, cfg.top_k,
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
        check_config(cfg)
        _checks.check_param_dtype(dtype)  # before the embedding, whose own error would come from torch
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            Block(cfg, i >= cfg.dense_layers, ep_group, replicated_tokens, dispatcher, device, dtype)
            for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the summed aux loss of the MoE layers.

        Args:
            tokens: ``[T]`` int64 (int32 accepted) ids in ``[0, vocab_size)``, the packed sequences.
            cu_seqlens: ``[B+1]`` int32 cumulative lengths with the leading 0 (None: one sequence).

        Returns:
            ``logits [T, vocab_size]`` in the parameters' dtype, ``aux_loss`` a 0-dim tensor.
        """
        self._check_tokens(tokens)
        h = self.embed(tokens)
        aux = h.new_zeros(())
        for block in self.blocks:
            h, block_aux = block(h, cu_seqlens)
            if block_aux is not None:
                aux = aux + block_aux.to(h.dtype)
        return F.linear(self.norm(h), self.embed.weight), aux

    def _check_tokens(self, tokens) -> None:
        """Rank and dtype, then the ids' range by one min / max (skipped where the library's data checks are:
        under torch.compile and on meta tensors)."""
        if isinstance(tokens, torch.Tensor) and tokens.dim() != 1:
            raise ValueError(f"tokens: expected a 1-D tensor of ids [T] (sequences packed, with cu_seqlens), got "
                             f"{tokens.dim()}-D with shape {_checks.fmt_shape(tokens.shape)}")
        _checks.check_tensor("tokens", tokens, dtypes=_checks.INDEX_DTYPES)
        if tokens.numel() and _checks.data_checks(True, tokens):
            lo, hi = (int(v) for v in torch.aminmax(tokens))
            V = self.cfg.vocab_size
            if lo < 0 or hi >= V:
                bad = lo if lo < 0 else hi
                at = int(torch.nonzero(tokens == bad)[0])
                raise ValueError(f"tokens: expected ids in [0, vocab_size = {V}), got {bad} at [{at}]")


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
