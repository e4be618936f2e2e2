"""The training data of ``sparseops train``: the global batch of step ``s`` as a function of ``(seed, s)`` only,
cut into ``M`` micro-batches of consecutive sequences, and each data-parallel rank's share of each micro-batch
(:func:`share`; docs/training.md, "Data").

Two sources, one interface (:meth:`batches`, :meth:`batch`, :meth:`state_dict`, :meth:`load_state_dict`):

- :class:`RecallStream`: the associative-recall task (``sparseops.models.recall``), drawn from one generator
  seeded with ``seed``, one global batch per step in step order: the stream of the demo's one-process
  ``train``. Its data position is the generator's state after the steps done.
- :class:`TokenFile`: a flat ``uint16`` / ``uint32`` file of token ids cut into windows of ``seq_len + 1``
  tokens (one token of overlap: the targets are the next tokens). Each epoch visits every window once in the
  order of a permutation seeded with ``(seed, epoch)``; step ``s`` takes the global sequences
  ``[s*B, (s+1)*B)`` of that endless order. Its data position is the number of sequences consumed.

Every sequence carries the same number of targets, so equal shares of sequences are equal shares of the loss.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..models.recall import IGNORE_INDEX, RecallTask

#: the token file dtypes (``--data-dtype``)
TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}

#: token ids read per chunk when scanning a file for its largest id
_SCAN_CHUNK = 1 << 24


class Batch(NamedTuple):
    """One rank's share of a global (micro-)batch, packed: ``tokens [b*L]`` int64, ``targets [b*L]`` int64 (``-100``
    where ignored), ``cu_seqlens [b+1]`` int32, and ``n_targets``, the targets of the whole global batch."""

    tokens: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    n_targets: int


def share(batch_size: int, rank: int, world: int, micro: int = 0, micro_batches: int = 1) -> range:
    """The global sequence indices of rank ``rank``'s share of micro-batch ``micro`` of ``micro_batches`` (``M``):
    the micro-batch is the sequences ``[m*B/M, (m+1)*B/M)``, the share its ``[r*b, (r+1)*b)``, ``b = B/(M*world)``.
    With ``M = 1``: ``[rank*B/world, (rank+1)*B/world)``."""
    if batch_size % (world * micro_batches):
        size = (f"the data-parallel size {world}" if micro_batches == 1 else
                f"micro_batches * the data-parallel size = {micro_batches} * {world}")
        raise ValueError(f"batch_size: expected a multiple of {size}, got {batch_size}")
    b = batch_size // (world * micro_batches)
    start = (micro * world + rank) * b
    return range(start, start + b)


def shares(batch_size: int, rank: int, world: int, micro_batches: int = 1) -> list[range]:
    """Rank ``rank``'s :func:`share` of each of the ``micro_batches`` micro-batches, in order."""
    return [share(batch_size, rank, world, m, micro_batches) for m in range(micro_batches)]


def _pack(tokens: torch.Tensor, targets: torch.Tensor, n_targets: int) -> Batch:
    b, L = tokens.shape
    return Batch(tokens.reshape(-1), targets.reshape(-1), torch.arange(b + 1, dtype=torch.int32) * L, n_targets)


class _Source:
    """What both sources share: :meth:`batch`, the one-micro-batch case of their ``batches``."""

    def batch(self, step: int, rank: int = 0, world: int = 1) -> Batch:
        """Rank ``rank``'s share of the global batch of ``step``."""
        return self.batches(step, rank, world)[0]


