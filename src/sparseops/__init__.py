"""sparseops: training operators for sparse LLMs (MoE token routing, NSA selected attention).

Ascend CANN operator names in snake_case, three backends (``reference``, ``torch``, ``triton``) behind
one contract each, autograd, and a CANN-compatible two-phase API in :mod:`sparseops.aclnn`.
"""

from ._config import is_deterministic, set_deterministic
from .moe.api import (
    moe_token_permute_with_ep,
    moe_token_permute_with_ep_grad,
    moe_token_unpermute_with_ep,
    moe_token_unpermute_with_ep_grad,
)
from .nsa.api import nsa_selected_attention, nsa_selected_attention_grad

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "is_deterministic",
    "moe_token_permute_with_ep",
    "moe_token_permute_with_ep_grad",
    "moe_token_unpermute_with_ep",
    "moe_token_unpermute_with_ep_grad",
    "nsa_selected_attention",
    "nsa_selected_attention_grad",
    "set_deterministic",
]
