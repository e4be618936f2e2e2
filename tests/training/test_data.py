"""The training data: the global batch of step s depends on (seed, s) only; rank shares tile it."""

from __future__ import annotations

import pytest
import torch

from sparseops.training.data import RecallStream, TokenFile, share, shares

from ..models.test_lm import TINY_TASK


def test_share_tiles_the_batch():
    assert [share(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="batch_size: expected a multiple of the data-parallel size 3, got 8"):
        share(8, 0, 3)
    # micro-batch m is the sequences [m*B/M, (m+1)*B/M), and each rank takes its equal share of it
    assert [shares(8, r, 2, 2) for r in range(2)] == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    with pytest.raises(ValueError, match=r"batch_size: expected a multiple of micro_batches \* the data-parallel "
                                         r"size = 4 \* 2, got 12"):
        shares(12, 0, 2, 4)


def test_recall_stream_is_the_task_stream_at_every_world_size():
    """Step s's global batch is the s-th draw of Generator(seed), whatever the world size and the micro-batches;
    the shares concatenate, micro-batch after micro-batch and rank after rank within one."""
    gen = torch.Generator().manual_seed(5)
    want = [TINY_TASK.sample(4, gen) for _ in range(3)]
    for world, micro in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        streams = [RecallStream(TINY_TASK, 4, seed=5) for _ in range(world)]
        for s in range(3):
            per_rank = [st.batches(s, r, world, micro) if micro > 1 else [st.batch(s, r, world)]
                        for r, st in enumerate(streams)]
            parts = [per_rank[r][m] for m in range(micro) for r in range(world)]
            assert torch.equal(torch.cat([p.tokens for p in parts]), want[s].tokens)
            assert torch.equal(torch.cat([p.targets for p in parts]), want[s].targets)
            assert all(p.n_targets == 4 * TINY_TASK.num_queries for p in parts)
            assert torch.equal(parts[0].cu_seqlens, torch.arange(4 // (world * micro) + 1, dtype=torch.int32) * 80)


def test_recall_stream_state_resumes_and_rejects_a_skipped_step():
    a, b = RecallStream(TINY_TASK, 2, seed=1), RecallStream(TINY_TASK, 2, seed=1)
    a.batch(0)
    b.load_state_dict(a.state_dict())
    assert b.position == 1 and torch.equal(a.batch(1).tokens, b.batch(1).tokens)
    with pytest.raises(ValueError, match="step: expected the stream's next step 2, got 5"):
        a.batch(5)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_epochs_and_shares(tmp_path, dtype):
    L, B, N = 4, 3, 4 * 5 + 3  # 5 windows of L+1 tokens (one overlap), 2 tokens left over
    ids = torch.randint(0, 60_000, (N,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    path = tmp_path / "tokens.bin"
    ids.to(getattr(torch, dtype)).numpy().tofile(path)
    data = TokenFile(path, dtype, L, B, seed=3)
    assert data.num_windows == 5 and data.vocab_size == int(ids.max()) + 1
    seen = []
    for s in range(5):  # 15 sequences: 3 epochs of the 5 windows
        full = data.batch(s)
        rows = full.tokens.view(B, L)
        assert torch.equal(full.targets.view(B, L)[:, :-1], rows[:, 1:]) and full.n_targets == B * L
        for row, tgt in zip(rows, full.targets.view(B, L)):
            start = next(w for w in range(5) if torch.equal(ids[w * L:w * L + L], row))
            assert tgt[-1] == ids[start * L + L]
            seen.append(start)
    assert all(sorted(seen[e * 5:(e + 1) * 5]) == list(range(5)) for e in range(3))  # each window once per epoch
    other = TokenFile(path, dtype, L, B, seed=3)
    assert torch.equal(other.batch(4).tokens, data.batch(4).tokens)  # a function of (seed, step) only
    assert torch.equal(TokenFile(path, dtype, L, B, seed=3).batch(2, 2, 3).tokens, data.batch(2).tokens[2 * L:])
    whole = TokenFile(path, dtype, L, 4, seed=3).batch(1).tokens.view(4, L)  # rank 1 of 2, micro-batches of 2
    assert torch.equal(torch.stack([b.tokens for b in TokenFile(path, dtype, L, 4, seed=3).batches(1, 1, 2, 2)]),
                       whole[[1, 3]])


def test_token_file_bad_input(tmp_path):
    path = tmp_path / "t.bin"
    torch.arange(10, dtype=torch.int16).numpy().tofile(path)
    with pytest.raises(ValueError, match="seq_len: expected at most 9"):
        TokenFile(path, "uint16", 9 + 1, 1, 0)
    with pytest.raises(ValueError, match="vocab_size: expected more than the file's largest token id 9, got 9"):
        TokenFile(path, "uint16", 4, 1, 0, vocab_size=9)
    (tmp_path / "odd.bin").write_bytes(b"123456")
    with pytest.raises(ValueError, match="expected a multiple of 4 bytes .uint32., got 6 bytes"):
        TokenFile(tmp_path / "odd.bin", "uint32", 1, 1, 0)
    with pytest.raises(ValueError, match="path: expected a token file"):
        TokenFile(tmp_path / "missing.bin", "uint16", 4, 1, 0)
    (tmp_path / "empty.bin").write_bytes(b"")  # no window of one input and its target, whatever seq_len
    (tmp_path / "one.bin").write_bytes(b"12")
    for name, n in (("empty.bin", 0), ("one.bin", 1)):
        with pytest.raises(ValueError, match=f"path: expected a token file of at least 2 tokens, got {n} in"):
            TokenFile(tmp_path / name, "uint16", 1, 1, 0)


def test_token_file_takes_every_seed_the_cli_accepts(tmp_path):
    """The epoch's generator seed ``seed * 1000003 + epoch`` is taken mod 2**64: the largest --seed and 2**45
    overflowed manual_seed; a seed that fitted keeps its order (a negative one as manual_seed wraps it)."""
    from sparseops.cli._flags import SEED_MAX, SEED_MIN

    path = tmp_path / "t.bin"
    (torch.arange(200) % 17).to(torch.uint16).numpy().tofile(path)
    for seed in (SEED_MAX, SEED_MIN, 2**45):
        TokenFile(path, "uint16", 8, 4, seed).batch(0)
    for seed in (3, -7):
        g = torch.Generator().manual_seed(seed * 1_000_003)
        data = TokenFile(path, "uint16", 8, 4, seed)
        data.batch(0)
        assert torch.equal(data._perm[1], torch.randperm(data.num_windows, generator=g))
