"""Differentiable collectives along dim 0 with uneven sizes, on any c10d backend (gloo, NCCL).

- ``all_gather(x, group, sizes)``: rank r contributes ``sizes[r]`` rows; every rank gets the
  concatenation in rank order. Backward: ``reduce_scatter`` (sum) of the gradient.
- ``reduce_scatter(x, group, sizes)``: ``x`` has ``sum(sizes)`` rows on every rank; rank r gets the
  sum over ranks of rows ``[sum(sizes[:r]), sum(sizes[:r+1]))``. Backward: ``all_gather``.
- ``all_to_all(x, output_split_sizes, input_split_sizes, group)``: ``all_to_all_single`` with uneven
  splits. Backward: the reverse exchange.
- ``split_rows(x, group, sizes)`` / ``gather_rows(x, group, sizes)``: the pair around a piece of work split
  over the ranks inside a replicated computation (every rank holds the same ``x`` and computes the same loss
  from the gathered result). ``split_rows`` keeps this rank's rows, its backward all-gathers the ranks'
  gradients; ``gather_rows`` all-gathers, its backward keeps this rank's rows of the (replicated) gradient.
  No arithmetic: every number stays bitwise what one process computes.

Everything is built on ``all_to_all_single``, which every c10d backend implements with uneven splits
(gloo has no uneven all-gather). Sums run locally in rank order in fp32 (float64 stays float64) and are
rounded once, so a reduce-scatter is bitwise the same on every backend and every run. Under torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` each call first checks that the ranks agree on the sizes and shapes
(:func:`checking`). Pictures and traffic: docs/moe-layer.md.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import check_int, check_tensor

#: a process group, None meaning the default group (a forward reference: importable without c10d support)
Group = Optional["dist.ProcessGroup"]


def check_group(name: str, group) -> None:
    """``group``: None or a ``torch.distributed.ProcessGroup`` (``TypeError`` naming ``name`` otherwise)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")


def group_size_rank(group: Group) -> tuple[int, int]:
    """``(world size, rank)`` of ``group`` (the default group when None)."""
    check_group("group", group)
    return dist.get_world_size(group), dist.get_rank(group)


def _check_sizes(name: str, sizes, ws: int) -> list[int]:
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    if not isinstance(sizes, Sequence) or len(sizes) != ws:
        raise ValueError(f"{name}: expected {ws} row counts (one per rank), got {sizes!r}")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"{name}: expected non-negative ints, got {sizes!r}")
        out.append(int(s))
    return out


