"""NSA: the selected-attention op family (``api``, docs/nsa.md).

The module's functional pieces live in ``sparseops.nsa_branches``; their public names are handed on here too
(``sparseops.nsa.compress_kv`` ...), as docs/nsa-module.md promises. ``nsa_branches`` never imports this package.
"""

from ..nsa_branches import compress_kv, compressed_attention, select_blocks, sliding_window_attention

__all__ = ["compress_kv", "compressed_attention", "select_blocks", "sliding_window_attention"]
