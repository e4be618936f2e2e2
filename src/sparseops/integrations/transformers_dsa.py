"""``attn_implementation="sparseops"`` for transformers' DeepSeek Sparse Attention models (docs/dsa.md).

Importing this module registers, through transformers' public registries:

- ``AttentionInterface["sparseops"]`` = :func:`dsa_attention`: the attention of ``deepseek_v32`` and
  ``glm_moe_dsa`` (and of ``axk2``, ``dots3_note``, ``mistral_large4``) over the indexer's ``indices`` with
  :func:`sparseops.nsa_selected_attention` at token granularity, in ``O(T * topk)`` (eager folds the top-k into a
  dense ``[T, T]`` mask); when the indices list every key (the dense warm-up), transformers' own ``sdpa``
  attention; an argument that changes the attention's math (``hy_v4``'s sinks ``s_aux`` ...) is refused;
- ``AttentionMaskInterface["sparseops"]`` = transformers' boolean ``sdpa_mask``, which the models' indexer reads.

:class:`indexer_training` trains the indexers, which transformers runs under ``no_grad``, with
:func:`sparseops.dsa.indexer_kl_loss` (the sparse stage) or :func:`sparseops.dsa.indexer_dense_kl_loss` (the
dense warm-up).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .._numerics import autocast_cast
from ..dsa import indexer_dense_kl_loss, indexer_kl_loss, indexer_topk
from ..nsa.api import nsa_selected_attention
from ..nsa.checks import max_block_count

#: the ``attn_implementation`` name
NAME = "sparseops"

#: the most keys per query: ``nsa_selected_attention``'s ``selected_block_count`` limit at token granularity
MAX_TOPK = max_block_count(1)

#: each supported indexer's RoPE, a function of its modeling module: DeepSeek-V3.2 rotates half-split pairs,
#: GLM-MoE-DSA interleaved pairs
_INDEXER_ROPE = {"DeepseekV32Indexer": "apply_rotary_pos_emb", "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}

#: keyword arguments of transformers' attention functions that change the math, refused unless None (HY-V4 passes
#: its attention sinks as ``s_aux``); the rest (``position_ids``, ``use_cache``, the Trainer's
#: ``num_items_in_batch`` ...) are the model's bookkeeping, which sdpa ignores too
_CHANGES_THE_MATH = frozenset({"s_aux", "sinks", "sliding_window", "softcap"})

#: the active :class:`indexer_training` contexts (innermost last)
_TRAINING: list[indexer_training] = []


def _visible(indices: torch.Tensor, attention_mask: torch.Tensor | None, S: int, T: int) -> torch.Tensor:
    """``[B, S, topk]`` bool: whether the mask lets each query see its selected key (gathered: never ``[T, T]``
    beyond the mask the model already holds). None: causal, the queries the last ``S`` of the ``T`` keys."""
    if attention_mask is None:
        pos = torch.arange(S, device=indices.device) + (T - S)
        return indices <= pos[None, :, None]
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(f"attention_mask: expected [B, 1, S, T], got {list(attention_mask.shape)}")
    m = attention_mask[:, 0].expand(indices.shape[0], S, T)
    got = m.gather(2, indices)
    return got if got.dtype == torch.bool else got == 0


def dsa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  indices: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention of a transformers DSA layer (``AttentionInterface`` signature) over its indexer's keys.

    Args:
        module: the attention module (its indexer, when :class:`indexer_training` is active).
        query: ``[B, N1, S, Dqk]``; key: ``[B, N2, T, Dqk]``; value: ``[B, N2, T, Dv]`` (``N2`` divides ``N1``).
        attention_mask: the boolean ``[B, 1, S, T]`` mask of :data:`NAME`'s mask function (or an additive one,
            0 = visible), gathered at ``indices``; None: causal.
        scaling: the softmax scale (default ``Dqk^-0.5``). dropout: must be 0.
        indices: ``[B, S, topk]`` the indexer's key positions, ``topk <= 2048`` unless ``topk >= T``: the models'
            indexers keep ``min(index_topk, T)`` keys, so that lists every key (an ``index_topk`` at least the
            sequence length: the dense warm-up), and the attention is transformers' ``sdpa`` (dense) instead.

    Returns:
        ``(out [B, S, N1, Dv], None)``.
    """
    if indices is None:
        raise ValueError("indices: attn_implementation='sparseops' runs DeepSeek Sparse Attention layers "
                         "(deepseek_v32, glm_moe_dsa, axk2, dots3_note, mistral_large4), which pass the indexer's "
                         "top-k indices; got None")
    if dropout:
        raise ValueError(f"dropout: expected 0 (attention dropout is not supported), got {dropout}")
    for name, arg in kwargs.items():
        if (name in _CHANGES_THE_MATH and arg is not None) or (name == "is_causal" and arg is False):
            raise ValueError(f"{name}: attn_implementation='sparseops' computes causal softmax attention over the "
                             f"indexer's keys, without {name} (attention sinks, a sliding window, a softcap ...), "
                             f"got {type(arg).__name__}{'' if isinstance(arg, torch.Tensor) else f' {arg!r}'}")
    # under torch.autocast the three as sdpa gets them (its dtype: the model's RoPE can leave query in fp32)
    query, key, value = autocast_cast(query, query, key, value)
    B, N1, S, D = query.shape
    N2, T, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if indices.dim() != 3 or indices.shape[:2] != (B, S):
        raise ValueError(f"indices: expected [B={B}, S={S}, topk], got {list(indices.shape)}")
    idx = indices.long()
    K = idx.shape[-1]
    scale = D ** -0.5 if scaling is None else float(scaling)
    if K >= T:  # every key (the indexers' topk of min(index_topk, T) positions): dense, as the model's own sdpa
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)[0]
        if _TRAINING:
            _TRAINING[-1]._record(module, _packed(query), _packed(key), scale, B, S, T, attention_mask)
        return out, None
    if K > MAX_TOPK:
        raise ValueError(f"indices: expected at most {MAX_TOPK} keys per query (the op's selected_block_count limit; "
                         f"the indexer's index_topk, unless it reaches the key count {T}: every key, dense, the "
                         f"warm-up, docs/dsa.md), got {K}")
    idx = torch.where(_visible(idx, attention_mask, S, T), idx, -1)
    q, k, v = _packed(query), _packed(key), _packed(value)
    topk = idx.to(torch.int32).reshape(B * S, 1, K).expand(B * S, N2, K).contiguous()
    out = nsa_selected_attention(
        q, k, v, topk, scale, N1, 1, K, actual_seq_qlen=[S * (b + 1) for b in range(B)],
        actual_seq_kvlen=[T * (b + 1) for b in range(B)], sparse_mode=0, validate=False)[0]
    if _TRAINING:
        _TRAINING[-1]._record(module, q, k, scale, B, S, T, attention_mask)
    return out.view(B, S, N1, Dv), None


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, N, S, D]`` (transformers' heads-first layout) -> ``[B*S, N, D]`` (packed tokens)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def indexer_inputs(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                   params: dict[str, torch.Tensor] | None = None) -> tuple:
    """``(q_idx [B*S, Hi, Di], k_idx [B*S, Di], weights [B*S, Hi])`` of a transformers DSA attention module's
    indexer, differentiable in the indexer's parameters: its math (RoPE on the first ``qk_rope_head_dim`` dims,
    ``softmax_scale`` folded into ``q_idx``, ``n_heads^-0.5`` into ``weights``) with the indexer's input
    ``hidden_states`` and the query residual ``q_a_layernorm(q_a_proj(hidden_states))`` detached. ``params``
    (names relative to the indexer) replace the indexer's own parameters of those names."""
    ix = attn.indexer
    name = _INDEXER_ROPE.get(type(ix).__name__)
    if name is None:
        raise ValueError(f"attn: expected an attention module with one of the indexers {tuple(_INDEXER_ROPE)}, "
                         f"got {type(ix).__name__}")
    rope = getattr(sys.modules[type(ix).__module__], name)
    B, S, _ = hidden_states.shape
    h = hidden_states.detach()
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))

    def call(sub: str, x: torch.Tensor) -> torch.Tensor:
        own = {n[len(sub) + 1:]: p for n, p in (params or {}).items() if n.startswith(sub + ".")}
        return torch.func.functional_call(getattr(ix, sub), own, (x,), strict=False) if own else getattr(ix, sub)(x)

    H, D, R = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    q = call("wq_b", q_resid).view(B, S, H, D)
    k = call("k_norm", call("wk", h)).unsqueeze(2)
    cos, sin = position_embeddings
    q_rot, k_rot = rope(q[..., :R], k[..., :R], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., R:]], dim=-1) * ix.softmax_scale
    k = torch.cat([k_rot, k[..., R:]], dim=-1)
    w = call("weights_proj", h.to(ix.weights_proj.weight.dtype)) * H ** -0.5
    return q.reshape(B * S, H, D), k.reshape(B * S, D), w.reshape(B * S, H).to(q.dtype)


