"""NSA: the selected-attention op (``api``) and the full module's functional pieces (docs/nsa-module.md)."""

from .compressed_attention import compressed_attention
from .compression import compress_kv
from .selection import select_blocks
from .window import sliding_window_attention

__all__ = ["compress_kv", "compressed_attention", "select_blocks", "sliding_window_attention"]
