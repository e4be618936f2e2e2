"""NSA Triton kernels against the float64 reference.

Runs where CUDA is available, or on the CPU under the Triton interpreter, in its own process:
``TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee python -m pytest tests/nsa/test_nsa_triton.py``.
Shapes are tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from sparseops import testing  # noqa: E402
from sparseops._varlen import normalize_cu_seqlens  # noqa: E402
from sparseops.nsa import reference, triton_impl  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"


@pytest.fixture(autouse=True)
def _wide_packs_in_fp32(monkeypatch):
    """fp32 inputs take wide packs here on a GPU too, as they always do under the interpreter."""
    monkeypatch.setattr(triton_impl, "WIDE_FP32", True)


def _case(seqs_q, seqs_kv=None, *, dtype=torch.float32, topk=None, seed=0, **kw):
    a = testing.make_nsa_inputs(seqs_q, seqs_kv, dtype=dtype, seed=seed, device=DEVICE, **kw)
    q, k, v = a["query"], a["key"], a["value"]
    cu_q = normalize_cu_seqlens("actual_seq_qlen", a["actual_seq_qlen"], q.shape[0])
    cu_kv = normalize_cu_seqlens("actual_seq_kvlen", a["actual_seq_kvlen"], k.shape[0])
    g = torch.Generator().manual_seed(seed + 7)
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    return {
        "q": q, "k": k, "v": v, "topk": a["topk_indices"] if topk is None else topk.to(DEVICE),
        "scale": a["scale_value"], "bs": a["selected_block_size"], "cu_q": cu_q, "cu_kv": cu_kv,
        "causal": a["sparse_mode"] == 2, "dout": dout,
    }


def _fwd(impl, c, upcast=False):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    return impl.forward(cast(c["q"]), cast(c["k"]), cast(c["v"]), c["topk"], c["scale"], c["bs"], c["cu_q"],
                        c["cu_kv"], c["causal"])


def _bwd(impl, c, out, m, l, upcast=False, **kw):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    return impl.backward(cast(c["q"]), cast(c["k"]), cast(c["v"]), cast(out), cast(c["dout"]), m, l, c["topk"],
                         c["scale"], c["bs"], c["cu_q"], c["cu_kv"], c["causal"], **kw)


def _check(c, dtype, deterministic_too=True):
    """Forward, stats and all three gradients (both dK/dV paths) against the float64 reference."""
    out, m, l = _fwd(triton_impl, c)
    r_out, r_m, r_l = _fwd(reference, c, upcast=True)
    assert out.dtype == dtype and m.dtype == torch.float32 and l.dtype == torch.float32
    testing.assert_close(out, r_out, dtype, "out")
    testing.assert_close(m, r_m, torch.float32, "softmax_max")
    testing.assert_close(l, r_l, torch.float32, "softmax_sum")
    ref = _bwd(reference, c, r_out, r_m, r_l, upcast=True)
    paths = (False, True) if deterministic_too else (False,)
    for det in paths:
        grads = _bwd(triton_impl, c, out, m, l, deterministic=det)
        for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, (c["q"], c["k"], c["v"])):
            assert g.dtype == t.dtype and g.shape == t.shape, name
            testing.assert_close(g, r, dtype, f"{name} (deterministic={det})")
    return out, m, l


def _sparse_topk(K, tokens, N2=1):
    """[T1, N2, K] int32 block ids, -1 except ``{slot: id}`` per token (the same on every KV head)."""
    t = torch.full((len(tokens), N2, K), -1, dtype=torch.int32)
    for i, slots in enumerate(tokens):
        for j, b in slots.items():
            t[i, :, j] = b
    return t


CASES = [
    # id, make_nsa_inputs arguments
    ("varlen-causal-G2", dict(seqs_q=[5, 20], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2)),
    # S2 = 33, 40 not multiples of bs; S1 != S2; Dqk = 48 -> two head-dim chunks (32 + 16)
    ("varlen-noncausal-G1-empty-dup", dict(seqs_q=[7, 9], seqs_kv=[33, 40], N1=2, N2=2, Dqk=48, Dv=16, bs=16,
                                          K=3, causal=False, empty_frac=0.3, duplicates=True)),
    # G = 16: one token fills the 16-row tile; an empty sequence in the middle
    ("G16-empty-seq", dict(seqs_q=[6, 0, 5], N1=16, N2=1, Dqk=32, Dv=32, bs=16, K=2)),
    # bs = 48 is not a power of two (tile padded to 64); Dv > 16 padded; causal with duplicates
    ("bs48-dup", dict(seqs_q=[3, 70], N1=6, N2=2, Dqk=16, Dv=24, bs=48, K=2, duplicates=True)),
    # G = 32: the largest group, a 32-row tile and 8 warps on GPU
    ("G32", dict(seqs_q=[4, 3], N1=32, N2=1, Dqk=16, Dv=16, bs=16, K=2)),
    # the paper's head dims (192 = 128 + 64, Dv = 128), G = 4, tiny T
    ("paper-dims", dict(seqs_q=[4, 3], seqs_kv=[40, 20], N1=4, N2=1, Dqk=192, Dv=128, bs=16, K=2, causal=False)),
    # the documented limits at once: Dqk = Dv = 256, bs = 128, K = 128, G = 32; ids in the first and last slots,
    # a block picked twice, the partial last block (300 = 2 * 128 + 44), the rest -1
    ("limits", dict(seqs_q=[3, 2], seqs_kv=[300, 130], N1=32, N2=1, Dqk=256, Dv=256, bs=128, K=128,
                    causal=False, topk=_sparse_topk(128, [{0: 0, 127: 2}, {5: 1, 64: 1}, {126: 2, 3: 0},
                                                          {0: 1, 127: 0}, {50: 0, 51: 0, 52: 1}]))),
]


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_fp32_against_reference(kw):
    _check(_case(**kw), torch.float32)


# Token packing (G < 16): a forward / dQ program takes P = 16 // next_pow2(G) consecutive tokens of one sequence.
# Sequence lengths are not multiples of P (ragged last packs), with a 1-token and an empty sequence.
PACK_CASES = [
    # G = 1, P = 16: a 21-token sequence is a full pack + 5; the last sequence has no keys (fully masked rows)
    ("G1-P16", dict(seqs_q=[1, 0, 21, 6], seqs_kv=[17, 5, 40, 0], N1=2, N2=2, K=3, empty_frac=0.2, duplicates=True)),
    # G = 2, P = 8, not causal: each token of a pack sees whole blocks, many of them shared
    ("G2-P8-noncausal", dict(seqs_q=[11, 1, 0, 7], seqs_kv=[30, 33, 4, 18], N1=4, N2=2, K=4, causal=False,
                             empty_frac=0.2, duplicates=True)),
    # G = 4, P = 4; Dqk = 48 (two head-dim chunks), Dv = 24 (padded)
    ("G4-P4-split", dict(seqs_q=[6, 0, 1, 9], N1=8, N2=2, Dqk=48, Dv=24, K=2, empty_frac=0.1, duplicates=True)),
    # G = 8, P = 2; bs = 32, S2 not a multiple of bs
    ("G8-P2-bs32", dict(seqs_q=[5, 1, 0, 8], seqs_kv=[40, 9, 3, 70], N1=8, N2=1, bs=32, K=2, causal=False,
                        duplicates=True)),
]


@pytest.mark.parametrize("kw", [c[1] for c in PACK_CASES], ids=[c[0] for c in PACK_CASES])
def test_packed_tokens_against_reference(kw):
    c = _case(**{"Dqk": 32, "Dv": 16, "bs": 16, **kw})
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_packed_tokens_select_different_blocks(causal):
    """G = 2 (P = 8), one sequence of 10 tokens: a full pack and a ragged one of 2. Tokens of a pack pick
    different blocks, duplicates (twice by one token), -1 slots; a whole pack of -1 on head 1 (no block at all)."""
    head0 = [[-1, -1, -1], [0, 0, -1], [1, 0, 2], [3, -1, 0], [1, 2, 3], [0, 1, 2], [2, 2, 0], [0, 3, 1],
             [0, -1, -1], [1, 1, 1]]
    head1 = [[3, 2, 1], [2, -1, 2], [0, 0, 0], [-1, 1, -1], [3, 3, 0], [0, 1, 2], [1, -1, 3], [2, 0, 0],
             [-1, -1, -1], [-1, -1, -1]]
    topk = torch.tensor([head0, head1], dtype=torch.int32).transpose(0, 1).contiguous()
    c = _case([10], [60], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=3, causal=causal, topk=topk)
    out, m, l = _check(c, torch.float32, deterministic_too=False)
    # (token, KV head) with no visible key: all -1; under causal masking (positions <= 9 see block 0 only)
    # also every token that picked no block 0
    sel = topk.to(DEVICE)
    dead = (sel < 0).all(-1) if not causal else ~(sel == 0).any(-1)
    dead = dead.repeat_interleave(2, dim=1)  # [T1, N1]: G = 2 heads per KV head
    assert dead.any() and (~dead).any()
    assert (out[dead] == 0).all() and (m[dead] == 0).all() and (l[dead] == 0).all()
    dq, _, _ = _bwd(triton_impl, c, out, m, l)
    assert (dq[dead] == 0).all()


def test_packed_path_is_taken(monkeypatch):
    """G < 16 launches the packed kernels (the pack table is built, P > 1); G = 16 keeps one token per program.
    Wide packs (64 rows: 32 tokens at G = 2, 4 at G = 16) get a table of their own, in the forward and in dQ."""
    assert [triton_impl.pack_size(g) for g in (1, 2, 3, 4, 8, 9, 16, 32)] == [16, 8, 4, 4, 2, 1, 1, 1]
    assert [triton_impl.wide_pack_size(g) for g in (1, 2, 3, 4, 8, 9, 16, 32)] == [64, 32, 16, 16, 8, 4, 4, 2]
    seen = []
    real = triton_impl.build_pack_table

    def spy(topk, cu_q, P, blocks):
        seen.append(P)
        return real(topk, cu_q, P, blocks)

    monkeypatch.setattr(triton_impl, "build_pack_table", spy)
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
    pk = triton_impl.build_pack_table(c["topk"], c["cu_q"], P, _blocks(c))
    assert pk["n_packs"] == sum(-(-s // P) for s in seqs)
    t0, n = pk["pk_t0"].tolist(), pk["pk_n"].tolist()
    seq_id, _ = triton_impl.token_seq_positions(c["cu_q"])
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


def _share_first_packs(c, P):
    """``c`` with every token of the first P-token pack of each sequence given the selection of that pack's last
    token (so the pack shares all its blocks); the other tokens keep their own draws."""
    t = c["topk"].clone()
    for a, b in zip(c["cu_q"][:-1], c["cu_q"][1:]):
        last = min(b, a + P) - 1
        if b > a:
            t[a:last + 1] = t[last]
    return {**c, "topk": t}


def _blocks(c):
    """Key blocks of each query token's sequence."""
    s2 = triton_impl._token_meta(c["cu_q"], c["cu_kv"], c["q"].device)[3]
    return triton_impl._key_blocks(s2, c["bs"])


