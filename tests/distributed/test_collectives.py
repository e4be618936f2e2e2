"""sparseops.distributed collectives on spawned gloo processes: uneven sizes, empty ranks, every dtype, gradients."""

from __future__ import annotations

import pytest
import torch

from sparseops.distributed import (
    all_gather,
    all_to_all,
    even_sizes,
    gather_rows,
    reduce_scatter,
    spawn,
    split_rows,
)

pytestmark = pytest.mark.distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32)


def _rows(n: int, rank: int, dt: torch.dtype) -> torch.Tensor:
    return (torch.arange(n * 3).reshape(n, 3) + 100 * rank).to(dt)


def _worker(rank, ws, size_sets):
    return [_one(rank, ws, list(sizes)) for sizes in size_sets] + [_disagree(rank, ws), torch.get_num_threads()]


def compiled_matches_eager(rank, ws):
    """Under torch.compile (backend "eager": dynamo's graph run as it is) against eager, float64, the collectives
    whose eager forward writes its output in place: all_gather of uneven sizes (gather_rows' forward too),
    reduce_scatter (its sum over ranks) and all_to_all. ``{name: [output equal, x.grad equal]}``. Under torch 2.11
    an autograd.Function whose output is written in place gets wrong gradients (pytorch/pytorch#180642,
    docs/internals.md). Called from test_activation_checkpointing's W = 2 launch, whose ranks have dynamo loaded
    already (its import takes seconds per process)."""
    import torch._dynamo

    sizes = [1 + q for q in range(ws)]
    send = [1 + (rank + q) % 2 for q in range(ws)]
    recv = [1 + (q + rank) % 2 for q in range(ws)]
    names = ("all_gather", "reduce_scatter", "all_to_all")

    def fn(a, b, c):
        return all_gather(a, None, sizes), reduce_scatter(b, None, sizes), all_to_all(c, recv, send)

    g = torch.Generator().manual_seed(rank)
    x0 = [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in (sizes[rank], sum(sizes), sum(send))]
    got = []
    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, backend="eager")):
        xs = [x.clone().requires_grad_(True) for x in x0]
        ys = f(*xs)
        sum((y * torch.arange(1.0, y.numel() + 1, dtype=torch.float64).view(y.shape)).sum() for y in ys).backward()
        got.append([(y.detach(), x.grad) for x, y in zip(xs, ys)])
    torch._dynamo.reset()
    return {name: [torch.equal(a, b) for a, b in zip(e, c)] for name, e, c in zip(names, *got)}


