"""``sparseops.testing``: the block-id builder's selection patterns, the input builders' checks, the error metric."""

from __future__ import annotations

import math

import pytest
import torch

from sparseops.testing import make_moe_case, make_nsa_inputs, make_topk_indices, rel_rms_error


def _sets(idx):
    return [set(r.tolist()) - {-1} for r in idx]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_nsa_pattern_forces_first_own_previous_and_shares_within_a_window(causal):
    S, bs, K, window = 700, 16, 6, 32
    idx = make_topk_indices([S, 90], [S, 120], 2, K, bs, causal=causal, pattern="nsa", window=window, seed=3,
                            chunk=100)
    assert idx.shape == (S + 90, 2, K) and idx.dtype == torch.int32
    for n2 in range(2):
        rows = _sets(idx[:S, n2])
        for t, r in enumerate(rows):
            own = t // bs
            assert {0, own, max(own - 1, 0)} <= r, (t, r)
            assert len(r) == min(K, own + 1 if causal else -(-S // bs))  # distinct, as many as allowed
            if causal:
                assert max(r) <= own
        # tokens of one window with the same own block select the same blocks (the scores are shared)
        for t in range(0, S - 1):
            if t // window == (t + 1) // window and t // bs == (t + 1) // bs:
                assert rows[t] == rows[t + 1], t
        # different windows draw different scores: not every window picks the same blocks
        late = [frozenset(rows[t]) for t in range(S // 2, S, window)]
        assert len(set(late)) > 1
    assert (idx[S:] < -(-120 // bs)).all()  # the second sequence's own block range


def test_uniform_pattern_draws_per_token():
    idx = make_topk_indices([2048], [2048], 1, 8, 16, seed=0)
    rows = _sets(idx[1024:, 0])
    same = sum(rows[i] == rows[i + 1] for i in range(len(rows) - 1))
    assert same < len(rows) // 10


def test_unknown_pattern_or_bad_window_is_an_error():
    with pytest.raises(ValueError, match="pattern: expected 'uniform' or 'nsa', got 'x'"):
        make_topk_indices([4], [4], 1, 1, 16, pattern="x")
    for w in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"window: expected a positive int, got {w!r}"):
            make_topk_indices([4], [4], 1, 1, 16, pattern="nsa", window=w)


def test_builders_refuse_different_sequence_counts():
    # zip() would silently have dropped the third query sequence
    with pytest.raises(ValueError, match=r"seq_lens_kv: expected as many sequences as seq_lens_q \(3\), got 2"):
        make_topk_indices([4, 5, 6], [4, 5], 1, 1, 16)
    with pytest.raises(ValueError, match="seq_lens_kv"):
        make_nsa_inputs([4, 5, 6], [4, 5])


def test_builders_take_per_sequence_lengths_the_ops_cumulative_ones():
    # the builders' seq_lens_* are lengths; the ops' actual_seq_*len are their running sums (CANN's form)
    a = make_nsa_inputs(seq_lens_q=[3, 5], seq_lens_kv=[16, 40], bs=16)
    assert a["actual_seq_qlen"] == [3, 8] and a["actual_seq_kvlen"] == [16, 56]
    idx = make_topk_indices(seq_lens_q=[3, 5], seq_lens_kv=[16, 40], N2=1, K=3, bs=16, causal=False)
    assert idx.shape == (8, 1, 3)
    assert (idx[:3] <= 0).all() and (idx[3:] < 3).all()  # 1 block in sequence 0, 3 in sequence 1


def test_rel_rms_error_non_finite():
    inf, nan = math.inf, math.nan
    e = torch.tensor([1.0, inf, -inf, nan, 2.0])
    assert rel_rms_error(e.clone(), e) == 0.0  # the same non-finite values where expected has them
    assert rel_rms_error(torch.tensor([1.0, inf, inf, nan, 2.0]), e) == inf  # -inf became +inf
    assert rel_rms_error(torch.tensor([1.0, inf, -inf, 0.0, 2.0]), e) == inf  # NaN became finite
    assert rel_rms_error(torch.tensor([nan, inf, -inf, nan, 2.0]), e) == inf  # NaN where expected is finite
    assert rel_rms_error(torch.tensor([1.5, inf, -inf, nan, 2.0]), e) == pytest.approx(
        math.sqrt(0.25 / 2) / math.sqrt(5 / 2))  # over the finite elements


def test_moe_case_holds_a_backend_call_of_each_op():
    from sparseops.moe import reference

    c = make_moe_case(7, 3, 5, (4, 15), dtype=torch.bfloat16, probs_dtype=torch.float32, index_dtype=torch.int64)
    assert torch.equal(c["si"], reference.sorted_indices_from(c["indices"]).to(torch.int64))
    assert c["si"].dtype == torch.int64 and c["x"].shape == (11, 5) and c["ppg"].shape == (11,)
    assert c["x"].dtype == torch.bfloat16 and c["ppg"].dtype == torch.float32 and (c["K"], c["s"], c["e"]) == (3, 4, 15)
    out = reference.unpermute(c["x"], c["si"], c["probs"], c["K"], c["s"], c["e"])
    assert out.shape == (7, 5)
    full = make_moe_case(2, 2, 3)
    assert (full["s"], full["e"]) == (0, 4) and full["x"].shape == (4, 3)
