"""torch.nn modules built on the sparseops ops."""

from .native_sparse_attention import NativeSparseAttention

__all__ = ["NativeSparseAttention"]
