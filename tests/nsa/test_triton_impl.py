"""NSA Triton kernels against the float64 reference: forward, every gradient, both dK/dV paths, the launch
retries, unvalidated ids.

Runs where CUDA is available, or on the CPU under the Triton interpreter, in its own process:
``TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee python -m pytest tests/nsa/test_triton_impl.py``.
Shapes are tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import pytest
import torch

from sparseops import _checks  # reads TRITON_INTERPRET as Triton does; imports no triton

if not _checks.triton_interpret() and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from sparseops import testing  # noqa: E402
from sparseops.nsa import reference, triton_impl, triton_plan  # noqa: E402

from . import triton_cases  # noqa: E402
from .triton_cases import (  # noqa: E402
    CASES,
    DEVICE,
    PACK_CASES,
    S,
)
from .triton_cases import bwd as _bwd  # noqa: E402
from .triton_cases import case as _case  # noqa: E402
from .triton_cases import check as _check  # noqa: E402
from .triton_cases import fwd as _fwd  # noqa: E402
from .triton_cases import plan as _plan  # noqa: E402

pytestmark = pytest.mark.triton
#: the shared fixtures: ``override(SETTINGS, **knobs)``, and wide packs for fp32 inputs in every test
override = triton_cases.override
wide_packs_in_fp32 = triton_cases.wide_packs_in_fp32



@pytest.mark.parametrize("kw", triton_cases.params(CASES, heavy={"limits"}))
def test_fp32_against_reference(kw):
    _check(_case(**kw), torch.float32)


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


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=triton_cases.HEAVY), 3, 256])
def test_deterministic_is_bitwise_stable_and_chunked(override, chunk):
    """Small chunks split one key block's query list over several programs (workspace + ordered reduction)."""
    override(S, chunk=chunk)
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


@pytest.mark.parametrize("kw, chunk", [
    pytest.param(kw, chunk, id=f"{name}-{chunk}", marks=[triton_cases.HEAVY] * (chunk == 2 and name != "G16-split"))
    for chunk in (2, 256) for name, kw in DQ_ATOMIC_CASES])
def test_dq_atomic_variant(override, monkeypatch, kw, chunk):
    """DQ_ATOMIC: dQ from the dK/dV kernel with atomics (the query-major dQ kernel does not run, D comes from its own
    kernel); the deterministic path ignores the switch."""
    override(S, dq_atomic=True)
    override(S, chunk=chunk)
    calls = []
    real = triton_plan.build_pack_table
    monkeypatch.setattr(triton_plan, "build_pack_table", lambda *a: calls.append(1) or real(*a))
    c = _case(**kw)
    out, m, l = _check(c, torch.float32)
    calls.clear()
    _bwd(triton_impl, c, out, m, l)
    assert calls == []  # with G < 16 the query-major dQ kernel would have built a pack table
    det = _bwd(triton_impl, c, out, m, l, deterministic=True)
    override(S, dq_atomic=False)
    for x, y in zip(_bwd(triton_impl, c, out, m, l, deterministic=True), det):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dq_atomic_half_inputs(override, dtype):
    """The fp32 dQ buffer is cast once to the input dtype."""
    override(S, dq_atomic=True)
    c = _case([6, 19], N1=4, N2=2, Dqk=32, Dv=16, bs=16, K=2, dtype=dtype, empty_frac=0.2, duplicates=True)
    _check(c, dtype, deterministic_too=False)


def test_dq_atomic_fully_masked_rows_and_no_keys(override):
    """Rows with no visible key get dq = 0 on the atomic path too; no key blocks at all gives zeros."""
    override(S, dq_atomic=True)
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
def test_dkv_rows_of_mma_sync_gpus(override, monkeypatch, N1):
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
        override(S, dq_atomic=True)
        for name, g, r in zip(("dq", "dk", "dv"), _bwd(triton_impl, c, out, m, l), ref):
            testing.assert_close(g, r, torch.float32, f"{name} (DQ_ATOMIC)")