def _disagree(rank, ws):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, ranks that disagree on sizes or shapes all raise ``ValueError``
    (off, the same calls hang, abort gloo, or return rows nobody sent); calls that agree give what they give off."""
    import torch.distributed as dist

    from sparseops.distributed import collectives

    out = {"off": collectives.checking()}
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        out["on"] = collectives.checking()
        n = 2 + rank
        sizes = [2 + q for q in range(ws)]
        other = list(sizes)
        other[(rank + 1) % ws] += rank == 0  # rank 0 counts one row more for its right neighbour
        send = [1] * ws
        recv = [1 + (rank == 1 and q == 0) for q in range(ws)]  # rank 1 expects 2 rows from rank 0, gets 1
        cases = {
            "all_gather": lambda: all_gather(torch.ones(n, 3), None, other),
            "gather_rows": lambda: gather_rows(torch.ones(n, 3), None, other),
            "all_to_all": lambda: all_to_all(torch.ones(ws, 3), recv, send),
            "reduce_scatter": lambda: reduce_scatter(torch.ones(ws, 3 + (rank == 2)), None),
            "reduce_scatter-rows": lambda: reduce_scatter(torch.ones(sum(sizes) + ws * (rank == 1), 3), None,
                                                          [s + (rank == 1) for s in sizes]),
            "split_rows": lambda: split_rows(torch.ones(ws + (rank == 0), 3), None,
                                             [1 + (rank == 0 and q == 0) for q in range(ws)]),
        }
        for name, call in cases.items():
            try:
                call()
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
        # calls that agree run as they do off
        out["ok"] = [all_gather(torch.full((n, 2), float(rank)), None, sizes).sum().item(),
                     all_to_all(torch.full((ws, 2), float(rank)), [1] * ws, [1] * ws).sum().item(),
                     reduce_scatter(torch.ones(sum(sizes), 2), None, sizes).sum().item(),
                     split_rows(torch.ones(ws, 2), None).sum().item(),
                     gather_rows(torch.ones(n, 2), None, sizes).sum().item()]
    finally:
        dist.set_debug_level(level)
    return out


def _one(rank, ws, sizes):
    import torch.distributed as dist

    out = {"rank": rank}
    for dt in DTYPES:
        x = _rows(sizes[rank], rank, dt)
        if dt.is_floating_point:
            x.requires_grad_(True)
        g = all_gather(x, None, sizes)
        out[("gather", dt)] = g.detach().clone()
        out[("gather-exchanged", dt)] = all_gather(x.detach(), None).clone()  # sizes exchanged
        if dt.is_floating_point:
            (g * (rank + 1)).sum().backward()
            out[("gather.grad", dt)] = x.grad.clone()
            y = torch.ones(sum(sizes), 3, dtype=dt, requires_grad=True)
            r = reduce_scatter(y * (rank + 1), None, sizes)
            out[("scatter", dt)] = r.detach().clone()
            r.sum().backward()
            out[("scatter.grad", dt)] = y.grad.clone()
    # split_rows / gather_rows inside a replicated computation: every rank holds the same x and weights
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        x = _rows(sum(sizes), 0, dt).requires_grad_(True)
        part = split_rows(x, None, sizes)
        out[("split", dt)] = part.detach().clone()
        (part * (rank + 1)).sum().backward()  # each rank's block weighted by its rank + 1
        out[("split.grad", dt)] = x.grad.clone()
        mine = part.detach().clone().requires_grad_(True)
        whole = gather_rows(mine, None, sizes)
        out[("gather_rows", dt)] = whole.detach().clone()
        (whole * torch.arange(sum(sizes), dtype=dt)[:, None]).sum().backward()  # the same loss on every rank
        out[("gather_rows.grad", dt)] = mine.grad.clone()
    out["split-even"] = split_rows(torch.arange(sum(sizes) + 2.0)[:, None], None).squeeze(1).tolist()
    for bad in ([sum(sizes) + 1] + [0] * (ws - 1), [1] * (ws + 1)):
        try:
            split_rows(torch.ones(sum(sizes), 3), None, bad)
        except ValueError as exc:
            out.setdefault("split-bad", []).append(str(exc))
    # all_to_all: rank r sends (r + q) % 3 rows to rank q
    send = [(rank + q) % 3 for q in range(ws)]
    recv = [(q + rank) % 3 for q in range(ws)]
    x = (torch.arange(sum(send), dtype=torch.float64) + 10 * rank).requires_grad_(True)
    y = all_to_all(x[:, None] * torch.ones(2, dtype=torch.float64), recv, send)
    (y * torch.arange(1, y.shape[0] + 1, dtype=torch.float64)[:, None]).sum().backward()
    out["a2a"], out["a2a.grad"] = y.detach(), x.grad
    # bad input: sizes that do not match this rank's rows (no collective is started)
    try:
        all_gather(torch.ones(sizes[rank] + 1, 3), None, sizes)
    except ValueError as exc:
        out["bad"] = str(exc)
    # ranks whose dtype or trailing dims differ: every rank raises from the exchange of sizes (gloo aborted)
    for name, x in (("bad-dtype", torch.ones(sizes[rank], 3, dtype=torch.float64 if rank else torch.float32)),
                    ("bad-trailing", torch.ones(sizes[rank], 3 + (rank == 1)))):
        try:
            all_gather(x, None)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    dist.barrier()
    return out


SIZE_SETS = ((0, 4, 1), (0, 0, 0))  # uneven with an empty rank; empty everywhere


def test_collectives_uneven():
    res = spawn(_worker, 3, SIZE_SETS, timeout=120.0)
    assert [r[-1] for r in res] == [1, 1, 1]  # spawn's workers run one thread
    for i, sizes in enumerate(SIZE_SETS):
        _check([r[i] for r in res], list(sizes))
    ws, total = 3, 2 + 3 + 4
    for rank, out in enumerate(r[len(SIZE_SETS)] for r in res):
        assert not out["off"] and out["on"], rank
        assert out["all_gather"].startswith("sizes: expected the same list on every rank"), out
        assert out["gather_rows"].startswith("sizes: expected the same list on every rank"), out
        assert out["all_to_all"] == ("output_split_sizes: expected rank 1's output_split_sizes[0] to equal what "
                                     "rank 0 sends it (1), got 2"), out
        for name in ("reduce_scatter", "reduce_scatter-rows", "split_rows"):
            assert out[name].startswith("x: expected the same dtype and shape on every rank"), (name, out)
        assert out["ok"] == [2 * sum(q * (2 + q) for q in range(ws)), 2 * sum(range(ws)), 2 * ws * (2 + rank),
                             2.0, 2 * total], (rank, out["ok"])


def _check(res, sizes):
    ws = len(sizes)
    assert [out["rank"] for out in res] == list(range(ws))  # results in rank order
    full = torch.cat([_rows(n, r, torch.int64) for r, n in enumerate(sizes)])
    tri = ws * (ws + 1) / 2  # sum over ranks of (rank + 1)
    for r, out in enumerate(res):
        for dt in DTYPES:
            assert torch.equal(out[("gather", dt)], full.to(dt)), (r, dt)
            assert torch.equal(out[("gather-exchanged", dt)], full.to(dt)), (r, dt)
            if dt.is_floating_point:
                # backward of a gather: every rank's gradient summed over ranks
                assert torch.equal(out[("gather.grad", dt)], torch.full((sizes[r], 3), tri, dtype=dt)), (r, dt)
                assert torch.equal(out[("scatter", dt)], torch.full((sizes[r], 3), tri, dtype=dt)), (r, dt)
                assert torch.equal(out[("scatter.grad", dt)], torch.full((sum(sizes), 3), r + 1.0, dtype=dt)), (r, dt)
        # rank r receives (q + r) % 3 rows from rank q: rows j of q's block for r
        exp, grad = [], torch.zeros(sum((r + q) % 3 for q in range(ws)), dtype=torch.float64)
        for q in range(ws):
            start = sum((q + p) % 3 for p in range(r))
            exp += [start + j + 10 * q for j in range((q + r) % 3)]
        assert out["a2a"][:, 0].tolist() == exp and out["a2a"][:, 1].tolist() == exp
        # the reverse exchange: row i of what rank q received from r has weight (its position + 1), twice
        for q in range(ws):
            got_q = sum((p + q) % 3 for p in range(r))  # rows q received from ranks < r
            start_r = sum((r + p) % 3 for p in range(q))  # where r's block for q starts
            for j in range((r + q) % 3):
                grad[start_r + j] = 2 * (got_q + j + 1)
        assert torch.equal(out["a2a.grad"], grad), r
        assert "sizes: expected sizes" in out["bad"]
        assert "x: expected the same dtype and trailing dims on every rank of the group" in out["bad-dtype"]
        assert "x: expected the same dtype and trailing dims on every rank of the group" in out["bad-trailing"]
        lo = sum(sizes[:r])
        for dt in (torch.float32, torch.float64, torch.bfloat16):
            x = _rows(sum(sizes), 0, dt)
            assert torch.equal(out[("split", dt)], x[lo:lo + sizes[r]]), (r, dt)
            # the backward all-gathers the blocks' gradients: block q weighted q + 1, on every rank
            w = torch.repeat_interleave(torch.arange(1, ws + 1), torch.tensor(sizes)).to(dt)[:, None].expand(-1, 3)
            assert torch.equal(out[("split.grad", dt)], w), (r, dt)
            assert torch.equal(out[("gather_rows", dt)], x), (r, dt)
            # the backward keeps this rank's rows of the (replicated) gradient: no sum over ranks
            exp = torch.arange(sum(sizes), dtype=dt)[lo:lo + sizes[r], None].expand(-1, 3)
            assert torch.equal(out[("gather_rows.grad", dt)], exp), (r, dt)
        n = sum(sizes) + 2
        e = even_sizes(n, ws)
        assert sum(e) == n and max(e) - min(e) <= 1
        assert out["split-even"] == list(range(sum(e[:r]), sum(e[:r + 1])))
        assert len(out["split-bad"]) == 2 and all("sizes: expected" in m for m in out["split-bad"])


@pytest.mark.parametrize("args, err, match", [((-1, 2), ValueError, "n: expected >= 0"),
                                              ((4, 0), ValueError, "world_size: expected >= 1"),
                                              ((4.0, 2), TypeError, "n: expected an int")])
def test_even_sizes(args, err, match):
    assert even_sizes(7, 3) == [2, 2, 3] and even_sizes(0, 2) == [0, 0] and even_sizes(1, 3) == [0, 0, 1]
    with pytest.raises(err, match=match):
        even_sizes(*args)


@pytest.mark.parametrize("call", [lambda x: all_gather(x, group=1), lambda x: reduce_scatter(x, group=1),
                                  lambda x: all_to_all(x, [3], [3], group=1), lambda x: split_rows(x, 1),
                                  lambda x: gather_rows(x, 1)],
                         ids=["all_gather", "reduce_scatter", "all_to_all", "split_rows", "gather_rows"])
def test_group_that_is_not_a_process_group(call):
    """One process, no process group: the type of ``group`` is checked before any collective."""
    with pytest.raises(TypeError, match="^group: expected None or a torch.distributed.ProcessGroup, got int"):
        call(torch.zeros(3, 2))
    # a sparse x first (it went on to the group's check; in a process group, into the exchange)
    with pytest.raises(TypeError, match=r"^x: expected a dense \(torch.strided\) tensor, got layout torch.sparse_coo"):
        call(torch.zeros(3, 2).to_sparse())