def _plan(c, dq=False):
    q, topk = c["q"], c["topk"]
    G, K = q.shape[1] // topk.shape[1], topk.shape[2]
    _, pos = triton_impl.token_seq_positions(c["cu_q"], device=q.device)
    heads = triton_impl._head_blocks(q.shape[2], c["v"].shape[2])
    return triton_impl._q_plan(q, topk, c["cu_q"], _blocks(c), G, K, c["bs"], heads, pos.to(torch.int32), dq=dq)


# (id, N1, N2, K, ordinary programs): G = 16, 32, 12 (one token per ordinary program; 12 pads its heads to 16),
# 2 and 3 (packs of 8 and 4)
WIDE_CASES = [("G16", 32, 2, 3, 1), ("G32", 32, 1, 2, 1), ("G12", 12, 1, 3, 1), ("G2", 4, 2, 3, 8), ("G3", 3, 1, 2, 4)]


@pytest.mark.parametrize("N1, N2, K, P_s", [c[1:] for c in WIDE_CASES], ids=[c[0] for c in WIDE_CASES])
def test_wide_plan_gives_each_token_to_one_program(N1, N2, K, P_s):
    """``_q_plan``: a wide pack (64 tile rows) runs where its distinct blocks are at most WIDE_SHARE of the block
    steps of the ordinary programs covering its tokens, those programs run where it does not, so every (token,
    KV head) belongs to exactly one running program. Sharing packs go wide, packs that pick their own blocks do not."""
    G = N1 // N2
    P_w = triton_impl.wide_pack_size(G)
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
            assert bool(run_w[i, n2]) == (u <= triton_impl.WIDE_SHARE * steps), (i, n2, u, steps)
            wide_run.append(bool(run_w[i, n2]))
    assert (seen == 1).all()
    stats = triton_impl.pack_stats(c["q"], c["topk"], c["cu_q"], c["cu_kv"], c["bs"], 16)
    steps_s = [K] * T1 if P_s == 1 else pk_s[3].cpu()
    assert stats == {
        "wide_programs": int(run_w.sum()), "ordinary_programs": int(run_s.sum()), "token_steps": T1 * N2 * K,
        "wide_steps": int(sum(int(pk_w[3][i, n2]) for i in range(n_w) for n2 in range(N2) if run_w[i, n2])),
        "ordinary_steps": int(sum(int(steps_s[i] if P_s == 1 else steps_s[i, n2]) for i in range(n_s)
                                  for n2 in range(N2) if run_s[i, n2]))}
    # the sharing packs of more than one ordinary program (a pack that is one ordinary program gains nothing)
    pos = triton_impl.token_seq_positions(c["cu_q"])[1]
    sharing = [i for i, (a, n) in enumerate(zip(pk_w[0].tolist(), pk_w[1].tolist())) if pos[a] == 0 and n > P_s]
    assert sharing and all(bool(run_w[i].all()) for i in sharing)
    assert not all(wide_run)  # some packs drew their own blocks and stay ordinary


