"""The associative-recall generator: answers where they should be, out of a window's reach, seeded."""

from __future__ import annotations

import pytest
import torch

from sparseops.models.recall import IGNORE_INDEX, RecallTask


def _sample(task: RecallTask, B: int = 8, seed: int = 0):
    return task.sample(B, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("task", [RecallTask(), RecallTask(seq_len=40, num_pairs=3, num_queries=9, num_keys=4,
                                                               num_values=2, num_filler=1, pair_spacing=2)],
                         ids=["demo", "back-to-back-one-filler"])
def test_targets_are_the_stored_values(task):
    b = _sample(task)
    B, L, P = b.cu_seqlens.numel() - 1, task.seq_len, task.num_pairs
    assert b.cu_seqlens.tolist() == [L * i for i in range(B + 1)] and b.cu_seqlens.dtype == torch.int32
    tok, tgt = b.tokens.view(B, L), b.targets.view(B, L)
    S = task.pair_spacing
    keys, vals = tok[:, 0:P * S:S], tok[:, 1:P * S:S]
    assert ((keys >= 0) & (keys < task.num_keys)).all()
    assert ((vals >= task.num_keys) & (vals < task.num_keys + task.num_values)).all()
    assert all(len(set(row.tolist())) == P for row in keys)  # distinct keys: one answer per key
    filler = torch.ones(L, dtype=torch.bool)
    filler[0:P * S:S] = filler[1:P * S:S] = False
    filler[L - task.num_queries:] = False
    assert (tok[:, filler] >= task.num_keys + task.num_values).all() and (tok[:, filler] < task.vocab_size).all()
    qpos = task.query_positions()
    assert qpos.tolist() == list(range(L - task.num_queries, L))
    asked = (tgt != IGNORE_INDEX)
    assert asked.sum(1).tolist() == [task.num_queries] * B and asked[:, qpos].all()
    for i in range(B):
        stored = dict(zip(keys[i].tolist(), vals[i].tolist()))
        for p in qpos.tolist():
            assert tgt[i, p].item() == stored[tok[i, p].item()]


def test_answers_lie_beyond_the_window():
    task = RecallTask()
    b = _sample(task)
    tok, tgt = b.tokens.view(-1, task.seq_len), b.targets.view(-1, task.seq_len)
    nearest = []
    for i in range(tok.shape[0]):
        for p in task.query_positions().tolist():
            where = (tok[i, :p] == tgt[i, p]).nonzero().flatten()  # every earlier copy of the answer
            nearest.append(p - int(where.max()))
    assert min(nearest) >= task.min_distance
    # the demo's window-only model (2 layers, window 32) reaches 2 * 31 positions back
    assert task.min_distance > 2 * 31
    # the query region holds keys only: no answer inside any window of the queries
    assert (tok[:, task.query_positions()] < task.num_keys).all()


def test_same_seed_same_batch_other_seed_other_batch():
    task = RecallTask()
    a, b, c = _sample(task, seed=3), _sample(task, seed=3), _sample(task, seed=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)


def test_chance_and_vocab():
    task = RecallTask(num_keys=20, num_values=8, num_filler=5)
    assert task.vocab_size == 33 and task.chance == 1 / 8


@pytest.mark.parametrize("kw, match", [
    ({"num_pairs": 0}, "num_pairs"),
    ({"num_pairs": 40, "num_keys": 32}, "num_pairs"),
    ({"pair_spacing": 1}, "pair_spacing"),
    ({"seq_len": 140, "num_pairs": 8, "pair_spacing": 16, "num_queries": 32}, "seq_len"),
    ({"num_values": 2.5}, "num_values"),
])
def test_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        RecallTask(**kw)


def test_bad_sample_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        RecallTask().sample(0, torch.Generator())
    with pytest.raises(TypeError, match="generator"):
        RecallTask().sample(2, 0)
