"""Recycled CPU buffers for the large outputs and intermediates of the MoE ops and the grouped experts.

PyTorch's CPU allocator returns every large block to the OS when it is freed (glibc ``munmap``), so each step
of a training loop faults its buffers in again: the kernel zeroes every fresh page, and on the MoE layer's
shapes that costs as much as the non-GEMM work itself (docs/perf.md, "MoE layer on the CPU"). This module
keeps the blocks instead and hands one out again once nothing references it any more.

A block is free when its storage's use count is back at the count it had right after it was created (only
the pool's own reference): a view, an autograd saved tensor, a user's reference or a ``.grad`` all keep it
busy, so a block is never handed out while anything can still read it. Contents are garbage, as from
``torch.empty``. The pool holds at most ``pool_bytes`` (``moe.torch_impl.SETTINGS``) in blocks; a request it
cannot hold gets a plain fresh tensor. ``release()`` drops every free block. Without PyTorch's storage use
count (a private API) every request gets a fresh tensor.
"""

from __future__ import annotations

import threading

import torch

#: blocks are sized in whole 2 MiB units (a transparent huge page), so that slightly different requests share
_UNIT = 2 << 20

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _count(block: torch.Tensor) -> int:
    return _use_count(block.untyped_storage()._cdata)


class Pool:
    """A list of byte blocks, each with its idle use count; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: list[tuple[torch.Tensor, int]] = []  # (uint8 block, its use count when idle)

    def held_bytes(self) -> int:
        return sum(b.numel() for b, _ in self._blocks)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b, idle in self._blocks if _count(b) == idle)

    def take(self, nbytes: int, limit: int, new_block) -> torch.Tensor | None:
        """A free block of at least ``nbytes`` (the smallest, and at most 1/8 above ``nbytes`` rounded up to whole
        units), else a new one from ``new_block(size)`` when the pool can hold it (free blocks are dropped,
        oldest first, to make room); None when it cannot. Returns a uint8 tensor on the block, ``nbytes`` long."""
        if _use_count is None or nbytes > limit:
            return None
        size = -(-nbytes // _UNIT) * _UNIT
        with self._lock:
            best = None
            for i, (b, idle) in enumerate(self._blocks):
                n = b.numel()
                if size <= n <= size + size // 8 and (best is None or n < self._blocks[best][0].numel()):
                    if _count(b) == idle:
                        best = i
            if best is not None:
                return self._blocks[best][0][:nbytes]
            held = self.held_bytes()
            i = 0
            while held + size > limit and i < len(self._blocks):
                b, idle = self._blocks[i]
                if _count(b) == idle:
                    held -= b.numel()
                    del self._blocks[i]
                else:
                    i += 1
            if held + size > limit:
                return None
            block = new_block(size)
            self._blocks.append((block, _count(block)))
            return block[:nbytes]

    def release(self) -> None:
        """Forget every block: free ones go back to the allocator now, busy ones when their last user lets go."""
        with self._lock:
            self._blocks = []


#: the process's pool of CPU blocks
POOL = Pool()


def release() -> None:
    """Return the pool's free CPU blocks to the allocator (and so to the OS)."""
    POOL.release()
