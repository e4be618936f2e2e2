"""The NSA + MoE model of the parallel tests (tests/distributed/test_parallel*.py): float64, both dispatchers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseops.nn import MoELayer, NativeSparseAttention

V, H, E, SEQ, BATCH, STEPS, SAVE_AT, SEED = 24, 16, 4, 32, 4, 3, 2, 0


class Block(nn.Module):
    """``h + attn(norm(h))``, then ``h + moe(norm(h))`` (shared expert, both losses, the balancing bias)."""

    def __init__(self, dispatcher: str, num_experts: int, expert_ffn: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(H, dtype=torch.float64)
        self.attn = NativeSparseAttention(H, 2, 1, 8, compress_block_size=16, compress_stride=16,
                                          select_block_size=16, select_count=3, window_size=16, dtype=torch.float64)
        self.norm2 = nn.RMSNorm(H, dtype=torch.float64)
        self.moe = MoELayer(H, expert_ffn, num_experts, 2, dispatcher=dispatcher, shared_ffn_size=8,
                            aux_loss_coeff=1e-2, z_loss_coeff=1e-3, expert_bias=True, dtype=torch.float64)

    def forward(self, h, cu):
        h = h + self.attn(self.norm1(h), cu)
        y, aux = self.moe(self.norm2(h))
        return h + y, aux.loss


class Net(nn.Module):
    """Embedding, two blocks (one per dispatcher), RMSNorm, tied head."""

    def __init__(self, num_experts: int = E, expert_ffn: int = 8):
        super().__init__()
        self.embed = nn.Embedding(V, H, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block(d, num_experts, expert_ffn) for d in ("allgather", "alltoall"))
        self.norm = nn.RMSNorm(H, dtype=torch.float64)

    def forward(self, tokens, cu):
        h = self.embed(tokens)
        aux = h.new_zeros(())
        for block in self.blocks:
            h, a = block(h, cu)
            aux = aux + a
        return F.linear(self.norm(h), self.embed.weight), aux


def model(**kw) -> Net:
    """The ``Net`` every run starts from (seeded)."""
    torch.manual_seed(SEED)
    return Net(**kw)
