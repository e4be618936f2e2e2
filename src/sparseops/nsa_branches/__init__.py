"""The NSA module's functional pieces: compression, compressed attention, block selection, sliding window.

What feeds and forms the three branches of ``nn.NativeSparseAttention`` around the selected-attention op
(``sparseops.nsa``); docs/nsa-module.md. ``reference`` holds their float64 oracles, ``checks`` their argument checks.
"""

from .compressed_attention import compressed_attention
from .compression import compress_kv
from .selection import select_blocks
from .window import sliding_window_attention

__all__ = ["compress_kv", "compressed_attention", "select_blocks", "sliding_window_attention"]
