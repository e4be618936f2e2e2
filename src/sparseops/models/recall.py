"""A synthetic associative-recall task, generated on the fly from a seed (docs/demo.md).

Each sequence stores ``num_pairs`` key-value pairs in its first part, one pair at the start of every
``pair_spacing`` tokens, and ends with ``num_queries`` query keys drawn (with replacement) from those pairs;
random filler tokens lie everywhere else, so the answers sit further back than a sliding window reaches::

    pair_spacing = 4:
    position  0   1   2   3   4   5   6   7  ...   filler ...   L-4 L-3 L-2 L-1
    token     k7  v2  f3  f1  k1  v9  f0  f2 ...  f3 f0 f5 ...   k1  k7  k7  k1
    target                                                       v9  v2  v2  v9

At each query key the model must predict the value stored with it (the target); all other positions carry the
ignore index ``-100``. The query region holds keys only, so no answer is ever inside a window. Keys of a
sequence are distinct; values are drawn with replacement, so a model that cannot see the pairs does no better
than ``chance = 1 / num_values``. With ``pair_spacing`` equal to the NSA compression block (and stride), each
compressed block holds one whole pair, which the compressed branch can look up in one step (docs/demo.md).

Vocabulary: ``[0, num_keys)`` keys, ``[num_keys, num_keys + num_values)`` values, then ``num_filler`` filler
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

IGNORE_INDEX = -100


class RecallBatch(NamedTuple):
    """A batch of recall sequences, packed: ``tokens [B*L]``, ``targets [B*L]`` and ``cu_seqlens [B+1]``."""

    tokens: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclass(frozen=True)
class RecallTask:
    """The task's sizes; :meth:`sample` draws batches.

    Args:
        seq_len: ``L``, tokens per sequence.
        num_pairs: key-value pairs, pair i at positions ``i*pair_spacing`` (key) and ``i*pair_spacing + 1``.
        num_queries: query keys in the last ``num_queries`` positions.
        pair_spacing: tokens from one pair to the next (``>= 2``; 2 packs the pairs back to back).
        num_keys, num_values, num_filler: sizes of the three token ranges of the vocabulary.
    """

    seq_len: int = 256
    num_pairs: int = 8
    num_queries: int = 32
    num_keys: int = 32
    num_values: int = 16
    num_filler: int = 16
    pair_spacing: int = 16

    def __post_init__(self):
        for name in ("seq_len", "num_pairs", "num_queries", "num_keys", "num_values", "num_filler",
                     "pair_spacing"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"num_pairs: expected <= num_keys = {self.num_keys} (distinct keys), "
                             f"got {self.num_pairs}")
        if self.pair_spacing < 2:
            raise ValueError(f"pair_spacing: expected an int >= 2 (a key and its value), got {self.pair_spacing}")
        if self.min_distance < 1:
            raise ValueError(f"seq_len: expected > (num_pairs - 1) * pair_spacing + 2 + num_queries = "
                             f"{self.seq_len - self.min_distance + 1}, got {self.seq_len}")

    @property
    def vocab_size(self) -> int:
        """Keys, values and filler tokens."""
        return self.num_keys + self.num_values + self.num_filler

    @property
    def chance(self) -> float:
        """The recall of a uniform guess among the values."""
        return 1.0 / self.num_values

    @property
    def min_distance(self) -> int:
        """The smallest distance from a query key to the position of its stored value.

        The first query sits at ``L - num_queries``, the last stored value at ``(num_pairs-1)*pair_spacing + 1``. A stack of
        ``n`` sliding-window layers of width ``w`` sees ``n*(w - 1)`` positions back, so the task needs
        ``min_distance > n*(w - 1)`` to be out of a window model's reach.
        """
        return self.seq_len - self.num_queries - ((self.num_pairs - 1) * self.pair_spacing + 1)

    def query_positions(self) -> torch.Tensor:
        """``[num_queries]`` int64: the in-sequence positions of the query keys (where the targets are)."""
        return torch.arange(self.seq_len - self.num_queries, self.seq_len)

    def sample(self, batch_size: int, generator: torch.Generator) -> RecallBatch:
        """Draw ``batch_size`` sequences from ``generator`` (a CPU generator; the same seed gives the same batch).

        Returns:
            ``RecallBatch`` of int64 ``tokens [B*L]``, ``targets [B*L]`` (``-100`` except at the query keys, where
            it is the value stored with that key) and int32 ``cu_seqlens [B+1] = [0, L, 2L, ...]``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        B, L, P, Q = batch_size, self.seq_len, self.num_pairs, self.num_queries
        first_filler = self.num_keys + self.num_values
        tokens = torch.randint(first_filler, self.vocab_size, (B, L), generator=generator)
        keys = torch.rand(B, self.num_keys, generator=generator).argsort(dim=1)[:, :P]
        values = self.num_keys + torch.randint(0, self.num_values, (B, P), generator=generator)
        asked = torch.randint(0, P, (B, Q), generator=generator)
        rows = torch.arange(B)[:, None]
        pair_pos = self.pair_spacing * torch.arange(P)
        tokens[rows, pair_pos] = keys
        tokens[rows, pair_pos + 1] = values
        qpos = self.query_positions()
        tokens[rows, qpos] = keys.gather(1, asked)
        targets = torch.full((B, L), IGNORE_INDEX, dtype=torch.int64)
        targets[rows, qpos] = values.gather(1, asked)
        cu_seqlens = torch.arange(B + 1, dtype=torch.int32) * L
        return RecallBatch(tokens.reshape(-1), targets.reshape(-1), cu_seqlens)
