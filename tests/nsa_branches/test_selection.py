"""select_blocks: Eq. 9 in 0-based form by hand, the float64 per-token reference, the selection invariants
(forced blocks present, ascending, no duplicates, -1 exactly when fewer candidates than n), ties, the batches of
short sequences against the reference and the one-sequence path, bad input."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseops.nsa_branches import (
    chunked_attention,
    compress_kv,
    compressed_attention,
    reference,
    select_blocks,
)
from sparseops.nsa_branches.selection import _plan, block_importance, importance_weights


@pytest.mark.parametrize("lds, weights", [
    ((32, 16, 64), [1, 2, 2, 2, 1]),  # the paper's blocks: compressed 4i-1 .. 4i+3
    ((16, 16, 16), [1]),  # fla's l = l' = d: the identity
    ((32, 16, 32), [1, 2, 1]),
    ((64, 16, 64), [1, 2, 3, 4, 3, 2, 1]),
], ids=["paper", "fla-identity", "l-eq-lsel", "l-64"])
def test_importance_weights(lds, weights):
    assert importance_weights(*lds) == weights


def test_eq9_by_hand_paper_blocks():
    # (l, d, l') = (32, 16, 64); compressed block j covers [16j, 16j + 32), selection block i covers [64i, 64i + 64)
    one_hot_3 = torch.zeros(8, dtype=torch.float64)
    one_hot_3[3] = 1.0  # [48, 80): 16 tokens in selection block 0, 16 in block 1
    assert block_importance(one_hot_3, 32, 16, 64, 3).tolist() == [1.0, 1.0, 0.0]
    one_hot_2 = torch.zeros(8, dtype=torch.float64)
    one_hot_2[2] = 1.0  # [32, 64): all 32 tokens in selection block 0
    assert block_importance(one_hot_2, 32, 16, 64, 3).tolist() == [2.0, 0.0, 0.0]
    P = torch.tensor([1.0, 2, 4, 8, 16, 32, 64, 128, 256], dtype=torch.float64)
    # S[0] = 2 P0 + 2 P1 + 2 P2 + P3; S[1] = P3 + 2 P4 + 2 P5 + 2 P6 + P7; S[2] = P7 + 2 P8
    assert block_importance(P, 32, 16, 64, 3).tolist() == [22.0, 8 + 32 + 64 + 128 + 128, 128 + 512]
    assert torch.equal(block_importance(P, 32, 16, 64, 3), reference.importance(P, 32, 16, 64, 3))


def test_fla_blocks_are_the_identity():
    P = torch.rand(2, 3, 7, dtype=torch.float64)
    assert torch.equal(block_importance(P, 16, 16, 16, 7), P)


def _setup(cu, N1, N2, D, l, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q = (2 * torch.randn(T, N1, D, generator=g, dtype=torch.float64)).to(dtype)
    k = torch.randn(T, N2, D, generator=g, dtype=torch.float64).to(dtype)
    kc, vc, cu_cmp = compress_kv(k, k, cu, l, d)
    kc = 3 * kc
    _, lse = compressed_attention(q, kc, kc, cu, cu_cmp, l, d)
    return q, kc, lse, cu_cmp.tolist()


CASES = [
    # id: what edge it covers; cu_seqlens, N1, N2, l, d, l', n, init, local
    ("paper-blocks", [0, 450], 4, 2, 32, 16, 64, 4, 1, 2),
    ("fla-blocks-G3", [0, 200], 3, 1, 16, 16, 16, 5, 1, 2),
    ("packed-short-len0", [0, 10, 10, 150, 170], 2, 1, 8, 4, 16, 3, 1, 1),
    ("no-forced-blocks", [0, 130], 2, 2, 8, 8, 16, 2, 0, 0),
    ("n-larger-than-blocks", [0, 90], 2, 1, 8, 4, 16, 16, 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference_and_invariants(case):
    _, cu, N1, N2, l, d, lb, n, init, local = case
    q, kc, lse, cu_cmp = _setup(cu, N1, N2, 8, l, d)
    got = select_blocks(q, kc, lse, torch.tensor(cu, dtype=torch.int32), cu_cmp, l, d, lb, n, init, local)
    want = reference.select_blocks(q, kc, lse, cu, cu_cmp, l, d, lb, n, init, local, 8 ** -0.5)
    assert got.dtype == torch.int32 and got.shape == (cu[-1], N2, n)
    assert torch.equal(got, want)
    _check_invariants(got, cu, N2, lb, n, init, local)


def _check_invariants(got, cu, N2, lb, n, init, local):
    for b in range(len(cu) - 1):
        for t in range(cu[b + 1] - cu[b]):
            cur = t // lb
            for h in range(N2):
                ids = got[cu[b] + t, h].tolist()
                valid = [i for i in ids if i != -1]
                assert len(valid) == min(n, cur + 1), (t, ids)  # -1 exactly when fewer candidates than n
                assert ids[:len(valid)] == valid  # -1 only at the end
                assert valid == sorted(set(valid))  # ascending, no duplicates
                assert all(0 <= i <= cur for i in valid)  # candidates only
                forced = {i for i in range(cur + 1) if i < init or i > cur - local}
                assert forced <= set(valid)


# (l, d, l') = (8, 4, 4): empty sequences first, last and between; shorter than l - 1 (no block, every row from the
# table of positions, which spans two selection blocks), l - 1, l and l + 1 (one block, one row that sees it); runs
# of equal and of mixed short lengths
# (batches of one length class, cut by small chunks); 45, 65 and 70 tokens (alone by row chunks under small chunks)
MIXED_LENGTHS = [0, 1, 7, 8, 9, 0, 45, 3, 12, 12, 12, 12, 20, 33, 0, 65, 2, 5, 70, 16, 17, 31, 40, 6, 0]
MIXED_CU = [sum(MIXED_LENGTHS[:i]) for i in range(len(MIXED_LENGTHS) + 1)]
MIXED_SETTINGS = {  # chunked_attention.SETTINGS knobs
    "one-batch-per-class": {},
    # batches of 2 and of 1 sequence; from 20 tokens alone, by chunks of 5-23 rows
    "small-chunks": dict(chunk_bytes=3000),
    "all-alone": dict(select_group_bytes=0),  # every sequence with a block by its own chunks
}


@pytest.mark.parametrize("knobs", MIXED_SETTINGS.values(), ids=MIXED_SETTINGS.keys())
def test_many_short_sequences_against_reference(knobs):
    l, d, lb, n, init, local = 8, 4, 4, 4, 1, 1
    q, kc, lse, cu_cmp = _setup(MIXED_CU, 4, 2, 8, l, d, seed=1)
    with chunked_attention.SETTINGS.override(**knobs):
        got = select_blocks(q, kc, lse, MIXED_CU, cu_cmp, l, d, lb, n, init, local)
    want = reference.select_blocks(q, kc, lse, MIXED_CU, cu_cmp, l, d, lb, n, init, local, 8 ** -0.5)
    assert torch.equal(got, want)
    _check_invariants(got, MIXED_CU, 2, lb, n, init, local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_many_short_sequences_batched_as_alone(dtype):
    # the batches score each row from the same products and sums as a sequence's own chunks
    l, d, lb, n = 8, 4, 4, 4
    q, kc, lse, cu_cmp = _setup(MIXED_CU, 4, 2, 8, l, d, seed=2, dtype=dtype)
    with chunked_attention.SETTINGS.override(select_group_bytes=0):
        alone = select_blocks(q, kc, lse, MIXED_CU, cu_cmp, l, d, lb, n)
    assert torch.equal(select_blocks(q, kc, lse, MIXED_CU, cu_cmp, l, d, lb, n), alone)


@pytest.mark.parametrize("chunk_bytes, group_bytes", [(16 << 20, 2 << 20), (3000, 2 << 20), (3000, 300)])
def test_plan_covers_every_sequence_once_within_a_chunk(chunk_bytes, group_bytes):
    l, row_bytes, D = 8, 32, 8  # N1 = 4 heads of float64, Dqk 8
    lens = MIXED_LENGTHS
    cmp = [0 if L < l else (L - l) // 4 + 1 for L in lens]
    cu_cmp = [sum(cmp[:i]) for i in range(len(cmp) + 1)]
    alone, batches, width = _plan(MIXED_CU, cu_cmp, l, row_bytes, D, chunk_bytes, group_bytes)
    cap = chunk_bytes // row_bytes
    at = {MIXED_CU[b]: b for b, L in enumerate(lens) if L}  # the non-empty sequence starting at a row
    seen = []
    for b in alone:
        rows = lens[b] - (l - 1)
        assert cmp[b] and (rows * max(cmp[b], D) > cap or rows * D * row_bytes > group_bytes)
        seen.append(MIXED_CU[b])
    for sees, first, rows, cfirst, counts in batches:
        assert max(rows) < 2 * min(rows)  # one class: padding less than doubles a row count
        assert len(rows) == 1 or max(rows) * len(rows) * (max(max(counts), D) if sees else 1) <= cap
        for f, r, cf, c in zip(first, rows, cfirst, counts):
            b = at[f - (l - 1) if sees else f]
            assert (r, bool(cmp[b])) == ((lens[b] - (l - 1), True) if sees else (lens[b], False))
            assert not sees or (cf, c) == (cu_cmp[b], cmp[b])
            assert not sees or (r * max(c, D) <= cap and r * D * row_bytes <= group_bytes)  # else alone
            seen.append(MIXED_CU[b])
    assert sorted(seen) == sorted(at)  # each non-empty sequence once
    assert width == l - 1


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def test_work_does_not_grow_with_the_sequences():
    # 30 or 300 sequences of the same short lengths (none, one and several blocks, empty ones): the same torch calls,
    # one batch per class of rows that see a block (1; 5; 9, 10, 13; 24; 33: five products)
    l, d = 8, 4
    counts = []
    for B in (3, 30):
        cu = [sum(([0, 5, 8, 12, 20, 31, 40, 0, 3, 17] * B)[:i]) for i in range(10 * B + 1)]
        q, kc, lse, cu_cmp = _setup(cu, 2, 1, 8, l, d)
        with _CountOps() as c:
            select_blocks(q, kc, lse, cu, cu_cmp, l, d, 16, 4)
        counts.append(c.ops)
    assert counts[0] == counts[1]
    assert counts[1][torch.ops.aten.bmm] == 5


def test_ties_go_to_the_lower_block():
    # no compressed probability anywhere (lse = -inf): every score ties at 0
    T, lb = 200, 16
    q = torch.randn(T, 2, 8, dtype=torch.float64)
    kc = torch.randn(0, 1, 8, dtype=torch.float64)
    lse = torch.full((T, 2), float("-inf"), dtype=torch.float64)
    got = select_blocks(q, kc, lse, None, [0, 0], 256, 16, lb, 4, 1, 1)
    # t = 199: block 12 is its own (forced local), block 0 forced initial, then the lowest: 1, 2
    assert got[199, 0].tolist() == [0, 1, 2, 12]
    assert got[20, 0].tolist() == [0, 1, -1, -1]


def test_not_differentiable_and_detached():
    q, kc, lse, cu_cmp = _setup([0, 100], 2, 1, 8, 16, 8)
    q.requires_grad_()
    got = select_blocks(q, kc, lse, None, cu_cmp, 16, 8, 16, 4)
    assert not got.requires_grad


BAD = [
    ("n-below-forced", dict(select_count=2, init_blocks=1, local_blocks=2), ValueError, "select_count"),
    ("lsel-not-multiple", dict(select_block_size=18), ValueError, "select_block_size"),
    ("lse-shape", dict(lse=torch.zeros(16, 3)), ValueError, "lse"),
    ("lse-dtype", dict(lse=torch.zeros(16, 2, dtype=torch.float16)), TypeError, "lse"),
    ("local-negative", dict(local_blocks=-1), ValueError, "local_blocks"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    _, changes, exc, name = case
    args = dict(q=torch.zeros(16, 2, 8), k_cmp=torch.zeros(3, 1, 8), lse=torch.zeros(16, 2), cu_seqlens=None,
                cu_seqlens_cmp=[0, 3], block_size=8, stride=4, select_block_size=16, select_count=4)
    args.update(changes)
    with pytest.raises(exc, match=f"^{name}:"):
        select_blocks(**args)