def _a2a(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Group) -> torch.Tensor:
    """Forward ``all_to_all_single`` along dim 0 (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=out_sizes,
                           input_split_sizes=in_sizes, group=group)
    if torch.compiler.is_compiling():
        # traced, dynamo writes the exchange into ``out`` with a copy_; under torch 2.11 an autograd.Function
        # whose output is written in place gets wrong gradients (pytorch/pytorch#180642, docs/internals.md):
        # a fresh copy is returned instead
        return out.clone()
    return out


def _all_gather(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    ws, _ = group_size_rank(group)
    n = x.shape[0]
    if all(s == n for s in sizes):
        out = x.new_empty((ws * n, *x.shape[1:]))
        dist.all_gather(list(out.view(ws, *x.shape).unbind(0)), x.contiguous(),
                        group=group)
        return out
    return _a2a(x.expand(ws, *x.shape).reshape(ws * n, *x.shape[1:]), sizes, [n] * ws, group)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return dt if dt in (torch.float64, torch.float32) or not dt.is_floating_point else torch.float32


def _reduce_scatter(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    ws, rank = group_size_rank(group)
    n = sizes[rank]
    pieces = _a2a(x, [n] * ws, sizes, group).view(ws, n, *x.shape[1:])
    acc = pieces[0].to(_acc_dtype(x.dtype), copy=True)
    for p in pieces[1:]:
        if torch.compiler.is_compiling():  # out of place under torch.compile, as in _a2a
            acc = acc + p
        else:
            acc += p
    return acc if acc.dtype == x.dtype else acc.to(x.dtype)  # no .to() that returns acc itself (the same bug)


def _exchange_sizes(x: torch.Tensor, group: Group) -> list[int]:
    """Every rank's row count of ``x``, by one small all-gather; the same exchange carries its dtype and trailing
    shape, and ranks that disagree raise together (a ``ValueError`` naming ``x``): gloo aborted the process on
    rows of another size."""
    return [row[0] for row in _gather_with_signature(x, group, [x.shape[0]])]


def _gather_with_signature(x: torch.Tensor, group: Group, ints: list[int], whole_shape: bool = False) -> list[list[int]]:
    """Every rank's ``ints``, by one all-gather that also carries x's dtype and trailing dims (all dims when
    ``whole_shape``): every rank raises the same ``ValueError`` naming ``x`` where those disagree."""
    ws, rank = group_size_rank(group)
    sig = _signature(x) + ([x.shape[0]] if whole_shape else [])
    mine = torch.tensor([*ints, *sig], dtype=torch.int64, device=x.device)
    out = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(out, mine, group=group)
    rows = [t.tolist() for t in out]
    n = len(ints)
    for q, row in enumerate(rows):
        if row[n:] != sig:
            what = "shape" if whole_shape else "trailing dims"
            raise ValueError(f"x: expected the same dtype and {what} on every rank of the group, got {x.dtype} "
                             f"{list(x.shape[0 if whole_shape else 1:])} on rank {rank} and another on rank {q}")
    return [row[:n] for row in rows]


def checking() -> bool:
    """Whether the collectives check that the ranks agree before they exchange rows: torch's own switch for
    collective checks, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``torch.distributed.get_debug_level()``). Off, sizes
    that disagree across ranks are the caller's contract: all_to_all_single then hangs, aborts or leaves rows
    unwritten, depending on the backend."""
    return dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL


def _agree(x: torch.Tensor, group: Group, name: str, sizes: list[int], peer: Sequence[int] | None = None,
           whole_shape: bool = False) -> None:
    """Under :func:`checking`, one small all-gather of every rank's ``sizes`` (and ``peer``, the split sizes it
    must match), x's dtype and trailing dims (all dims when ``whole_shape``); every rank raises the same
    ``ValueError`` where they disagree: ``sizes`` equal everywhere, or, with ``peer`` (an all-to-all),
    ``sizes[q]`` on rank r equal to ``peer[r]`` on rank q."""
    if not checking():
        return
    ws, rank = group_size_rank(group)
    rows = _gather_with_signature(x, group, [*sizes, *(peer or [])], whole_shape)
    if peer is None:
        for q, row in enumerate(rows):
            if row != sizes:
                raise ValueError(f"{name}: expected the same list on every rank of the group, got {sizes} on "
                                 f"rank {rank} and {row} on rank {q}")
        return
    for r, row in enumerate(rows):
        for q in range(ws):
            if row[q] != rows[q][ws + r]:
                raise ValueError(f"{name}: expected rank {r}'s {name}[{q}] to equal what rank {q} sends it "
                                 f"({rows[q][ws + r]}), got {row[q]}")


def _signature(x: torch.Tensor) -> list[int]:
    """``[crc32 of the dtype's name, ndim, trailing dims...]``, the trailing dims padded (or folded) to 8: equal
    across ranks when the dtype and the trailing shape agree."""
    tail = list(x.shape[1:])
    if len(tail) > 8:  # the rest folded into their product
        tail = tail[:7] + [math.prod(tail[7:])]
    return [zlib.crc32(str(x.dtype).encode()), x.dim(), *tail, *([-1] * (8 - len(tail)))]


def _own_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """This rank's block of rows, a copy."""
    _, rank = group_size_rank(group)
    return x.narrow(0, sum(sizes[:rank]), sizes[rank]).clone()


def _rows_function(name: str, forward, backward) -> type:
    """An autograd function of ``(x, sizes, group)``: ``forward(x, sizes, group)`` and, for the gradient of
    its output, ``backward(grad, sizes, group)``."""

    def fwd(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return forward(x, sizes, group)

    def bwd(ctx, grad):
        return backward(grad.contiguous(), ctx.sizes, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_AllGather = _rows_function("_AllGather", _all_gather, _reduce_scatter)
_ReduceScatter = _rows_function("_ReduceScatter", _reduce_scatter, _all_gather)
_SplitRows = _rows_function("_SplitRows", _own_rows, _all_gather)
_GatherRows = _rows_function("_GatherRows", _all_gather, _own_rows)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes, group):
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        return _a2a(x, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        out_sizes, in_sizes = ctx.sizes
        return _a2a(grad, in_sizes, out_sizes, ctx.group), None, None, None


def _gathered_sizes(x: torch.Tensor, group: Group, sizes) -> list[int]:
    """The row counts of a gather: checked, or exchanged when None; this rank's must be x's."""
    if sizes is None:
        return _exchange_sizes(x, group)
    ws, rank = group_size_rank(group)
    sizes = _check_sizes("sizes", sizes, ws)
    if sizes[rank] != x.shape[0]:
        raise ValueError(f"sizes: expected sizes[{rank}] = x.shape[0] = {x.shape[0]} on rank {rank}, got {sizes[rank]}")
    _agree(x, group, "sizes", sizes)
    return sizes


def _check_x(x) -> torch.Tensor:
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dimension (rows along dim 0), got a 0-dim tensor")
    return x


def all_gather(x: torch.Tensor, group: Group = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's rows (dim 0) in rank order; differentiable.

    Args:
        x: `[n_r, ...]` this rank's rows, any dtype; the dtype and trailing dims must agree over the group.
        group: the process group (None: the default group).
        sizes: ``[n_0, ..., n_{ws-1}]`` every rank's row count (the same list on every rank: the caller's
            contract, checked only under :func:`checking`); None exchanges them with one small all-gather (a host sync), which also
            checks the dtype and trailing dims: ranks that disagree raise ``ValueError`` together.

    Returns:
        `[sum(sizes), ...]` in x's dtype: ``out[sum(sizes[:r]) + i] = x_r[i]``. Backward: the gradient's rows
        summed over ranks and scattered back (:func:`reduce_scatter`), so ``x_r.grad = sum_q grad_q[rows of r]``.
    """
    x = _check_x(x)
    return _AllGather.apply(x, _gathered_sizes(x, group, sizes), group)


def reduce_scatter(x: torch.Tensor, group: Group = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's block of rows; differentiable.

    Args:
        x: `[sum(sizes), ...]` the same shape on every rank, any dtype (16-bit floats are summed in fp32).
        group: the process group (None: the default group).
        sizes: rows per rank (the same list everywhere; x's shape too: both checked under :func:`checking`); None
            splits the rows evenly (``ws`` must divide them).

    Returns:
        `[sizes[r], ...]` in x's dtype: ``out = sum_q x_q[sum(sizes[:r]) : sum(sizes[:r+1])]``, summed in
        rank order in fp32 (float64 for float64) and rounded once. Backward: :func:`all_gather`.
    """
    x = _check_x(x)
    ws, _ = group_size_rank(group)
    if sizes is None:
        if x.shape[0] % ws:
            raise ValueError(f"sizes: None needs x.shape[0] divisible by the group size {ws}, got {x.shape[0]} rows")
        sizes = [x.shape[0] // ws] * ws
    sizes = _check_sizes("sizes", sizes, ws)
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"sizes: expected them to sum to x.shape[0] = {x.shape[0]}, got {sizes} (sum {sum(sizes)})")
    _agree(x, group, "sizes", sizes, whole_shape=True)
    return _ReduceScatter.apply(x, sizes, group)


def all_to_all(x: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
               group: Group = None) -> torch.Tensor:
    """Send ``input_split_sizes[q]`` consecutive rows of ``x`` to rank q, receive ``output_split_sizes[q]``
    from rank q (``torch.distributed.all_to_all_single`` with uneven splits); differentiable.

    Args:
        x: `[sum(input_split_sizes), ...]` any dtype.
        output_split_sizes: rows received from each rank (must match what the peers send: checked under
            :func:`checking`).
        input_split_sizes: rows sent to each rank.
        group: the process group (None: the default group).

    Returns:
        `[sum(output_split_sizes), ...]`, blocks in source-rank order. Backward: the reverse exchange.
    """
    x = _check_x(x)
    ws, _ = group_size_rank(group)
    out_sizes = _check_sizes("output_split_sizes", output_split_sizes, ws)
    in_sizes = _check_sizes("input_split_sizes", input_split_sizes, ws)
    if sum(in_sizes) != x.shape[0]:
        raise ValueError(f"input_split_sizes: expected them to sum to x.shape[0] = {x.shape[0]}, "
                         f"got {in_sizes} (sum {sum(in_sizes)})")
    _agree(x, group, "output_split_sizes", out_sizes, peer=in_sizes)
    return _AllToAll.apply(x, out_sizes, in_sizes, group)


def even_sizes(n: int, world_size: int) -> list[int]:
    """``n`` rows split into ``world_size`` consecutive blocks as evenly as possible (the first ones smaller)."""
    n = check_int("n", n, lo=0)
    world_size = check_int("world_size", world_size, lo=1)
    return [(q + 1) * n // world_size - q * n // world_size for q in range(world_size)]


def _replicated_sizes(x: torch.Tensor, group: Group, sizes) -> list[int]:
    ws, _ = group_size_rank(group)
    sizes = even_sizes(x.shape[0], ws) if sizes is None else _check_sizes("sizes", sizes, ws)
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"sizes: expected them to sum to x.shape[0] = {x.shape[0]}, got {sizes} (sum {sum(sizes)})")
    return sizes


def split_rows(x: torch.Tensor, group: Group = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's block of the rows of a tensor every rank holds alike; differentiable.

    The entry of a piece of work split over the ranks inside a replicated computation; :func:`gather_rows`
    is its exit.

    Args:
        x: `[sum(sizes), ...]`, the same tensor on every rank (the caller's contract: its values are never
            checked, its shape under :func:`checking`).
        group: the process group (None: the default group).
        sizes: rows per rank (the same list everywhere, checked under :func:`checking`); None: :func:`even_sizes`.

    Returns:
        `[sizes[r], ...]` a copy of rows ``[sum(sizes[:r]), sum(sizes[:r+1]))``. Backward: the ranks' gradients
        all-gathered in rank order, so every rank gets the whole (replicated) gradient of ``x``.
    """
    x = _check_x(x)
    sizes = _replicated_sizes(x, group, sizes)
    _agree(x, group, "sizes", sizes, whole_shape=True)
    return _SplitRows.apply(x, sizes, group)


def gather_rows(x: torch.Tensor, group: Group = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's rows in rank order, for a computation every rank then runs alike; differentiable.

    The same forward as :func:`all_gather`; the backward differs: every rank must compute the same loss from
    the result (a replicated region), so its gradient is the same on every rank and rank r keeps its own rows
    of it (no sum, which would count the loss ``ws`` times).

    Args:
        x: `[sizes[r], ...]` this rank's rows. group: the process group (None: the default group).
        sizes: every rank's row count (the same list everywhere, checked under :func:`checking`); None
            exchanges them (a host sync).

    Returns:
        `[sum(sizes), ...]`. Backward: rows ``[sum(sizes[:r]), sum(sizes[:r+1]))`` of the gradient.
    """
    x = _check_x(x)
    return _GatherRows.apply(x, _gathered_sizes(x, group, sizes), group)
