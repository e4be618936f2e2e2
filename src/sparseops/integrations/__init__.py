"""Adapters to other libraries' own registries (docs/transformers.md).

Nothing here is imported by ``import sparseops``: ``import sparseops.integrations.transformers`` registers the
``"sparseops"`` backends in transformers' registries.
"""
