"""torch.nn modules: the top-k router, grouped experts, the expert-parallel MoE layer (docs/moe-layer.md) and
NativeSparseAttention (docs/nsa-module.md), DeepSeekSparseAttention (docs/dsa.md)."""

from .balancing import update_expert_bias
from .deepseek_sparse_attention import DeepSeekSparseAttention
from .experts import GroupedExperts
from .moe_layer import MoEAux, MoELayer, SharedExpert
from .native_sparse_attention import NativeSparseAttention
from .router import RouterOutput, TopKRouter

__all__ = ["DeepSeekSparseAttention", "GroupedExperts", "MoEAux", "MoELayer", "NativeSparseAttention", "RouterOutput", "SharedExpert",
           "TopKRouter", "update_expert_bias"]
