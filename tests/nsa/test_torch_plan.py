"""The NSA torch planner (``sparseops.nsa.torch_plan``): which layout a chunk's work takes, and the rules
behind the choice. The results of every layout are checked against the reference in test_torch_impl.py."""

import pytest
import torch

from sparseops.nsa import torch_jobs, torch_plan


def _one_job(topk, N1, N2, S, bs=16, D=8):
    """The torch plan's job for one sequence of ``S`` queries and keys (non-causal), all in one chunk."""
    q, k = torch.zeros(S, N1, D), torch.zeros(S, N2, D)
    ((_, _, job),) = list(torch_plan.Plan(q, k, topk, bs, [0, S], [0, S], False).jobs(1, 1))
    return job


def test_union_limit_rises_for_small_g():
    # every token takes 1 of 8 blocks (round robin): the union of a chunk is all 8, 8x the live keys. That is
    # past union_waste (2), so G = 16 runs tiles; for G = 1 (limit 8) the span is cheaper than tiles that
    # gather a block per slot
    S = 128
    topk = (torch.arange(S) % 8).view(S, 1, 1).expand(S, 2, 1).to(torch.int32).contiguous()
    assert isinstance(_one_job(topk, 32, 2, S), torch_jobs.TileJob)
    job = _one_job(topk, 2, 2, S)
    assert isinstance(job, torch_jobs.UnionJob) and job.span == (0, 8)


def test_gathered_union_when_the_span_is_much_wider():
    # every token takes blocks 0 and 6: the gathered union has 2 blocks, the span 7. Within G = 1's limit (8)
    # but 3.5x the gathered blocks, where a gather costs little next to 128 tokens' compute (span_slack)
    S = 128
    topk = torch.tensor([0, 6], dtype=torch.int32).expand(S, 1, 2).contiguous()
    job = _one_job(topk, 1, 1, S)
    assert isinstance(job, torch_jobs.UnionJob) and job.span is None and job.nblk == 2
    topk = torch.tensor([0, 1], dtype=torch.int32).expand(S, 1, 2).contiguous()
    assert _one_job(topk, 1, 1, S).span == (0, 2)  # as narrow as the gathered union: a span


def test_tile_size_rule_and_its_override():
    # 10 slots on one block and 1 on another: a matmul call costs about 1 + 64 / rows, so G = 1 takes large
    # tiles (padding is cheaper than calls) and the knob, when set, wins
    cnt = torch.tensor([10, 1])
    knobs = torch_plan.SETTINGS.get()
    assert torch_plan.tile_size(cnt, 1, knobs) == 16
    with torch_plan.SETTINGS.override(tile=4) as k:
        assert torch_plan.tile_size(cnt, 1, k) == 4
    assert torch_plan.tile_size(cnt, 32, knobs) in knobs.tiles


def test_plan_reads_the_settings_in_force_when_built():
    S = 128
    topk = (torch.arange(S) % 8).view(S, 1, 1).expand(S, 2, 1).to(torch.int32).contiguous()
    with torch_plan.SETTINGS.override(union_waste=0.0):
        assert isinstance(_one_job(topk, 2, 2, S), torch_jobs.TileJob)  # no union at all
    assert _one_job(topk, 2, 2, S).layout == "union"


def test_buffer_starts_example():
    # the docstring's example, BS = 4: [6] starts row 0 (2 keys into row 1), [1] fits after it, [2] does not
    # (3 + 2 > 4) and starts row 2, [3] starts row 3; empty sequences take no room
    assert torch_plan.buffer_starts([6, 1, 2, 3], 4) == [0, 6, 8, 12]
    assert torch_plan.buffer_starts([0, 5, 0, 3], 4) == [0, 0, 5, 5]


@pytest.mark.parametrize("lens", [
    [2] * 64,  # one block holds 8 sequences: 1/8 of the rows that padding each sequence takes
    [1, 3, 0, 2, 1, 17, 2, 0, 3, 40, 1, 1, 15, 16, 33],  # tiny, empty, block-sized and longer, mixed
    [9] * 20,  # 9 + 9 > 16: one per row, the worst case, about twice the keys
    [64],  # one sequence: its blocks, as before
], ids=["tiny", "mixed", "over-half", "one"])
def test_block_buffer_holds_at_most_twice_the_keys(lens):
    # the buffer's rows, N2 * NB * BS, stay within 2 * N2 * T2 + one block however the tokens are split into
    # sequences (padding every sequence's last block took up to BS times T2); each sequence's keys keep their
    # order in rows of their own, one that fits in a block lies within one block row, a longer one starts a
    # row; to_blocks / from_blocks round-trip the keys exactly
    bs, N2, T2 = 16, 2, sum(lens)
    start = torch_plan.buffer_starts(lens, bs)
    ends = [s + n for s, n in zip(start, lens)]
    assert all(e <= s for e, s in zip(ends, start[1:]))  # in order, no overlap
    for s, n in zip(start, lens):
        assert (s % bs == 0) if n > bs else (s // bs == (s + n - 1) // bs or n == 0)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    k = torch.randn(T2, N2, 8, dtype=torch.float64)
    plan = torch_plan.Plan(torch.zeros(T2, 4, 8), k, torch.zeros(T2, N2, 1, dtype=torch.int32), bs, cu, cu, True)
    assert plan.NB * bs <= 2 * T2 + bs
    buf = plan.to_blocks(k, torch.float64)
    assert buf.shape == (N2 * plan.NB, bs, 8)
    assert torch.equal(plan.from_blocks(buf, torch.float64), k)
