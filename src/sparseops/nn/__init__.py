"""torch.nn modules: the top-k router, grouped experts, the expert-parallel MoE layer (docs/moe-layer.md),
NativeSparseAttention (docs/nsa-module.md), DeepSeekSparseAttention (docs/dsa.md), and grouped_linear (one
grouped GEMM over all experts)."""

from .balancing import update_expert_bias
from .deepseek_sparse_attention import DeepSeekSparseAttention
from .experts import GroupedExperts
from .grouped_linear import grouped_linear
from .moe_layer import MoEAux, MoELayer, SharedExpert
from .native_sparse_attention import NativeSparseAttention
from .router import RouterOutput, TopKRouter

__all__ = ["DeepSeekSparseAttention", "GroupedExperts", "MoEAux", "MoELayer", "NativeSparseAttention",
           "RouterOutput", "SharedExpert", "TopKRouter", "grouped_linear", "update_expert_bias"]
