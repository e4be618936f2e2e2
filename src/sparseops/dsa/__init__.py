"""DeepSeek Sparse Attention (docs/dsa.md): the lightning indexer's exact top-k, its KL training loss, and the
dense reference of its scores. The attention itself is :func:`sparseops.nsa_selected_attention` at token
granularity (``selected_block_size = 1``)."""

from .indexer import indexer_topk
from .loss import indexer_kl_loss
from .reference import index_scores

__all__ = ["index_scores", "indexer_kl_loss", "indexer_topk"]
