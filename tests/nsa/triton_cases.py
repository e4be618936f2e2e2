"""Shared builders of the NSA Triton tests (``test_triton_impl.py``, ``test_triton_plan.py``): inputs, calls of a
backend, the check against the float64 reference, the forward's launch plan, and the settings fixtures."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sparseops import _checks, testing
from sparseops._varlen import normalize_cu_seqlens
from sparseops.nsa import reference, triton_impl, triton_plan

DEVICE = "cpu" if _checks.triton_interpret() else "cuda"
#: a case whose code path a lighter case also takes, at a size that costs the interpreter seconds: deselected in
#: the newest Triton's interpreter run (``make test-interpret-latest``, README.md)
HEAVY = pytest.mark.heavy_interpret


def params(cases, heavy=()):
    """``(id, kwargs)`` cases as ``pytest.param``s, those named in ``heavy`` marked :data:`HEAVY`."""
    return [pytest.param(kw, id=name, marks=[HEAVY] if name in heavy else []) for name, kw in cases]
#: the NSA Triton backend's tuning knobs
S = triton_plan.SETTINGS


@pytest.fixture
def override():
    """``override(SETTINGS, **knobs)``: change a backend's tuning knobs for the rest of the test (the settings
    object's own context manager, left when the test ends)."""
    with contextlib.ExitStack() as stack:
        yield lambda settings, **knobs: stack.enter_context(settings.override(**knobs))


@pytest.fixture(autouse=True)
def wide_packs_in_fp32():
    """fp32 inputs take wide packs here on a GPU too, as they always do under the interpreter."""
    with S.override(wide_fp32=True):
        yield


def case(seqs_q, seqs_kv=None, *, dtype=torch.float32, topk=None, seed=0, **kw):
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


def fwd(impl, c, upcast=False):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    return impl.forward(cast(c["q"]), cast(c["k"]), cast(c["v"]), c["topk"], c["scale"], c["bs"], c["cu_q"],
                        c["cu_kv"], c["causal"])


def bwd(impl, c, out, m, l, upcast=False, **kw):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    return impl.backward(cast(c["q"]), cast(c["k"]), cast(c["v"]), cast(out), cast(c["dout"]), m, l, c["topk"],
                         c["scale"], c["bs"], c["cu_q"], c["cu_kv"], c["causal"], **kw)


def check(c, dtype, deterministic_too=True):
    """Forward, stats and all three gradients (both dK/dV paths) against the float64 reference."""
    out, m, l = fwd(triton_impl, c)
    r_out, r_m, r_l = fwd(reference, c, upcast=True)
    assert out.dtype == dtype and m.dtype == torch.float32 and l.dtype == torch.float32
    testing.assert_close(out, r_out, dtype, "out")
    testing.assert_close(m, r_m, torch.float32, "softmax_max")
    testing.assert_close(l, r_l, torch.float32, "softmax_sum")
    ref = bwd(reference, c, r_out, r_m, r_l, upcast=True)
    paths = (False, True) if deterministic_too else (False,)
    for det in paths:
        grads = bwd(triton_impl, c, out, m, l, deterministic=det)
        for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, (c["q"], c["k"], c["v"])):
            assert g.dtype == t.dtype and g.shape == t.shape, name
            testing.assert_close(g, r, dtype, f"{name} (deterministic={det})")
    return out, m, l


def sparse_topk(K, tokens, N2=1):
    """[T1, N2, K] int32 block ids, -1 except ``{slot: id}`` per token (the same on every KV head)."""
    t = torch.full((len(tokens), N2, K), -1, dtype=torch.int32)
    for i, slots in enumerate(tokens):
        for j, b in slots.items():
            t[i, :, j] = b
    return t


def share_first_packs(c, P):
    """``c`` with every token of the first P-token pack of each sequence given the selection of that pack's last
    token (so the pack shares all its blocks); the other tokens keep their own draws."""
    t = c["topk"].clone()
    for a, b in zip(c["cu_q"][:-1], c["cu_q"][1:]):
        last = min(b, a + P) - 1
        if b > a:
            t[a:last + 1] = t[last]
    return {**c, "topk": t}


def blocks(c):
    """Key blocks of each query token's sequence."""
    s2 = triton_plan._token_meta(c["cu_q"], c["cu_kv"], c["q"].device)[3]
    return triton_plan._key_blocks(s2, c["bs"])


def plan(c, dq=False):
    q, topk = c["q"], c["topk"]
    G, K = q.shape[1] // topk.shape[1], topk.shape[2]
    _, pos = triton_plan.token_seq_positions(c["cu_q"], device=q.device)
    heads = triton_plan._head_blocks(q.shape[2], c["v"].shape[2])
    return triton_plan._q_plan(q, topk, c["cu_q"], blocks(c), G, K, c["bs"], heads, pos.to(torch.int32), dq=dq)


# (id, N1, N2, K, ordinary programs): G = 16, 32, 12 (one token per ordinary program; 12 pads its heads to 16),
# 2 and 3 (packs of 8 and 4)


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
                    causal=False, topk=sparse_topk(128, [{0: 0, 127: 2}, {5: 1, 64: 1}, {126: 2, 3: 0},
                                                          {0: 1, 127: 0}, {50: 0, 51: 0, 52: 1}]))),
]


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
