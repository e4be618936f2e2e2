"""Register sparseops in transformers' registries: ``import sparseops.integrations.transformers``.

- ``ExpertsInterface``: ``experts_implementation="sparseops"`` (:mod:`.transformers_experts`), for every MoE
  family whose experts module transformers decorates with ``use_experts_implementation``;
- ``EPImplementationInterface``: ``DistributedConfig(ep_implementation="sparseops")`` (the all-to-all
  dispatcher; ``"sparseops_allgather"``: the CANN range-window all-gather, ``"sparseops_alltoall"``)
  (:mod:`.transformers_ep`);
- ``AttentionInterface`` / ``AttentionMaskInterface``: ``attn_implementation="sparseops"`` for the DSA families
  ``deepseek_v32`` and ``glm_moe_dsa`` (:mod:`.transformers_dsa`, docs/dsa.md).

Registration goes through the registries' public ``register``; no transformers class is changed. Importing
this module imports transformers (needs the ``sparseops[transformers]`` extra). docs/transformers.md.
"""

from __future__ import annotations

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sparseops.integrations.transformers needs transformers >= 5.23: "
                      "pip install 'sparseops[transformers]'") from exc

from .transformers_experts import NAME, sparseops_experts_forward

ExpertsInterface.register(NAME, sparseops_experts_forward)

try:
    from transformers.distributed.expert_parallel import EPImplementationInterface
except ImportError:  # pragma: no cover - a transformers build without torch.distributed
    EPImplementationInterface = None
else:
    from .transformers_ep import EP_IMPLEMENTATIONS

    for _name, _cls in EP_IMPLEMENTATIONS.items():
        EPImplementationInterface.register(_name, _cls)

from . import transformers_dsa  # noqa: E402,F401  registers attn_implementation="sparseops"

__all__ = ["NAME", "sparseops_experts_forward"]
