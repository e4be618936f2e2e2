"""DeepSeek Sparse Attention (docs/dsa.md): the lightning indexer's exact top-k, its KL training loss over the
selected keys and its dense warm-up loss over every visible key, the attention over the selected keys with the
loss's target from the same pass, and the dense reference of the indexer's scores. The attention is :func:`sparseops.nsa_selected_attention` at token granularity
(``selected_block_size = 1``); :func:`sparse_attention` calls it with the indexer's ``[T, topk]`` indices."""

from .attention import sparse_attention
from .dense_loss import indexer_dense_kl_loss
from .indexer import indexer_topk
from .loss import indexer_kl_loss
from .reference import index_scores

__all__ = ["index_scores", "indexer_dense_kl_loss", "indexer_kl_loss", "indexer_topk", "sparse_attention"]