def _fsdp_sharded(model: torch.nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    """Per DSA attention module (by id), its indexer's parameters that FSDP2 holds sharded (DTensors between
    forwards), by name; ``{}`` without FSDP2."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return {}
    return {id(m): {n: p for n, p in m.indexer.named_parameters() if isinstance(p, DTensor)}
            for m in model.modules() if isinstance(getattr(m, "indexer", None), torch.nn.Module)}


def _gathered(p: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor parameter whole on every rank (an all-gather), differentiable in it: the backward sums the
    ranks' gradients into each rank's shard (a reduce-scatter) and divides by the ranks, FSDP2's mean over the
    data-parallel ranks, so the gradient lands where FSDP2's would, on the sharded parameter."""
    from torch.distributed.tensor import Partial, Replicate

    mesh = p.device_mesh
    full = p.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(grad_placements=[Partial()] * mesh.ndim)
    ranks = mesh.size()
    full.register_hook(lambda g: g / ranks)
    return full


def _in_backward() -> bool:
    """Whether autograd is running a backward: a checkpointed layer's recomputation (``torch.utils.checkpoint``,
    ``gradient_checkpointing_enable``) runs the layer's forward again there."""
    return torch._C._current_graph_task_id() != -1


def _causal_only(attention_mask: torch.Tensor | None, S: int, T: int) -> bool:
    """Whether the mask hides exactly the future keys (no padding, no packed documents)."""
    if attention_mask is None:
        return True
    m = attention_mask[:, 0]
    visible = m if m.dtype == torch.bool else m == 0
    causal = torch.ones(S, T, dtype=torch.bool, device=m.device).tril(T - S)
    return bool((visible == causal).all())


class indexer_training(contextlib.AbstractContextManager):  # noqa: N801  (used as a function-like context)
    """Collects the indexer loss of every DSA layer of ``model`` during the forwards run inside it.

    ``with indexer_training(model) as losses: out = model(ids, labels=ids)``, then
    ``(out.loss + sum(losses)).backward()``: ``losses`` holds one :func:`sparseops.dsa.indexer_kl_loss` per layer
    with an indexer, over the keys :func:`sparseops.dsa.indexer_topk` selects from :func:`indexer_inputs` (each
    indexer's ``index_topk``), with the main attention's queries and keys (detached) as the target. With
    ``dense=True`` (the dense warm-up) each loss is :func:`sparseops.dsa.indexer_dense_kl_loss` instead, over every
    visible key without listing them, whatever ``index_topk``. The indexer's input is detached: the losses train
    the indexers only. The model must run ``attn_implementation="sparseops"`` on unpadded batches
    (``attention_mask`` None or all ones; a padded or packed mask is a ``ValueError``), without a cache.

    Each layer's loss is computed in its attention call, its saved tensors out of a non-reentrant activation
    checkpoint's count; in a reentrant checkpoint's ``no_grad`` forward it is computed when ``model``'s forward
    returns (or at the context's exit), so that it has gradients. The layers' forwards that a checkpoint reruns in
    the backward add nothing. Under FSDP2 every loss is computed in the attention call, on the indexer's
    parameters gathered whole from their shards (one more all-gather of the indexer per layer, kept until the
    backward): its backward, alone or with the LM loss, needs no parameter FSDP2 has freed, and leaves the mean of
    the ranks' gradients on the sharded parameters, as FSDP2 does (docs/dsa.md, "Training the indexer").
    """

    def __init__(self, model: torch.nn.Module, *, dense: bool = False):
        if not isinstance(dense, bool):
            raise TypeError(f"dense: expected a bool, got {type(dense).__name__} ({dense!r})")
        self.model = model
        self.dense = dense
        self.losses: list[torch.Tensor] = []
        self._inputs: dict[int, tuple] = {}
        self._pending: list[tuple] = []
        self._sharded: dict[int, dict[str, torch.Tensor]] = {}
        self._hooks = []

    def __enter__(self) -> list[torch.Tensor]:
        for mod in self.model.modules():
            if isinstance(getattr(mod, "indexer", None), torch.nn.Module):
                self._hooks.append(mod.register_forward_pre_hook(self._capture, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._flush()))
        self._sharded = _fsdp_sharded(self.model)
        _TRAINING.append(self)
        return self.losses

    def __exit__(self, *exc) -> None:
        _TRAINING.remove(self)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        try:
            if exc[0] is None:
                self._flush()
        finally:
            self._inputs.clear()
            self._pending.clear()
            self._sharded.clear()

    def _capture(self, mod, args, kwargs):
        if _in_backward():
            return
        hs = args[0] if args else kwargs["hidden_states"]
        pe = args[1] if len(args) > 1 else kwargs["position_embeddings"]
        self._inputs[id(mod)] = (hs, pe)

    def _record(self, mod, q, k, scale, B, S, T, attention_mask) -> None:
        if _in_backward() or id(mod) not in self._inputs:
            return  # a checkpoint's recomputation, or a layer that reuses another's selection (glm_moe_dsa "shared")
        if S != T:
            raise ValueError(f"indexer_training: expected no cache (as many keys as queries), got S={S}, T={T}")
        if not _causal_only(attention_mask, S, T):
            raise ValueError("attention_mask: indexer_training expects unpadded batches (attention_mask None or all "
                             "ones: a causal mask), got a mask that hides past keys (padding or packed sequences)")
        hs, pe = self._inputs.pop(id(mod))
        sharded = self._sharded.get(id(mod))
        if sharded:  # FSDP2: the loss here, on the indexer's parameters gathered whole from their shards, so that
            # its backward, wherever it runs, needs none of the parameters FSDP2 frees after the layer and sends
            # the gradients to the sharded parameters; with grad also in a reentrant checkpoint's no_grad forward
            # (in the dtype FSDP2's mixed precision gives the unsharded parameters, which the layer runs on now)
            current = dict(mod.indexer.named_parameters())
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                params = {n: _gathered(p).to(current[n].dtype) for n, p in sharded.items()}
                self.losses.append(self._loss(mod, q.detach(), k.detach(), scale, B, S, hs, pe, params))
            return
        if not torch.is_grad_enabled():  # a reentrant checkpoint's no_grad forward: the loss after the model's
            self._pending.append((mod, q.detach(), k.detach(), scale, B, S, hs, pe))
            return
        # here, inside the layer; its saved tensors kept as they are, out of a non-reentrant checkpoint's count (its
        # recomputation computes no loss)
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            self.losses.append(self._loss(mod, q.detach(), k.detach(), scale, B, S, hs, pe))

    def _loss(self, mod, q, k, scale, B, S, hs, pe, params=None) -> torch.Tensor:
        q_idx, k_idx, w = indexer_inputs(mod, hs, pe, params)
        cu = [S * b for b in range(B + 1)]
        if self.dense:
            return indexer_dense_kl_loss(q, k, q_idx, k_idx, w, scale=scale, head_num=q.shape[1], cu_seqlens=cu)
        idx, scores = indexer_topk(q_idx, k_idx, w, mod.indexer.index_topk, cu_seqlens=cu, causal=True)
        return indexer_kl_loss(q, k, idx, scores, scale=scale, head_num=q.shape[1], cu_seqlens=cu)

    def _flush(self) -> None:
        """The losses of the layers recorded without grad since the last flush, in layer order."""
        if self._inputs:  # layers with an indexer whose attention was not ours: no loss would come from them
            impls = sorted({str(getattr(getattr(mod, "config", None), "_attn_implementation", None))
                            for mod in self.model.modules() if id(mod) in self._inputs})
            n = len(self._inputs)
            self._inputs.clear()
            raise ValueError(f"attn_implementation: indexer_training needs attn_implementation={NAME!r} (its "
                             f"attention records the losses), got {n} layer(s) with an indexer run with {impls}")
        pending, self._pending = self._pending, []
        for args in pending:
            if any(hasattr(p, "to_local") for p in args[0].indexer.parameters()):
                raise ValueError("indexer_training: a layer ran under no_grad (a reentrant activation checkpoint) with "
                                 "its indexer's parameters DTensors outside FSDP2 (whose shards it gathers), so its "
                                 "loss cannot run on them after the forward: use use_reentrant=False (transformers' "
                                 "default)")
            self.losses.append(self._loss(*args))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def register() -> None:
    """Register :data:`NAME` in transformers' attention and attention-mask registries (done at import)."""
    AttentionInterface.register(NAME, dsa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