class RecallStream(_Source):
    """The recall task's batches of ``batch_size`` sequences, drawn in step order from ``Generator(seed)``."""

    def __init__(self, task: RecallTask, batch_size: int, seed: int):
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0  #: the steps drawn so far

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    @property
    def seq_len(self) -> int:
        return self.task.seq_len

    def batches(self, step: int, rank: int = 0, world: int = 1, micro_batches: int = 1) -> list[Batch]:
        """Rank ``rank``'s share of each micro-batch of the global batch of ``step`` (every rank draws the whole
        batch: the stream stays the same at every layout). ``step`` must be the next one (:attr:`position`)."""
        if step != self.position:
            raise ValueError(f"step: expected the stream's next step {self.position}, got {step}")
        full = self.task.sample(self.batch_size, self.generator)
        self.position += 1
        L = self.task.seq_len
        tokens, targets = full.tokens.view(self.batch_size, L), full.targets.view(self.batch_size, L)
        return [_pack(tokens[mine.start:mine.stop], targets[mine.start:mine.stop],
                      self.batch_size * self.task.num_queries)
                for mine in shares(self.batch_size, rank, world, micro_batches)]

    def state_dict(self) -> dict:
        return {"kind": "recall", "position": self.position, "generator": self.generator.get_state()}

    def check_state(self, state: dict) -> None:
        """Raise ``ValueError`` unless ``state`` (its ``kind`` at least) is a recall stream's."""
        if state["kind"] != "recall":
            raise ValueError(f"data: expected a checkpoint of the recall task, got one of {state['kind']!r}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.generator.set_state(state["generator"])
        self.position = int(state["position"])


class TokenFile(_Source):
    """Windows of ``seq_len + 1`` tokens of a flat token-id file, in a seeded order per epoch.

    Args:
        path: the file, ``N`` ids of ``dtype`` (native byte order), no header.
        dtype: ``"uint16"`` or ``"uint32"``.
        seq_len: ``L``, tokens per sequence (``N >= L + 1``).
        batch_size: sequences per global batch.
        seed: seeds each epoch's permutation (with the epoch).
        vocab_size: the model's vocabulary; None: the file's largest id + 1. Every id must be below it.
    """

    def __init__(self, path: str | os.PathLike, dtype: str, seq_len: int, batch_size: int, seed: int,
                 vocab_size: int | None = None):
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(TOKEN_DTYPES)}, got {dtype!r}")
        path = os.fspath(path)
        if not os.path.isfile(path):
            why = "not a regular file" if os.path.exists(path) else "no such file"
            raise ValueError(f"path: expected a token file, got {path!r} ({why})")
        itemsize = TOKEN_DTYPES[dtype].itemsize
        nbytes = os.path.getsize(path)
        if nbytes % itemsize:
            raise ValueError(f"path: expected a multiple of {itemsize} bytes ({dtype}), got {nbytes} bytes in {path}")
        n = nbytes // itemsize
        if n < 2:  # no window of one input and its target, whatever seq_len
            raise ValueError(f"path: expected a token file of at least 2 tokens, got {n} in {path}")
        if n < seq_len + 1:
            raise ValueError(f"seq_len: expected at most {n - 1} (the file holds {n} tokens), got {seq_len}")
        self.path, self.dtype, self.seq_len, self.batch_size, self.seed = path, dtype, seq_len, batch_size, seed
        self.tokens = torch.from_file(path, shared=False, size=n, dtype=TOKEN_DTYPES[dtype])
        self.num_windows = (n - 1) // seq_len
        top = max(int(self.tokens[i:i + _SCAN_CHUNK].to(torch.int64).max()) for i in range(0, n, _SCAN_CHUNK))
        if vocab_size is None:
            vocab_size = top + 1
        elif top >= vocab_size:
            raise ValueError(f"vocab_size: expected more than the file's largest token id {top}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._perm: tuple[int, torch.Tensor] | None = None
        self.position = 0  #: the steps drawn so far (the data position: ``position * batch_size`` sequences)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            # mod 2**64: what manual_seed takes (it wraps a negative seed the same way), for every --seed
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
            self._perm = (epoch, torch.randperm(self.num_windows, generator=gen))
        return self._perm[1]

    def batches(self, step: int, rank: int = 0, world: int = 1, micro_batches: int = 1) -> list[Batch]:
        """Rank ``rank``'s share of each micro-batch of the global batch of ``step``: inputs are the windows' first
        ``L`` tokens, targets their last ``L`` (every position a target); only the shares are read from the file."""
        out = [self._rows(step, mine) for mine in shares(self.batch_size, rank, world, micro_batches)]
        self.position = step + 1
        return out

    def _rows(self, step: int, mine: range) -> Batch:
        L = self.seq_len
        rows = []
        for j in mine:
            g = step * self.batch_size + j
            w = int(self._order(g // self.num_windows)[g % self.num_windows])
            rows.append(self.tokens[w * L:w * L + L + 1].to(torch.int64))
        window = torch.stack(rows)
        return _pack(window[:, :-1], window[:, 1:], self.batch_size * L)

    def state_dict(self) -> dict:
        return {"kind": "tokens", "position": self.position, "num_windows": self.num_windows,
                "seq_len": self.seq_len}

    def check_state(self, state: dict) -> None:
        """Raise ``ValueError`` unless ``state`` (``kind``, ``num_windows``, ``seq_len``) is this file's."""
        if state["kind"] != "tokens":
            raise ValueError(f"data: expected a checkpoint of a token file, got one of {state['kind']!r}")
        if (int(state["num_windows"]), int(state["seq_len"])) != (self.num_windows, self.seq_len):
            raise ValueError(f"data: the checkpoint's token file has {state['num_windows']} windows of "
                             f"{state['seq_len']} tokens, this one {self.num_windows} of {self.seq_len}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.position = int(state["position"])


__all__ = ["Batch", "IGNORE_INDEX", "RecallStream", "TOKEN_DTYPES", "TokenFile", "share", "shares"]
