"""torch.nn modules: the top-k router, grouped experts and the expert-parallel MoE layer (docs/moe-layer.md)."""

from .balancing import update_expert_bias
from .experts import GroupedExperts
from .moe_layer import MoEAux, MoELayer, SharedExpert
from .router import RouterOutput, TopKRouter

__all__ = ["GroupedExperts", "MoEAux", "MoELayer", "RouterOutput", "SharedExpert", "TopKRouter",
           "update_expert_bias"]
