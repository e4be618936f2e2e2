"""Cumulative sequence lengths (CANN's ``actual_seq_qlen`` / ``actual_seq_kvlen``) and their helpers.

CANN passes cumulative lengths *without* a leading 0: ``[128, 256]`` means two sequences of 128.
Internally we use the usual ``cu_seqlens`` form with the 0: ``[0, 128, 256]``.
"""

from __future__ import annotations

import torch

from ._checks import check_has_data


def int_list(name: str, cu) -> list[int]:
    """A 1-D integer tensor or a list/tuple of ints -> Python ints (``TypeError`` naming ``name`` otherwise)."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.is_complex():
            raise TypeError(f"{name}: expected a 1-D integer tensor or a list of ints, got a {cu.dim()}-D "
                            f"{str(cu.dtype).replace('torch.', '')} tensor")
        check_has_data(name, cu)
        return [int(x) for x in cu.tolist()]
    if isinstance(cu, (list, tuple)):
        for x in cu:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name}: expected a list of ints, got an element {x!r} of type {type(x).__name__}")
        return [int(x) for x in cu]
    raise TypeError(f"{name}: expected a list of ints, an integer tensor or None, got {type(cu).__name__}")


def normalize_cu_seqlens(name: str, cu, total: int) -> list[int]:
    """CANN cumulative lengths (or None = one sequence) -> ``[0, c1, ..., total]`` as Python ints."""
    if cu is None:
        return [0, int(total)]
    vals = int_list(name, cu)
    if len(vals) == 0:
        raise ValueError(f"{name}: expected at least one cumulative length, got an empty list")
    prev = 0
    for i, v in enumerate(vals):
        if v < prev:
            raise ValueError(f"{name}: cumulative lengths must be non-decreasing and >= 0, got {vals[i - 1] if i else 0} then {v} at index {i}")
        prev = v
    if vals[-1] != total:
        raise ValueError(f"{name}: the last cumulative length must equal the token count {total}, got {vals[-1]}")
    return [0] + vals


def seq_lengths(cu: list[int]) -> list[int]:
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def device_tensor(values: list[int], dtype: torch.dtype, device=None) -> torch.Tensor:
    """A short host list as a tensor on ``device``. On CUDA through pinned memory with an asynchronous copy:
    ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the stream, so the host
    could not queue the next launches while the GPU works."""
    t = torch.tensor(values, dtype=dtype)
    if device is not None and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device is None else t.to(device)


def token_seq_positions(cu: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed token: (sequence id, position inside its sequence), int64, vectorized."""
    lens = device_tensor(seq_lengths(cu), torch.int64, device)
    total = cu[-1]
    seq_id = torch.repeat_interleave(torch.arange(len(lens), device=device), lens, output_size=total)
    starts = device_tensor(cu[:-1], torch.int64, device)
    pos = torch.arange(total, dtype=torch.int64, device=device) - starts[seq_id]
    return seq_id, pos


def token_key_rows(cu_q: list[int], cu_kv: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed query token (int64, contiguous, on ``device``, the CPU by default): its sequence's first key
    row in ``cu_kv``, that sequence's key count, and the token's own in-sequence position."""
    seq, pos = token_seq_positions(cu_q, device=device)
    starts = torch.tensor(cu_kv[:-1], dtype=torch.int64, device=device)
    lens = torch.tensor(seq_lengths(cu_kv), dtype=torch.int64, device=device)
    return starts[seq].contiguous(), lens[seq].contiguous(), pos.contiguous()


def cu_seqlens_list(name: str, cu, total: int) -> list[int]:
    """flash-attention ``cu_seqlens`` (int tensor ``[B+1]`` or list of ints, leading 0; None = one sequence)
    -> a list of Python ints ``[0, c1, ..., total]``."""
    if cu is None:
        return [0, int(total)]
    vals = int_list(name, cu)
    if len(vals) < 2:
        raise ValueError(f"{name}: expected at least 2 entries [0, ..., T], got {vals}")
    if vals[0] != 0:
        raise ValueError(f"{name}: expected a leading 0 (flash-attention cu_seqlens), got {vals[0]} first")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"{name}: expected non-decreasing entries, got {vals[i - 1]} then {vals[i]} at index {i}")
    if vals[-1] != total:
        raise ValueError(f"{name}: expected the last entry to equal the token count {total}, got {vals[-1]}")
    return vals
