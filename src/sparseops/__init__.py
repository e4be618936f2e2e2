"""sparseops: training operators for sparse LLMs (MoE token routing, NSA selected attention).

Ascend CANN operator names in snake_case, three backends (``reference``, ``torch``, ``triton``) behind
one contract each, autograd, and a CANN-compatible two-phase API in :mod:`sparseops.aclnn`.

``import sparseops`` is light: the public names below load their modules (torch, the ops and their
``torch.library`` registrations) on first use, so that the ``sparseops`` command answers ``--help`` and
``--version`` without importing torch. Code that reaches the custom ops only through ``torch.ops.sparseops``
(e.g. loading an exported program) imports ``sparseops.moe.api`` / ``sparseops.nsa.api`` first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "is_deterministic": "._config",
    "set_deterministic": "._config",
    "moe_token_permute_with_ep": ".moe.api",
    "moe_token_permute_with_ep_grad": ".moe.api",
    "moe_token_unpermute_with_ep": ".moe.api",
    "moe_token_unpermute_with_ep_grad": ".moe.api",
    "nsa_selected_attention": ".nsa.api",
    "nsa_selected_attention_grad": ".nsa.api",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sparseops' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ._config import is_deterministic as is_deterministic
    from ._config import set_deterministic as set_deterministic
    from .moe.api import moe_token_permute_with_ep as moe_token_permute_with_ep
    from .moe.api import moe_token_permute_with_ep_grad as moe_token_permute_with_ep_grad
    from .moe.api import moe_token_unpermute_with_ep as moe_token_unpermute_with_ep
    from .moe.api import moe_token_unpermute_with_ep_grad as moe_token_unpermute_with_ep_grad
    from .nsa.api import nsa_selected_attention as nsa_selected_attention
    from .nsa.api import nsa_selected_attention_grad as nsa_selected_attention_grad