@pytest.mark.parametrize("N1, N2, K, P_s", [c[1:] for c in WIDE_CASES], ids=[c[0] for c in WIDE_CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_wide_and_ordinary_programs_against_reference(N1, N2, K, P_s, causal):
    """One call with both kinds of programs running (sharing packs wide, the rest ordinary): forward, stats, dQ,
    dK, dV against the reference; duplicates, -1 slots, ragged packs."""
    P_w = triton_impl.wide_pack_size(N1 // N2)
    # blocks drawn from the whole long key sequences, also where the op masks causally (later blocks: invisible)
    c = _case([P_w + 3, 0, 1, P_w + 1], [40 * P_w, 5, 16, 40 * P_w], N1=N1, N2=N2, Dqk=32, Dv=16, bs=16, K=K,
              causal=False, empty_frac=0.1, duplicates=True)
    c = {**_share_first_packs(c, P_w), "causal": causal}
    (_, _, run_w, _, _), (_, _, run_s, _, _) = _plan(c)
    assert run_w.any() and run_s.any()
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("share", [0.0, float("inf")], ids=["ordinary-only", "wide-only"])
@pytest.mark.parametrize("kw", [c[1] for c in CASES + PACK_CASES], ids=[c[0] for c in CASES + PACK_CASES])
def test_wide_or_ordinary_only(monkeypatch, kw, share):
    """WIDE_SHARE = 0: the ordinary programs run (wide ones only for packs with no block at all); inf: every pack
    runs wide where wide packs are on (not at bs = 128 with Dqk = Dv = 256: WIDE_MAX_BLOCK_VALUES)."""
    monkeypatch.setattr(triton_impl, "WIDE_SHARE", share)
    c = _case(**{"Dqk": 32, "Dv": 16, "bs": 16, **kw})
    _check(c, torch.float32, deterministic_too=False)


def test_wide_packs_off(monkeypatch):
    """WIDE_ROWS = 0, blocks past WIDE_MAX_BLOCK_VALUES and (without WIDE_FP32, on a GPU) fp32 inputs: one ungated
    launch."""
    c = _case([9, 20], N1=32, N2=2, Dqk=32, Dv=16, bs=16, K=2)
    assert len(_plan(c)) == 2
    limit = triton_impl.WIDE_MAX_BLOCK_VALUES
    monkeypatch.setattr(triton_impl, "WIDE_MAX_BLOCK_VALUES", 16 * 48 - 1)
    assert [x[2] for x in _plan(c)] == [None]
    monkeypatch.setattr(triton_impl, "WIDE_MAX_BLOCK_VALUES", limit)
    monkeypatch.setattr(triton_impl, "WIDE_FP32", False)
    assert len(_plan(c)) == (2 if DEVICE == "cpu" else 1)  # the interpreter always takes them
    monkeypatch.setattr(triton_impl, "WIDE_FP32", True)
    monkeypatch.setattr(triton_impl, "WIDE_ROWS", 0)
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
    assert torch.equal(run_w.bool(), u <= triton_impl.WIDE_SHARE_MMA_SYNC * n * 3)
    assert [x[2] for x in _plan(c, dq=True)] == [None]
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs(dtype):
    c = _case([6, 19], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, dtype=dtype, empty_frac=0.2, duplicates=True)
    _check(c, dtype)


def test_fully_masked_rows_are_zero():
    """Rows with no visible key: all slots -1, or (causal) only blocks that start after the query."""
    topk = torch.tensor([[[-1, -1]], [[1, -1]], [[0, 1]], [[-1, -1]], [[1, 0]]], dtype=torch.int32)
    c = _case([5], [40], N1=3, N2=1, Dqk=16, Dv=16, bs=16, K=2, topk=topk)
    out, m, l = _check(c, torch.float32)
    dead = torch.tensor([0, 1, 3], device=DEVICE)  # token 1 sits at position 1 and picks block 1 (keys 16..31)
    assert (out[dead] == 0).all() and (m[dead] == 0).all() and (l[dead] == 0).all()
    for det in (False, True):
        dq, dk, dv = _bwd(triton_impl, c, out, m, l, deterministic=det)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        assert (dq[dead] == 0).all()
        # keys 16..39 are only ever selected by queries at positions < 16: invisible under causal masking
        assert (dk[16:] == 0).all() and (dv[16:] == 0).all()


def test_never_selected_keys_get_zero_grads():
    topk = torch.zeros(4, 2, 1, dtype=torch.int64)  # only block 0 of each sequence, both heads; int64 ids
    c = _case([2, 2], [32, 32], N1=2, N2=2, Dqk=16, Dv=16, bs=16, K=1, causal=False, topk=topk)
    out, m, l = _check(c, torch.float32)
    _, dk, dv = _bwd(triton_impl, c, out, m, l)
    for s in (slice(16, 32), slice(48, 64)):
        assert (dk[s] == 0).all() and (dv[s] == 0).all()


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_deterministic_is_bitwise_stable_and_chunked(monkeypatch, chunk):
    """Small chunks split one key block's query list over several programs (workspace + ordered reduction)."""
    monkeypatch.setattr(triton_impl, "CHUNK", chunk)
    c = _case([9, 12], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, duplicates=True)
    out, m, l = _check(c, torch.float32)
    a = _bwd(triton_impl, c, out, m, l, deterministic=True)
    b = _bwd(triton_impl, c, out, m, l, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


DQ_ATOMIC_CASES = [
    # G = 2, varlen, duplicates (a token listed twice under one block adds its dQ rows twice), -1 slots
    ("G2-dup", dict(seqs_q=[5, 20], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=3, duplicates=True, empty_frac=0.2)),
    # G = 16, 128 + 64 head-dim split, noncausal, an empty sequence, S2 != S1
    ("G16-split", dict(seqs_q=[4, 0, 3], seqs_kv=[40, 0, 20], N1=16, N2=1, Dqk=192, Dv=128, bs=16, K=2,
                       causal=False)),
    # G = 3 (padded rows), bs = 48 (padded tile)
    ("G3-bs48", dict(seqs_q=[3, 70], N1=6, N2=2, Dqk=16, Dv=24, bs=48, K=2, duplicates=True)),
]


@pytest.mark.parametrize("chunk", [2, 256])
@pytest.mark.parametrize("kw", [c[1] for c in DQ_ATOMIC_CASES], ids=[c[0] for c in DQ_ATOMIC_CASES])
def test_dq_atomic_variant(monkeypatch, kw, chunk):
    """DQ_ATOMIC: dQ from the dK/dV kernel with atomics (the query-major dQ kernel does not run, D comes from its own
    kernel); the deterministic path ignores the switch."""
    monkeypatch.setattr(triton_impl, "DQ_ATOMIC", True)
    monkeypatch.setattr(triton_impl, "CHUNK", chunk)
    calls = []
    real = triton_impl.build_pack_table
    monkeypatch.setattr(triton_impl, "build_pack_table", lambda *a: calls.append(1) or real(*a))
    c = _case(**kw)
    out, m, l = _check(c, torch.float32)
    calls.clear()
    _bwd(triton_impl, c, out, m, l)
    assert calls == []  # with G < 16 the query-major dQ kernel would have built a pack table
    det = _bwd(triton_impl, c, out, m, l, deterministic=True)
    monkeypatch.setattr(triton_impl, "DQ_ATOMIC", False)
    for x, y in zip(_bwd(triton_impl, c, out, m, l, deterministic=True), det):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dq_atomic_half_inputs(monkeypatch, dtype):
    """The fp32 dQ buffer is cast once to the input dtype."""
    monkeypatch.setattr(triton_impl, "DQ_ATOMIC", True)
    c = _case([6, 19], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, dtype=dtype, empty_frac=0.2, duplicates=True)
    _check(c, dtype, deterministic_too=False)


def test_dq_atomic_fully_masked_rows_and_no_keys(monkeypatch):
    """Rows with no visible key get dq = 0 on the atomic path too; no key blocks at all gives zeros."""
    monkeypatch.setattr(triton_impl, "DQ_ATOMIC", True)
    topk = torch.tensor([[[-1, -1]], [[1, -1]], [[0, 1]], [[-1, -1]], [[1, 0]]], dtype=torch.int32)
    c = _case([5], [40], N1=3, N2=1, Dqk=16, Dv=16, bs=16, K=2, topk=topk)
    out, m, l = _check(c, torch.float32, deterministic_too=False)
    dq, _, _ = _bwd(triton_impl, c, out, m, l)
    assert (dq[torch.tensor([0, 1, 3], device=DEVICE)] == 0).all() and torch.isfinite(dq).all()
    c = _case([3], [0], N1=2, N2=1, Dqk=16, Dv=16, bs=16, K=1, topk=torch.full((3, 1, 1), -1, dtype=torch.int32))
    out, m, l = _fwd(triton_impl, c)
    for g, t in zip(_bwd(triton_impl, c, out, m, l), (c["q"], c["k"], c["v"])):
        assert g.shape == t.shape and g.dtype == t.dtype and (g == 0).all()


@pytest.mark.parametrize("N1", [16, 2, 32, 24],
                         ids=["G16-one-token-per-step", "G2-eight-tokens-per-step", "G32-half-a-token-per-step",
                              "G24-padded-head-groups"])
def test_dkv_rows_of_mma_sync_gpus(monkeypatch, N1):
    """On sm_8x the dK/dV kernel steps over 16 tile rows instead of 32 (``DKV_ROWS_MMA_SYNC``); with G > 16 a step
    takes one group of 16 of a token's heads (G = 24: the second group has 8 live heads); same results."""
    monkeypatch.setattr(triton_impl._triton, "arch", lambda device: 80)
    seen = []
    real = triton_impl._triton.launch
    monkeypatch.setattr(triton_impl._triton, "launch",
                        lambda kern, *a, **kw: seen.append(kw.get("BLOCK_E", 0) * kw.get("BLOCK_G", 0))
                        or real(kern, *a, **kw))
    c = _case([5, 11], N1=N1, N2=1, Dqk=48, Dv=24, bs=16, K=3, duplicates=True, empty_frac=0.2)
    _check(c, torch.float32)
    assert 16 in seen and 32 not in seen
    if N1 > 16:
        ref = _bwd(reference, c, *_fwd(reference, c, upcast=True), upcast=True)
        out, m, l = _fwd(triton_impl, c)
        monkeypatch.setattr(triton_impl, "DQ_ATOMIC", True)
        for name, g, r in zip(("dq", "dk", "dv"), _bwd(triton_impl, c, out, m, l), ref):
            testing.assert_close(g, r, torch.float32, f"{name} (DQ_ATOMIC)")


def test_dq_atomic_only_where_it_fits():
    """The dQ-in-dK/dV variant needs more shared memory; shapes where it would not fit keep the dQ kernel."""
    h = triton_impl._head_blocks
    assert triton_impl._dq_atomic_fits(64, h(192, 128)) and triton_impl._dq_atomic_fits(128, h(128, 64))
    # bs = 128 runs as two programs of 64 key rows: the same fit as bs = 64
    assert triton_impl._dq_atomic_fits(128, h(192, 128))
    assert not triton_impl._dq_atomic_fits(64, h(256, 256)) and not triton_impl._dq_atomic_fits(128, h(256, 256))


@pytest.mark.parametrize("key_rows", [16, 32, 48])
def test_dkv_key_block_split_over_programs(monkeypatch, key_rows):
    """A key block wider than ``DKV_KEY_ROWS`` is split over programs (grid axis 1): bs = 48 (padded to 64) in
    4 or 2 parts, the last part of each block all padding; partial last blocks (S2 = 70, 100); both dK/dV paths,
    DQ_ATOMIC, and chunks of 3 entries (several programs per part). 48 is not a power of two: it is taken as
    32 (64 // 48 programs of 48 rows each would have skipped 16 key rows)."""
    monkeypatch.setattr(triton_impl, "DKV_KEY_ROWS", key_rows)
    monkeypatch.setattr(triton_impl, "CHUNK", 3)
    grids = []
    real = triton_impl._triton.launch
    monkeypatch.setattr(triton_impl._triton, "launch",
                        lambda kern, grid, *a, **kw: grids.append((kern.__name__, grid)) or real(kern, grid, *a, **kw))
    c = _case([6, 9], [70, 100], N1=4, N2=2, Dqk=48, Dv=24, bs=48, K=3, duplicates=True, empty_frac=0.2)
    out, m, l = _check(c, torch.float32)
    assert {g[1] for n, g in grids if n == "nsa_bwd_dkv_kernel"} == {64 // {48: 32}.get(key_rows, key_rows)}
    ref = _bwd(reference, c, *_fwd(reference, c, upcast=True), upcast=True)
    monkeypatch.setattr(triton_impl, "DQ_ATOMIC", True)
    for name, g, r in zip(("dq", "dk", "dv"), _bwd(triton_impl, c, out, m, l), ref):
        testing.assert_close(g, r, torch.float32, f"{name} (DQ_ATOMIC)")


class _ShortOfSharedMemory:
    """Wraps a kernel: launches with more than ``fits`` stages raise Triton's OutOfResources, as a GPU with less
    shared memory would."""

    def __init__(self, kernel, fits):
        self.kernel, self.fits, self.tries = kernel, fits, []
        self.__name__ = kernel.__name__

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(*args, num_stages=None, **kw):
            self.tries.append(num_stages)
            if num_stages is None or num_stages > self.fits:
                raise OutOfResources(300_000, 232_448, "shared memory")
            return self.kernel[grid](*args, num_stages=num_stages, **kw)

        return run


def test_shared_memory_shortfall_retries_then_errors_clearly(monkeypatch):
    """Every NSA launch goes through ``_triton.launch``: one stage fewer when the device is short of shared memory
    (same results), and a ValueError naming the shape through the public op when nothing fits."""
    from sparseops import _triton
    from sparseops.nsa import triton_kernels as kern

    monkeypatch.setattr(_triton, "_STAGES", {})  # what the stand-ins make launch remember goes with them
    monkeypatch.setattr(_triton, "_NO_FIT", {})
    c = _case([5, 9], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, duplicates=True)
    want = _fwd(triton_impl, c)
    fwd = _ShortOfSharedMemory(kern.nsa_fwd_kernel, fits=1)
    monkeypatch.setattr(kern, "nsa_fwd_kernel", fwd)
    got = _fwd(triton_impl, c)
    assert fwd.tries == [2, 1, 2, 1]  # the wide launch, then the ordinary one
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    dkv = _ShortOfSharedMemory(kern.nsa_bwd_dkv_kernel, fits=0)
    monkeypatch.setattr(kern, "nsa_bwd_dkv_kernel", dkv)
    fwd_op, grad_op = _public_ops()
    a = testing.make_nsa_inputs([5, 9], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, device=DEVICE)
    kw = {n: a[n] for n in ("scale_value", "head_num", "selected_block_size", "selected_block_count",
                             "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    q, k, v = a["query"], a["key"], a["value"]
    out, smax, ssum = fwd_op(q, k, v, a["topk_indices"], backend="triton", **kw)
    with pytest.raises(ValueError, match=r"nsa_bwd_dkv_kernel: G=2, selected_block_count=2, selected_block_size=16"):
        grad_op(q, k, v, out, torch.ones_like(out), smax, ssum, a["topk_indices"], backend="triton", **kw)
    assert dkv.tries == [2, 1]


def test_programs_flagged_off_write_nothing(monkeypatch):
    """The run flags gate the forward and dQ programs: with every flag off, the outputs stay as allocated."""
    real_plan, real_empty, real_empty_like = triton_impl._q_plan, torch.empty, torch.empty_like
    monkeypatch.setattr(triton_impl, "_q_plan", lambda *a, **kw: [
        (n, pk, torch.zeros_like(run), tile, warps) for n, pk, run, tile, warps in real_plan(*a, **kw)])
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison_(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: testing.poison_(real_empty_like(*a, **kw)))
    c = _case([9, 14], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2)
    out, m, l = _fwd(triton_impl, c)
    assert out.isnan().all() and m.isnan().all() and l.isnan().all()
    dq, _, _ = _bwd(triton_impl, c, torch.zeros_like(out), torch.zeros_like(m), torch.ones_like(l))
    assert dq.isnan().all()


def test_wide_launch_that_does_not_fit_leaves_its_tokens_to_the_ordinary_one(monkeypatch):
    """A wide forward / dQ launch short of shared memory even unpipelined: the ordinary launch runs ungated and
    covers every token (same results as without wide packs)."""
    from triton.runtime.errors import OutOfResources

    from sparseops import _triton
    from sparseops.nsa import triton_kernels as kern

    monkeypatch.setattr(_triton, "_STAGES", {})
    monkeypatch.setattr(_triton, "_NO_FIT", {})
    c = _case([9, 14], N1=32, N2=2, Dqk=32, Dv=16, bs=16, K=2, duplicates=True)
    calls = []

    class WideDoesNotFit:
        def __init__(self, kernel):
            self.kernel, self.__name__ = kernel, kernel.__name__

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((self.__name__, kw["PACK"], kw["GATE"]))
                if kw["PACK"] > 1:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return self.kernel[grid](*args, **kw)
            return run

    for name in ("nsa_fwd_kernel", "nsa_bwd_dq_kernel"):
        monkeypatch.setattr(kern, name, WideDoesNotFit(getattr(kern, name)))
    _check(c, torch.float32, deterministic_too=False)
    assert ("nsa_fwd_kernel", 1, False) in calls and ("nsa_bwd_dq_kernel", 1, False) in calls
    assert all(not gate for _, pack, gate in calls if pack == 1)


KEY_STEP_CASES = [
    ("G16-bs48", dict(seqs_q=[6, 0, 5], seqs_kv=[70, 3, 60], N1=16, N2=1, bs=48, K=2, causal=False)),
    ("G32-bs32-causal", dict(seqs_q=[4, 40], N1=32, N2=1, bs=32, K=2, duplicates=True)),
    ("G2-bs48-dup", dict(seqs_q=[5, 20], N1=4, N2=2, bs=48, K=3, duplicates=True, empty_frac=0.2)),
    ("G1-bs32-packed", dict(seqs_q=[1, 0, 21, 6], seqs_kv=[17, 5, 80, 0], N1=2, N2=2, bs=32, K=3, empty_frac=0.2)),
]


@pytest.mark.parametrize("wide", [64, 0], ids=["wide-on", "wide-off"])
@pytest.mark.parametrize("kw", [c[1] for c in KEY_STEP_CASES], ids=[c[0] for c in KEY_STEP_CASES])
@pytest.mark.parametrize("knob", ["FWD_KEY_ROWS", "DQ_KEY_ROWS"], ids=["forward", "dq"])
def test_key_steps_smaller_than_the_block(monkeypatch, knob, kw, wide):
    """FWD_KEY_ROWS / DQ_KEY_ROWS = 16: the forward / dQ kernel takes each (padded) block in steps of 16 keys
    (bs = 48: 4 steps, 32: 2) in one-token, packed and wide programs, against the reference."""
    monkeypatch.setattr(triton_impl, knob, 16)
    monkeypatch.setattr(triton_impl, "WIDE_ROWS", wide)
    c = _case(**{"Dqk": 32, "Dv": 16, **kw})
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("kernel", ["nsa_fwd_kernel", "nsa_bwd_dq_kernel"])
def test_launch_short_of_shared_memory_takes_fewer_keys_per_step(monkeypatch, kernel):
    """A forward / dQ launch that does not fit even unpipelined is retried with half the key rows per step, down
    to what fits; the result is the reference's."""
    from triton.runtime.errors import OutOfResources

    from sparseops import _triton
    from sparseops.nsa import triton_kernels as kern

    monkeypatch.setattr(_triton, "_STAGES", {})
    monkeypatch.setattr(_triton, "_NO_FIT", {})
    calls = []
    real = getattr(kern, kernel)

    class FitsSixteenKeys:
        __name__ = real.__name__

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(kw["BLOCK_KC"])
                if kw["BLOCK_KC"] > 16:
                    raise OutOfResources(300_000, 101_376, "shared memory")
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(kern, kernel, FitsSixteenKeys())
    monkeypatch.setattr(triton_impl, "WIDE_ROWS", 0)  # one launch, so the calls below are its tries
    c = _case([5, 20], N1=4, N2=2, Dqk=32, Dv=16, bs=48, K=2, duplicates=True)
    _check(c, torch.float32, deterministic_too=False)
    assert calls == [64, 64, 32, 32, 16]  # two stages then one at 64 and 32 keys, 16 fits


def test_every_output_element_is_written(monkeypatch):
    """Fresh buffers (outputs, stats, D, workspace) come back NaN-poisoned: a missed store shows up as an error."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*a, **kw):
        return testing.poison_(real_empty(*a, **kw))

    def empty_like(*a, **kw):
        return testing.poison_(real_empty_like(*a, **kw))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(triton_impl, "CHUNK", 2)
    # bs = 48 (padded tile), S2 not a multiple of bs, an empty query sequence, a sequence without keys,
    # G = 3 (padded rows)
    c = _case([4, 0, 9, 3], [50, 10, 60, 0], N1=6, N2=2, Dqk=48, Dv=24, bs=48, K=2, empty_frac=0.2, duplicates=True)
    _check(c, torch.float32)


def test_float64_is_rejected():
    c = _case([3], N1=2, N2=1, Dqk=16, Dv=16, bs=16, K=1, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        _fwd(triton_impl, c)


def test_inverse_index_invariants():
    """Every valid (token, head, slot) entry appears exactly once, under the block it selected."""
    c = _case([5, 30], [20, 50], N1=4, N2=2, Dqk=16, Dv=16, bs=16, K=3, empty_frac=0.3, duplicates=True)
    seq_id, _, _, _ = triton_impl._token_meta(c["cu_q"], c["cu_kv"], DEVICE)
    ix = triton_impl.build_inverse_index(c["topk"], seq_id, c["bs"], c["cu_kv"], chunk=2)
    n_valid = int((c["topk"] >= 0).sum())
    counts = ix["blk_c1"] - ix["blk_c0"]
    assert int(counts.sum()) == int((ix["ch_blk"] >= 0).sum())
    assert int((ix["ch_e1"] - ix["ch_e0"]).sum()) == n_valid
    assert int(ix["blk_n"].sum()) == c["k"].shape[0] * c["k"].shape[1]  # blocks tile every key row once per head


def _public_ops():
    from sparseops.nsa import api

    ops = (api.nsa_selected_attention, api.nsa_selected_attention_grad)
    if getattr(ops[0], "__name__", "") == "_todo":
        pytest.skip("the public NSA ops have not landed on this branch yet")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_public_ops_backend_triton_with_autograd(dtype):
    """Through the public API: forward + autograd backward and the seed grad op, against backend='reference'."""
    fwd, grad = _public_ops()
    a = testing.make_nsa_inputs([5, 18], [21, 30], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, dtype=dtype,
                                empty_frac=0.2, duplicates=True, device=DEVICE)
    kw = {n: a[n] for n in ("topk_indices", "scale_value", "head_num", "selected_block_size",
                             "selected_block_count", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    q, k, v = (a[n].detach().requires_grad_(True) for n in ("query", "key", "value"))
    out, smax, ssum = fwd(q, k, v, backend="triton", **kw)
    assert smax.shape == (q.shape[0], q.shape[1], 8) and smax.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    out.backward(dout)

    q64, k64, v64 = (a[n].detach().double().requires_grad_(True) for n in ("query", "key", "value"))
    r_out, r_max, r_sum = fwd(q64, k64, v64, backend="reference", **kw)
    r_out.backward(dout.double())
    testing.assert_close(out, r_out, dtype, "out")
    testing.assert_close(smax, r_max, torch.float32, "softmax_max")
    testing.assert_close(ssum, r_sum, torch.float32, "softmax_sum")
    for name, x, r in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        testing.assert_close(x.grad, r.grad, dtype, f"{name} (autograd)")

    gk = {n: kw[n] for n in kw if n != "topk_indices"}
    for det in (False, True):
        dq, dk, dv = grad(q.detach(), k.detach(), v.detach(), out.detach(), dout, smax, ssum, kw["topk_indices"],
                          deterministic=det, backend="triton", **gk)
        for name, x, r in (("dq", dq, q64), ("dk", dk, k64), ("dv", dv, v64)):
            testing.assert_close(x, r.grad, dtype, f"{name} (grad op, deterministic={det})")


@pytest.mark.parametrize("wide", [64, 0], ids=["wide-on", "wide-off"])
@pytest.mark.parametrize("G", [4, 16], ids=["packed", "one-token"])
def test_ids_past_the_sequence_unvalidated_are_masked_in_every_kernel(monkeypatch, G, wide):
    """validate=False with ids past a sequence's blocks (undefined behaviour, but memory-safe): the forward and dQ
    mask their keys by p < S2, and so must dK/dV, which used to add them into the next sequence's (or KV head's)
    keys. Same results as those slots left empty (-1). int64 ids outside int32 used to wrap: ``2**32`` and
    ``-2**32`` into block 0 in packed programs (picked by a pack-mate), and ids past ``2**63 / bs`` into keys at
    wild addresses in one-token programs, because ``id * bs`` wrapped negative. The forward and dQ plans (pack
    tables, wide-or-ordinary flags) are those of the empty slots too, so the same launches run and the results
    are equal bitwise on any CPU (an id past the sequence listed in a wide pack's table used to send its tokens
    to the ordinary programs: another tile shape, another rounding of the interpreter's matmuls)."""
    monkeypatch.setattr(triton_impl, "WIDE_ROWS", wide)
    c = _case([9, 14], [20, 40], N1=2 * G, N2=2, Dqk=32, Dv=16, bs=16, K=2)
    bad = c["topk"].to(torch.int64)
    assert bool((bad[4:6, 0] == 0).any()) and bool((bad[9:12, 1] == 0).any())  # pack-mates that pick block 0
    bad[3, 0, 1] = 2  # sequence 0 has 2 blocks (S2 = 20)
    bad[12, 1, 0] = 5  # sequence 1 has 3 blocks (S2 = 40)
    bad[5, 0, 1] = 2**32
    bad[8, 0, 0] = -2**32
    bad[10, 1, 1] = 2**60 - 2**36  # * bs = 2**64 - 2**40: wraps to -2**40
    bad[11, 0, 0] = -5
    empty = bad.clone()
    for t, n, s in ((3, 0, 1), (12, 1, 0), (5, 0, 1), (8, 0, 0), (10, 1, 1), (11, 0, 0)):
        empty[t, n, s] = -1
    got, plans = {}, {}
    for name, ids in (("bad", bad), ("empty", empty)):
        cc = {**c, "topk": ids}
        plans[name] = _plan(cc) + _plan(cc, dq=True)
        out, m, l = _fwd(triton_impl, cc)
        got[name] = (out, *_bwd(triton_impl, cc, out, m, l), *_bwd(triton_impl, cc, out, m, l, deterministic=True))
    assert len(plans["bad"]) == len(plans["empty"])
    for i, (x, y) in enumerate(zip(plans["bad"], plans["empty"])):
        assert x[0] == y[0] and x[3:] == y[3:], f"launch {i}: programs, tile, warps"
        for j, (a, b) in enumerate(zip(x[1] + (x[2],), y[1] + (y[2],))):
            assert (a is None and b is None) or torch.equal(a, b), f"launch {i}: pack table / run flags {j}"
    for n, x, y in zip(("out", "dq", "dk", "dv", "dq det", "dk det", "dv det"), got["bad"], got["empty"]):
        assert torch.equal(x, y), n
