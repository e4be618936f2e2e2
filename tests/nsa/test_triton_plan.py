"""NSA Triton launch plans: token packs, wide packs and the dK/dV work list (``triton_plan``), and the
kernels' results under each choice of the plan.

Runs where CUDA is available, or on the CPU under the Triton interpreter, in its own process:
``TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee python -m pytest tests/nsa/test_triton_plan.py``.
Shapes are tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import pytest
import torch

from sparseops import _checks  # reads TRITON_INTERPRET as Triton does; imports no triton

if not _checks.triton_interpret() and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from sparseops.nsa import triton_impl, triton_plan  # noqa: E402

from . import triton_cases  # noqa: E402
from .triton_cases import (  # noqa: E402
    CASES,
    DEVICE,
    PACK_CASES,
    S,
)
from .triton_cases import blocks as _blocks  # noqa: E402
from .triton_cases import bwd as _bwd  # noqa: E402
from .triton_cases import case as _case  # noqa: E402
from .triton_cases import check as _check  # noqa: E402
from .triton_cases import fwd as _fwd  # noqa: E402
from .triton_cases import plan as _plan  # noqa: E402
from .triton_cases import share_first_packs as _share_first_packs  # noqa: E402

pytestmark = pytest.mark.triton
#: the shared fixtures: ``override(SETTINGS, **knobs)``, and wide packs for fp32 inputs in every test
override = triton_cases.override
wide_packs_in_fp32 = triton_cases.wide_packs_in_fp32


def test_packed_path_is_taken(monkeypatch):
    """G < 16 launches the packed kernels (the pack table is built, P > 1); G = 16 keeps one token per program.
    Wide packs (64 rows: 32 tokens at G = 2, 4 at G = 16) get a table of their own, in the forward and in dQ."""
    assert [triton_plan.pack_size(g) for g in (1, 2, 3, 4, 8, 9, 16, 32)] == [16, 8, 4, 4, 2, 1, 1, 1]
    assert [triton_plan.wide_pack_size(g) for g in (1, 2, 3, 4, 8, 9, 16, 32)] == [64, 32, 16, 16, 8, 4, 4, 2]
    seen = []
    real = triton_plan.build_pack_table

    def spy(topk, cu_q, P, blocks):
        seen.append(P)
        return real(topk, cu_q, P, blocks)

    monkeypatch.setattr(triton_plan, "build_pack_table", spy)
    for N1, expect in ((4, [8, 32, 8, 32]), (32, [4, 4])):  # N2 = 2: G = 2, then G = 16
        seen.clear()
        c = _case([5, 4], N1=N1, N2=2, Dqk=16, Dv=16, bs=16, K=2)
        out, m, l = _fwd(triton_impl, c)
        _bwd(triton_impl, c, out, m, l)
        assert seen == expect


def test_pack_table_invariants():
    """Packs tile every token once, never cross a sequence, and list each pack's distinct valid block ids."""
    seqs = [1, 0, 21, 6, 4]
    c = _case(seqs, N1=2, N2=2, Dqk=16, Dv=16, bs=16, K=3, empty_frac=0.3, duplicates=True)
    P = 4
    pk = triton_plan.build_pack_table(c["topk"], c["cu_q"], P, _blocks(c))
    assert pk["n_packs"] == sum(-(-s // P) for s in seqs)
    t0, n = pk["pk_t0"].tolist(), pk["pk_n"].tolist()
    seq_id, _ = triton_plan.token_seq_positions(c["cu_q"])
    covered = [t for a, b in zip(t0, n) for t in range(a, a + b)]
    assert covered == list(range(sum(seqs)))
    assert all(1 <= b <= P and seq_id[a] == seq_id[a + b - 1] for a, b in zip(t0, n))
    topk = c["topk"].cpu()
    for i, (a, b) in enumerate(zip(t0, n)):
        for n2 in range(2):
            want = sorted({int(x) for x in topk[a:a + b, n2].flatten() if x >= 0})
            nu = int(pk["pk_nu"][i, n2])
            assert nu == len(want)
            assert pk["pk_ids"][i, n2, :nu].tolist() == want and (pk["pk_ids"][i, n2, nu:] == -1).all()


WIDE_CASES = [("G16", 32, 2, 3, 1), ("G32", 32, 1, 2, 1), ("G12", 12, 1, 3, 1), ("G2", 4, 2, 3, 8), ("G3", 3, 1, 2, 4)]


@pytest.mark.parametrize("N1, N2, K, P_s", [c[1:] for c in WIDE_CASES], ids=[c[0] for c in WIDE_CASES])
def test_wide_plan_gives_each_token_to_one_program(N1, N2, K, P_s):
    """``_q_plan``: a wide pack (64 tile rows) runs where its distinct blocks are at most WIDE_SHARE of the block
    steps of the ordinary programs covering its tokens, those programs run where it does not, so every (token,
    KV head) belongs to exactly one running program. Sharing packs go wide, packs that pick their own blocks do not."""
    G = N1 // N2
    P_w = triton_plan.wide_pack_size(G)
    seqs = [P_w + 3, 0, 1, 2 * P_w]  # ragged last packs, an empty and a one-token sequence
    c = _case(seqs, [40 * P_w, 5, 16, 40 * P_w], N1=N1, N2=N2, Dqk=16, Dv=16, bs=16, K=K, causal=False,
              empty_frac=0.1, duplicates=True)
    c = _share_first_packs(c, P_w)
    (n_w, pk_w, run_w, tile_w, _), (n_s, pk_s, run_s, tile_s, _) = _plan(c)
    assert tile_w["PACK"] == P_w and tile_w["PACK"] * tile_w["BLOCK_G"] == 64 and tile_s["PACK"] == P_s
    topk = c["topk"].cpu()
    T1 = topk.shape[0]
    seen = torch.zeros(T1, N2, dtype=torch.int64)
    if P_s == 1:
        small = [(t, 1) for t in range(T1)]
    else:
        small = list(zip(pk_s[0].tolist(), pk_s[1].tolist()))
    for (a, n), run in zip(small, run_s.cpu()):
        seen[a:a + n] += run.to(torch.int64)
    wide_run = []
    for i, (a, n) in enumerate(zip(pk_w[0].tolist(), pk_w[1].tolist())):
        seen[a:a + n] += run_w[i].cpu().to(torch.int64)
        for n2 in range(N2):
            distinct = lambda x: len({int(b) for b in x.flatten() if b >= 0})  # noqa: E731
            u = distinct(topk[a:a + n, n2])
            steps = n * K if P_s == 1 else sum(distinct(topk[s:s + m, n2]) for s, m in small if a <= s < a + n)
            assert bool(run_w[i, n2]) == (u <= S.get().wide_share * steps), (i, n2, u, steps)
            wide_run.append(bool(run_w[i, n2]))
    assert (seen == 1).all()
    stats = triton_plan.pack_stats(c["q"], c["topk"], c["cu_q"], c["cu_kv"], c["bs"], 16)
    steps_s = [K] * T1 if P_s == 1 else pk_s[3].cpu()
    assert stats == {
        "wide_programs": int(run_w.sum()), "ordinary_programs": int(run_s.sum()), "token_steps": T1 * N2 * K,
        "wide_steps": int(sum(int(pk_w[3][i, n2]) for i in range(n_w) for n2 in range(N2) if run_w[i, n2])),
        "ordinary_steps": int(sum(int(steps_s[i] if P_s == 1 else steps_s[i, n2]) for i in range(n_s)
                                  for n2 in range(N2) if run_s[i, n2]))}
    # the sharing packs of more than one ordinary program (a pack that is one ordinary program gains nothing)
    pos = triton_plan.token_seq_positions(c["cu_q"])[1]
    sharing = [i for i, (a, n) in enumerate(zip(pk_w[0].tolist(), pk_w[1].tolist())) if pos[a] == 0 and n > P_s]
    assert sharing and all(bool(run_w[i].all()) for i in sharing)
    assert not all(wide_run)  # some packs drew their own blocks and stay ordinary


@pytest.mark.parametrize("N1, N2, K, P_s", [c[1:] for c in WIDE_CASES], ids=[c[0] for c in WIDE_CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_wide_and_ordinary_programs_against_reference(N1, N2, K, P_s, causal):
    """One call with both kinds of programs running (sharing packs wide, the rest ordinary): forward, stats, dQ,
    dK, dV against the reference; duplicates, -1 slots, ragged packs."""
    P_w = triton_plan.wide_pack_size(N1 // N2)
    # blocks drawn from the whole long key sequences, also where the op masks causally (later blocks: invisible)
    c = _case([P_w + 3, 0, 1, P_w + 1], [40 * P_w, 5, 16, 40 * P_w], N1=N1, N2=N2, Dqk=32, Dv=16, bs=16, K=K,
              causal=False, empty_frac=0.1, duplicates=True)
    c = {**_share_first_packs(c, P_w), "causal": causal}
    (_, _, run_w, _, _), (_, _, run_s, _, _) = _plan(c)
    assert run_w.any() and run_s.any()
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("share", [0.0, float("inf")], ids=["ordinary-only", "wide-only"])
@pytest.mark.parametrize("kw", triton_cases.params(CASES + PACK_CASES, heavy={"limits"}))
def test_wide_or_ordinary_only(override, kw, share):
    """WIDE_SHARE = 0: the ordinary programs run (wide ones only for packs with no block at all); inf: every pack
    runs wide where wide packs are on (not at bs = 128 with Dqk = Dv = 256: WIDE_MAX_BLOCK_VALUES)."""
    override(S, wide_share=share)
    c = _case(**{"Dqk": 32, "Dv": 16, "bs": 16, **kw})
    _check(c, torch.float32, deterministic_too=False)


def test_wide_packs_off(override):
    """WIDE_ROWS = 0, blocks past WIDE_MAX_BLOCK_VALUES and (without WIDE_FP32, on a GPU) fp32 inputs: one ungated
    launch."""
    c = _case([9, 20], N1=32, N2=2, Dqk=32, Dv=16, bs=16, K=2)
    assert len(_plan(c)) == 2
    with S.override(wide_max_block_values=16 * 48 - 1):
        assert [x[2] for x in _plan(c)] == [None]
    with S.override(wide_fp32=False):
        assert len(_plan(c)) == (2 if DEVICE == "cpu" else 1)  # the interpreter always takes them
    override(S, wide_rows=0)
    assert [x[2] for x in _plan(c)] == [None]
    _check(c, torch.float32, deterministic_too=False)


def test_wide_packs_on_mma_sync_gpus(monkeypatch):
    """sm_80 (simulated): the forward takes wide packs by WIDE_SHARE_MMA_SYNC, dQ keeps the ordinary launch alone
    (its wide tile spills there); both against the reference with wide and ordinary forward programs running."""
    from sparseops import _triton

    monkeypatch.setattr(_triton, "arch", lambda device: 80)
    c = _case([7, 0, 1, 6], [640, 5, 16, 640], N1=32, N2=2, Dqk=32, Dv=16, bs=16, K=3, causal=False,
              empty_frac=0.1, duplicates=True)
    c = _share_first_packs(c, 4)
    (n_w, pk_w, run_w, _, _), (_, _, run_s, _, _) = _plan(c)
    assert run_w.any() and run_s.any()
    u, n = pk_w[3].float(), pk_w[1].float()[:, None]
    assert torch.equal(run_w.bool(), u <= S.get().wide_share_mma_sync * n * 3)
    assert [x[2] for x in _plan(c, dq=True)] == [None]
    _check(c, torch.float32, deterministic_too=False)


def test_dq_atomic_only_where_it_fits():
    """The dQ-in-dK/dV variant needs more shared memory; shapes where it would not fit keep the dQ kernel."""
    h = triton_plan._head_blocks
    assert triton_plan._dq_atomic_fits(64, h(192, 128)) and triton_plan._dq_atomic_fits(128, h(128, 64))
    # bs = 128 runs as two programs of 64 key rows: the same fit as bs = 64
    assert triton_plan._dq_atomic_fits(128, h(192, 128))
    assert not triton_plan._dq_atomic_fits(64, h(256, 256)) and not triton_plan._dq_atomic_fits(128, h(256, 256))


def test_inverse_index_invariants():
    """Every valid (token, head, slot) entry appears exactly once, under the block it selected."""
    c = _case([5, 30], [20, 50], N1=4, N2=2, Dqk=16, Dv=16, bs=16, K=3, empty_frac=0.3, duplicates=True)
    seq_id, _, _, _ = triton_plan._token_meta(c["cu_q"], c["cu_kv"], DEVICE)
    ix = triton_plan.build_inverse_index(c["topk"], seq_id, c["bs"], c["cu_kv"], chunk=2)
    n_valid = int((c["topk"] >= 0).sum())
    counts = ix["blk_c1"] - ix["blk_c0"]
    assert int(counts.sum()) == int((ix["ch_blk"] >= 0).sum())
    assert int((ix["ch_e1"] - ix["ch_e0"]).sum()) == n_valid
    assert int(ix["blk_n"].sum()) == c["k"].shape[0] * c["k"].shape[1]  # blocks tile every key row once per head