@pytest.mark.parametrize("key_rows", [pytest.param(16, marks=triton_cases.HEAVY), 32, 48])
def test_dkv_key_block_split_over_programs(override, monkeypatch, key_rows):
    """A key block wider than ``DKV_KEY_ROWS`` is split over programs (grid axis 1): bs = 48 (padded to 64) in
    4 or 2 parts, the last part of each block all padding; partial last blocks (S2 = 70, 100); both dK/dV paths,
    DQ_ATOMIC, and chunks of 3 entries (several programs per part). 48 is not a power of two: it is taken as
    32 (64 // 48 programs of 48 rows each would have skipped 16 key rows)."""
    override(S, dkv_key_rows=key_rows)
    override(S, chunk=3)
    grids = []
    real = triton_impl._triton.launch
    monkeypatch.setattr(triton_impl._triton, "launch",
                        lambda kern, grid, *a, **kw: grids.append((kern.__name__, grid)) or real(kern, grid, *a, **kw))
    c = _case([6, 9], [70, 100], N1=4, N2=2, Dqk=48, Dv=24, bs=48, K=3, duplicates=True, empty_frac=0.2)
    out, m, l = _check(c, torch.float32)
    assert {g[1] for n, g in grids if n == "nsa_bwd_dkv_kernel"} == {64 // {48: 32}.get(key_rows, key_rows)}
    ref = _bwd(reference, c, *_fwd(reference, c, upcast=True), upcast=True)
    override(S, dq_atomic=True)
    for name, g, r in zip(("dq", "dk", "dv"), _bwd(triton_impl, c, out, m, l), ref):
        testing.assert_close(g, r, torch.float32, f"{name} (DQ_ATOMIC)")


def _kernels(name):
    """The module of the kernel ``name``: the backward's in ``triton_kernels_bwd``, the forward's in ``triton_kernels``."""
    from sparseops.nsa import triton_kernels, triton_kernels_bwd

    return triton_kernels_bwd if name.startswith("nsa_bwd") else triton_kernels


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
    dkv = _ShortOfSharedMemory(_kernels("nsa_bwd_dkv_kernel").nsa_bwd_dkv_kernel, fits=0)
    monkeypatch.setattr(_kernels("nsa_bwd_dkv_kernel"), "nsa_bwd_dkv_kernel", dkv)
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
    real_plan, real_empty, real_empty_like = triton_plan._q_plan, torch.empty, torch.empty_like
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
        monkeypatch.setattr(_kernels(name), name, WideDoesNotFit(getattr(_kernels(name), name)))
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
@pytest.mark.parametrize("knob", ["fwd_key_rows", "dq_key_rows"], ids=["forward", "dq"])
def test_key_steps_smaller_than_the_block(override, knob, kw, wide):
    """FWD_KEY_ROWS / DQ_KEY_ROWS = 16: the forward / dQ kernel takes each (padded) block in steps of 16 keys
    (bs = 48: 4 steps, 32: 2) in one-token, packed and wide programs, against the reference."""
    override(S, **{knob: 16})
    override(S, wide_rows=wide)
    c = _case(**{"Dqk": 32, "Dv": 16, **kw})
    _check(c, torch.float32, deterministic_too=False)


@pytest.mark.parametrize("kernel", ["nsa_fwd_kernel", "nsa_bwd_dq_kernel"])
def test_launch_short_of_shared_memory_takes_fewer_keys_per_step(override, monkeypatch, kernel):
    """A forward / dQ launch that does not fit even unpipelined is retried with half the key rows per step, down
    to what fits; the result is the reference's."""
    from triton.runtime.errors import OutOfResources

    from sparseops import _triton

    monkeypatch.setattr(_triton, "_STAGES", {})
    monkeypatch.setattr(_triton, "_NO_FIT", {})
    calls = []
    real = getattr(_kernels(kernel), kernel)

    class FitsSixteenKeys:
        __name__ = real.__name__

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(kw["BLOCK_KC"])
                if kw["BLOCK_KC"] > 16:
                    raise OutOfResources(300_000, 101_376, "shared memory")
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(_kernels(kernel), kernel, FitsSixteenKeys())
    override(S, wide_rows=0)  # one launch, so the calls below are its tries
    c = _case([5, 20], N1=4, N2=2, Dqk=32, Dv=16, bs=48, K=2, duplicates=True)
    _check(c, torch.float32, deterministic_too=False)
    assert calls == [64, 64, 32, 32, 16]  # two stages then one at 64 and 32 keys, 16 fits


def test_every_output_element_is_written(override, monkeypatch):
    """Fresh buffers (outputs, stats, D, workspace) come back NaN-poisoned: a missed store shows up as an error."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*a, **kw):
        return testing.poison_(real_empty(*a, **kw))

    def empty_like(*a, **kw):
        return testing.poison_(real_empty_like(*a, **kw))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    override(S, chunk=2)
    # bs = 48 (padded tile), S2 not a multiple of bs, an empty query sequence, a sequence without keys,
    # G = 3 (padded rows)
    c = _case([4, 0, 9, 3], [50, 10, 60, 0], N1=6, N2=2, Dqk=48, Dv=24, bs=48, K=2, empty_frac=0.2, duplicates=True)
    _check(c, torch.float32)


def test_float64_is_rejected():
    c = _case([3], N1=2, N2=1, Dqk=16, Dv=16, bs=16, K=1, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        _fwd(triton_impl, c)


def _public_ops():
    from sparseops.nsa import api

    return api.nsa_selected_attention, api.nsa_selected_attention_grad


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


@pytest.mark.parametrize("G, wide", [
    pytest.param(G, wide, id=f"{gid}-{wid}", marks=[triton_cases.HEAVY] * (G == 16 and wide == 0))
    for wide, wid in ((64, "wide-on"), (0, "wide-off")) for G, gid in ((4, "packed"), (16, "one-token"))])
def test_ids_past_the_sequence_unvalidated_are_masked_in_every_kernel(override, G, wide):
    """validate=False with ids past a sequence's blocks (undefined behaviour, but memory-safe) act as empty slots
    (-1) in every kernel: the forward and dQ mask their keys by p < S2, and dK/dV must not add them into the next
    sequence's (or KV head's) keys. int64 ids outside int32 must not wrap: ``2**32`` and ``-2**32`` not into block
    0 in packed programs (picked by a pack-mate), ids past ``2**63 / bs`` not into keys at wild addresses in
    one-token programs (``id * bs`` wraps negative). The forward and dQ plans (pack tables, wide-or-ordinary
    flags) are those of the empty slots too, so the same launches run and the results are equal bitwise on any
    CPU: an id past the sequence listed in a wide pack's table would send its tokens to the ordinary programs,
    another tile shape, another rounding of the interpreter's matmuls on some CPUs."""
    override(S, wide_rows=wide)
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
