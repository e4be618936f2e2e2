"""Every NSA Triton kernel compiled for real GPUs, without one (``sparseops._triton.offline_compile``), and the
report of ``sparseops fit`` (``nsa.triton_fit.compile_report``).

The interpreter tests check what the kernels compute; they cannot tell whether a kernel compiles for a GPU, how
much shared memory a program needs there, or whether it spills. Here the launchers run on CPU tensors with
``launch`` swapped for a compile (Triton's bundled ``ptxas``) for ``sm_90`` (H100/H200), ``sm_100`` (B200),
``sm_80`` (A100), ``sm_86`` (consumer Ampere) or ``sm_120`` (consumer Blackwell), with the exact constexprs, warps
and stages of a real launch; the shared memory is checked against that GPU's limit through ``launch``'s own retry
and error. Needs compiled Triton: skipped
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sparseops import _checks

if _checks.triton_interpret():
    pytest.skip("offline compile needs compiled Triton (TRITON_INTERPRET is set)", allow_module_level=True)
pytest.importorskip("triton")

from sparseops import _backend, _triton  # noqa: E402
from sparseops.nsa import api, triton_fit  # noqa: E402
from sparseops.nsa import triton_impl as nsa_triton  # noqa: E402
from sparseops.nsa import triton_plan as nsa_plan  # noqa: E402

FWD = ["nsa_fwd_kernel"]
BWD = ["nsa_bwd_dq_kernel", "nsa_bwd_dkv_kernel"]
DET = ["nsa_bwd_dq_kernel", "nsa_bwd_dkv_kernel", "nsa_bwd_reduce_kernel"]
DQA = ["nsa_bwd_delta_kernel", "nsa_bwd_dkv_kernel"]


def _nsa_inputs(G, Dqk, Dv, bs, K, dtype, N2=2, seqs=(37, 0, 21)):
    """Small inputs of the given head / block shape (the grid size does not change the compiled kernel)."""
    g = torch.Generator().manual_seed(0)
    T = sum(seqs)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s)
    q = torch.randn(T, N2 * G, Dqk, generator=g).to(dtype)
    k = torch.randn(T, N2, Dqk, generator=g).to(dtype)
    v = torch.randn(T, N2, Dv, generator=g).to(dtype)
    topk = torch.zeros(T, N2, K, dtype=torch.int32)
    topk[:, :, K // 2:] = -1
    m = torch.zeros(T, N2 * G)
    l = torch.ones(T, N2 * G)
    return q, k, v, topk, m, l, cu


def _compile_nsa(arch, mode, G, Dqk, Dv, bs, K, dtype):
    """The launches of one forward (``fwd``) or backward (``bwd``, ``det``, ``dqa``) compiled for ``sm_<arch>``."""
    q, k, v, topk, m, l, cu = _nsa_inputs(G, Dqk, Dv, bs, K, dtype)
    with nsa_plan.SETTINGS.override(dq_atomic=mode == "dqa"), _triton.offline_compile(arch) as launches:
        if mode == "fwd":
            nsa_triton.forward(q, k, v, topk, 0.1, bs, cu, cu, True)
        else:
            out = torch.zeros(q.shape[0], q.shape[1], Dv, dtype=dtype)
            nsa_triton.backward(q, k, v, out, out, m, l, topk, 0.1, bs, cu, cu, True, deterministic=mode == "det")
    return launches


def _expected(kernels, arch, G, Dqk, Dv, bs, dtype):
    """``kernels`` with the forward / dQ kernel launched twice (wide packs, then the ordinary programs) where wide
    packs are on for this GPU and shape (``triton_plan._wide_on``)."""
    q, heads = torch.empty(0, G, Dqk, dtype=dtype), nsa_plan._head_blocks(Dqk, Dv)
    with _triton.offline_compile(arch):
        twice = [k for k, dq in (("nsa_fwd_kernel", False), ("nsa_bwd_dq_kernel", True))
                 if nsa_plan._wide_on(q, G, bs, heads, dq)]
    return [n for k in kernels for n in ([k, k] if k in twice else [k])]


# (G, Dqk, Dv, bs, K, dtype): the paper's shape, the packed tiles (G < 16), odd dims and a padded block, the
# documented limits (Dqk = Dv = 256, bs = 128, K = 128, G = 32), the smallest block and dims; fp16 twice
BF, FP = torch.bfloat16, torch.float16
NSA_SHAPES = [
    pytest.param(16, 192, 128, 64, 16, BF, id="paper-G16-bf16"),
    pytest.param(16, 192, 128, 64, 16, FP, id="paper-G16-fp16"),
    pytest.param(1, 192, 128, 64, 16, BF, id="G1-packed16-bf16"),
    pytest.param(3, 100, 72, 48, 5, FP, id="G3-odd-dims-bs48-fp16"),
    pytest.param(8, 128, 128, 128, 16, BF, id="G8-bs128-bf16"),
    pytest.param(32, 256, 256, 128, 128, BF, id="G32-limits-bf16"),
    pytest.param(2, 16, 16, 16, 1, BF, id="G2-smallest-bf16"),
]
MODES = {"fwd": FWD, "bwd": BWD, "det": DET, "dqa": DQA}


@pytest.mark.parametrize("G, Dqk, Dv, bs, K, dtype", NSA_SHAPES)
def test_nsa_kernels_compile_and_fit_on_hopper(G, Dqk, Dv, bs, K, dtype):
    """Half precision, the whole documented envelope: every kernel compiles for sm_90 and fits with the stages it
    asks for (no retry needed on the GPU the settings were chosen for)."""
    dqa_fits = nsa_plan._dq_atomic_fits(bs, nsa_plan._head_blocks(Dqk, Dv))
    for mode, kernels in MODES.items():
        launches = _compile_nsa(90, mode, G, Dqk, Dv, bs, K, dtype)
        expected = _expected(kernels if mode != "dqa" or dqa_fits else BWD, 90, G, Dqk, Dv, bs, dtype)
        assert [x.kernel for x in launches] == expected, mode
        for x in launches:
            assert x.arch == 90 and x.shared <= _triton.SHARED_LIMIT[90], x
            assert x.num_stages is None or x.stages == x.num_stages, x


def test_nsa_paper_shape_does_not_spill_on_hopper():
    """docs/nsa.md: at the paper's shape no kernel spills registers (checked in the cubin)."""
    for G in (16, 1):
        for mode in MODES:
            for x in _compile_nsa(90, mode, G, 192, 128, 64, 16, torch.bfloat16):
                use = x.resources()
                assert use["spill_bytes"] == 0, (G, mode, x, use)
                assert 0 < use["registers"] <= 255, (x, use)


def test_nsa_dkv_rows_per_step_by_gpu_and_no_spill_on_mma_sync_gpus():
    """The dK/dV kernel takes 32 tile rows per step on sm_90 and sm_100 (wgmma, tcgen05), 16 on mma.sync GPUs
    (sm_8x, sm_120), where 32 rows spill at the paper's shape;
    G = 32 there takes half a token's heads per step (two head groups). With 16 rows the A100 compile does not
    spill and sm_120's spills at most 32 bytes (G = 32, 16, 4, 1)."""
    for arch, G, rows, groups in ((90, 4, 32, 1), (100, 4, 32, 1), (80, 4, 16, 1), (86, 4, 16, 1), (120, 4, 16, 1),
                                  (90, 32, 32, 1), (80, 32, 16, 2)):
        [dkv] = [x for x in _compile_nsa(arch, "bwd", G, 192, 128, 64, 16, torch.bfloat16)
                 if x.kernel == "nsa_bwd_dkv_kernel"]
        assert dkv.meta["BLOCK_E"] * dkv.meta["BLOCK_G"] == rows and dkv.meta["HG"] == groups, (arch, G, dkv.meta)
    for arch in (80, 120):
        for G in (32, 16, 4, 1):
            for mode in ("bwd", "det"):
                for x in _compile_nsa(arch, mode, G, 192, 128, 64, 16, torch.bfloat16):
                    assert x.resources()["spill_bytes"] <= (32 if arch == 120 else 0), (arch, G, mode, x)


def test_nsa_paper_shape_on_datacenter_blackwell():
    """sm_100 (B200): every kernel of the paper's shape compiles (tcgen05 for the dK/dV products), fits with the
    stages it asks for and does not spill."""
    for mode, kernels in MODES.items():
        launches = _compile_nsa(100, mode, 16, 192, 128, 64, 16, torch.bfloat16)
        assert [x.kernel for x in launches] == _expected(kernels, 100, 16, 192, 128, 64, BF), mode
        for x in launches:
            assert x.shared <= _triton.SHARED_LIMIT[100] and x.stages == (x.num_stages or x.stages), x
            assert x.resources()["spill_bytes"] == 0, x


def test_nsa_wide_packs_multiply_with_warpgroup_mma():
    """At the paper's shape the wide forward / dQ programs (64 tile rows) compile to wgmma on sm_90 and tcgen05 on
    sm_100, where the ordinary ones (16 rows) are mma.sync. On GPUs with only mma.sync (sm_80, sm_86, sm_120) the
    wide forward compiles without spills (8 bytes on sm_120) and the dQ has no wide launch; fp32 inputs and blocks past
    WIDE_MAX_BLOCK_VALUES launch the ordinary programs alone."""
    for arch, mma in ((90, "wgmma.mma_async"), (100, "tcgen05.mma")):
        for G in (16, 1):
            for mode in ("fwd", "bwd"):
                q_launches = [x for x in _compile_nsa(arch, mode, G, 192, 128, 64, 16, BF)
                              if x.kernel in ("nsa_fwd_kernel", "nsa_bwd_dq_kernel")]
                wide, ordinary = q_launches
                assert wide.meta["PACK"] * wide.meta["BLOCK_G"] == 64 and wide.meta["GATE"], (arch, G, mode)
                assert ordinary.meta["PACK"] * ordinary.meta["BLOCK_G"] == 16 and ordinary.meta["GATE"]
                assert mma in wide.compiled.asm["ptx"] and "mma.sync" not in wide.compiled.asm["ptx"], (arch, G, mode)
                assert "mma.sync" in ordinary.compiled.asm["ptx"], (arch, G, mode)
    for arch in (80, 86, 120):
        for G in (16, 1):
            wide, ordinary = _compile_nsa(arch, "fwd", G, 192, 128, 64, 16, BF)
            assert wide.meta["PACK"] * wide.meta["BLOCK_G"] == 64 and ordinary.meta["GATE"], (arch, G)
            # sm_120 (64K registers per SM, like sm_86, but a different scheduler): 8 bytes at G = 16
            assert wide.resources()["spill_bytes"] <= (8 if arch == 120 else 0), (arch, G, wide.resources())
            dq = [x for x in _compile_nsa(arch, "bwd", G, 192, 128, 64, 16, BF)
                  if x.kernel == "nsa_bwd_dq_kernel"]
            assert [x.meta["GATE"] for x in dq] == [False], (arch, G)
    for arch, G, Dqk, Dv, bs, dtype in ((90, 16, 192, 128, 64, torch.float32), (90, 16, 256, 128, 128, BF)):
        q_launches = [x for x in _compile_nsa(arch, "fwd", G, Dqk, Dv, bs, 16, dtype)]
        assert [x.meta["GATE"] for x in q_launches] == [False], (arch, G, Dqk, Dv, bs, dtype)


def test_nsa_fp32_inputs_compile_at_the_paper_shape():
    """fp32 inputs (exact ``ieee`` dots: no tensor cores, a checking dtype on the GPU) fit at the paper's shape."""
    for mode, kernels in MODES.items():
        launches = _compile_nsa(90, mode, 16, 192, 128, 64, 16, torch.float32)
        assert [x.kernel for x in launches] == kernels, mode
        assert all(x.shared <= _triton.SHARED_LIMIT[90] for x in launches)


def test_nsa_fp32_limits_fit_hopper_with_forward_key_steps():
    """The kernel tests' limits case in fp32 (G = 32, Dqk = Dv = 256, bs = 128, K = 128), which their compiled run
    on an H100 / H200 takes: the forward's whole 128-key block does not fit even unpipelined, so the launcher
    takes it in steps of 64 keys; every kernel of the forward and the backward variants then fits."""
    [fwd] = _compile_nsa(90, "fwd", 32, 256, 256, 128, 128, torch.float32)
    assert fwd.meta["BLOCK_KC"] == 64 and fwd.shared <= _triton.SHARED_LIMIT[90], fwd
    for mode in ("bwd", "det"):
        launches = _compile_nsa(90, mode, 32, 256, 256, 128, 128, torch.float32)
        assert [x.kernel for x in launches] == MODES[mode], mode
        assert all(x.shared <= _triton.SHARED_LIMIT[90] for x in launches), mode


def test_nsa_smaller_gpu_takes_dq_blocks_in_parts_and_names_a_real_shortfall():
    """Consumer Ampere (99 KiB per program) cannot hold the dQ kernel's whole 128-key block at G = 32, Dqk = Dv =
    256 (a token's 32 heads against K/V rows of 128 keys), even unpipelined: the launcher retries it in steps of 64
    keys, and the whole bf16 backward fits; Hopper keeps the whole block. In fp32 the dK/dV kernel does not fit
    there, and the error is the launcher's, with the compiled kernel's real need, the limit and the way out."""
    for mode in ("bwd", "det"):
        [dq] = [x for x in _compile_nsa(86, mode, 32, 256, 256, 128, 16, BF)
                if x.kernel == "nsa_bwd_dq_kernel"]
        assert dq.meta["BLOCK_KC"] == 64 and dq.shared <= _triton.SHARED_LIMIT[86], mode
    [dq] = [x for x in _compile_nsa(90, "bwd", 32, 256, 256, 128, 16, BF) if x.kernel == "nsa_bwd_dq_kernel"]
    assert dq.meta["BLOCK_KC"] == 128
    with pytest.raises(_triton.DoesNotFit) as e:
        _compile_nsa(86, "bwd", 32, 256, 256, 128, 16, torch.float32)
    msg = str(e.value)
    for part in ("nsa_bwd_dkv_kernel", "G=32, selected_block_count=16, selected_block_size=128, Dqk=256, Dv=256",
                 "bytes of shared memory", "sm_86", f"has {_triton.SHARED_LIMIT[86]} bytes", "backend='torch'"):
        assert part in msg, (part, msg)
    need = int(msg.split(" needs ")[1].split(" bytes")[0])
    assert need > _triton.SHARED_LIMIT[86]


def test_nsa_wide_key_blocks_fit_an_a100():
    """bs = 128 with Dqk = Dv = 256: the dK/dV kernel splits each key block over two programs of 64 key rows, so
    it fits an A100's 163 KiB (a whole block does not, even unpipelined) and spills at most 32 bytes on sm_90."""
    for mode in ("bwd", "det"):
        launches = _compile_nsa(80, mode, 32, 256, 256, 128, 16, torch.bfloat16)
        [dkv] = [x for x in launches if x.kernel == "nsa_bwd_dkv_kernel"]
        assert dkv.grid[1] == 2 and dkv.shared <= _triton.SHARED_LIMIT[80] and dkv.stages == dkv.num_stages
    [dkv] = [x for x in _compile_nsa(90, "bwd", 16, 256, 256, 128, 16, torch.bfloat16)
             if x.kernel == "nsa_bwd_dkv_kernel"]
    assert dkv.resources()["spill_bytes"] <= 32


def test_nsa_fewer_stages_where_two_do_not_fit():
    """On consumer Ampere the forward at Dqk = Dv = 256, bs = 128 does not fit with two stages: the launcher
    retries it with one, which fits."""
    [x] = _compile_nsa(86, "fwd", 16, 256, 256, 128, 16, torch.bfloat16)
    assert (x.kernel, x.num_stages, x.stages) == ("nsa_fwd_kernel", 2, 1) and x.shared <= _triton.SHARED_LIMIT[86]


def _grad_args(dtype, G, Dqk, Dv, bs, K=2, N2=1):
    q, k, v, topk, m, l, cu = _nsa_inputs(G, Dqk, Dv, bs, K, dtype, N2=N2, seqs=(40, 25))
    topk[:, :, 1:] = -1
    g = torch.Generator().manual_seed(1)
    out = torch.randn(q.shape[0], q.shape[1], Dv, generator=g).to(dtype)
    dout = torch.randn(q.shape[0], q.shape[1], Dv, generator=g).to(dtype)
    stats = [torch.full((q.shape[0], q.shape[1], 8), x) for x in (0.5, 3.0)]
    kw = dict(scale_value=1 / math.sqrt(Dqk), selected_block_size=bs, selected_block_count=K, head_num=q.shape[1],
              actual_seq_qlen=cu[1:], actual_seq_kvlen=cu[1:], sparse_mode=2)
    return (q, k, v, out, dout, *stats, topk), kw


@pytest.mark.parametrize("dtype, G, Dqk, Dv, bs, K, N2, dq_atomic, launched", [
    # the dQ kernel runs (in steps of fewer keys), then the dK/dV kernel does not fit (K and N2, which the kernels
    # take as constants, those of the shortfall above: the same compiled dQ kernel)
    (torch.float32, 32, 256, 256, 128, 16, 2, False, ["nsa_bwd_dq_kernel"]),
    # with DQ_ATOMIC: the D kernel runs, then the dK/dV kernel does not fit
    (torch.float32, 16, 192, 128, 64, 2, 1, True, ["nsa_bwd_delta_kernel"]),
], ids=["fp32-dkv-does-not-fit-after-dq", "fp32-dkv-does-not-fit-after-delta"])
def test_auto_runs_torch_where_a_kernel_does_not_fit(monkeypatch, dtype, G, Dqk, Dv, bs, K, N2, dq_atomic, launched):
    """``backend="auto"`` on a GPU that cannot hold a backward kernel: the torch path's exact result and a
    ``RuntimeWarning``; an explicit ``backend="triton"`` raises. (The device is an offline sm_86 and ``auto`` is
    made to choose Triton for CPU tensors: what it would choose for CUDA ones.)"""
    args, kw = _grad_args(dtype, G, Dqk, Dv, bs, K, N2)
    want = api.nsa_selected_attention_grad(*args, **kw, backend="torch")
    before = [a.clone() for a in args]
    real = _checks.resolve_backend
    # auto and an explicit "triton" choose Triton for CPU tensors (not by pretending TRITON_INTERPRET is set:
    # the launchers would then pick the interpreter's settings)
    monkeypatch.setattr(_checks, "resolve_backend", lambda b, d: "triton" if b in ("auto", "triton") else real(b, d))
    monkeypatch.setattr(_checks, "triton_available", lambda: True)
    monkeypatch.setattr(_backend, "_DOES_NOT_FIT", set())
    monkeypatch.setattr(_triton, "_NO_FIT", {})
    with nsa_plan.SETTINGS.override(dq_atomic=dq_atomic), _triton.offline_compile(86) as launches:
        with pytest.warns(RuntimeWarning, match="nsa_bwd_d.*backend='auto' runs this shape on the torch path"):
            got = api.nsa_selected_attention_grad(*args, **kw, backend="auto")
        assert [x.kernel for x in launches] == launched
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = api.nsa_selected_attention_grad(*args, **kw, backend="auto")
        assert [x.kernel for x in launches] == launched  # remembered: straight to torch, nothing launched again
        with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
            api.nsa_selected_attention_grad(*args, **kw, backend="triton")
    assert [x.kernel for x in launches] == launched * 2
    for a, b in zip(again, want):
        assert torch.equal(a, b)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(args, before):
        assert torch.equal(a, b)  # the caller's tensors are untouched


def test_auto_keeps_triton_where_the_kernel_fits(monkeypatch):
    """No warning and no torch fallback when the kernels fit (they are compiled, not run, so only the launches
    are checked)."""
    args, kw = _grad_args(torch.bfloat16, 16, 192, 128, 64)
    monkeypatch.setattr(_checks, "resolve_backend", lambda b, d: "triton")
    monkeypatch.setattr(_checks, "triton_available", lambda: True)
    with _triton.offline_compile(90) as launches, warnings.catch_warnings():
        warnings.simplefilter("error")
        api.nsa_selected_attention_grad(*args, **kw, backend="auto", deterministic=True)
    assert [x.kernel for x in launches] == _expected(DET, 90, 16, 192, 128, 64, torch.bfloat16)


def test_compile_report_rows_for_every_variant():
    """``sparseops fit``'s report at the paper's shape on sm_90: the forward, the three backward variants, one row
    per launch with its tile and resources, no spills."""
    rows = triton_fit.compile_report(90, G=16, N2=1, Dqk=192, Dv=128, bs=64, K=16)
    assert [r["variant"] for r in rows if r["kernel"] == "nsa_fwd_kernel"] == ["forward", "forward"]  # wide, ordinary
    assert {r["variant"] for r in rows} == {"forward", "backward", "deterministic", "DQ_ATOMIC"}
    assert [r["kernel"] for r in rows if r["variant"] == "DQ_ATOMIC"] == DQA
    for r in rows:
        assert set(r) == {"variant", "kernel", "rows", "keys", "warps", "stages", "shared", "registers",
                          "spill_bytes"}, r
        assert r["shared"] <= _triton.SHARED_LIMIT[90] and r["spill_bytes"] == 0, r
    assert nsa_plan.SETTINGS.get().dq_atomic is False  # the variant's override is undone


@pytest.mark.parametrize("kw, err, match", [
    (dict(G=0), ValueError, "G"),
    (dict(bs=0), ValueError, "selected_block_size"),
    (dict(dtype=torch.float64), TypeError, "float64"),
], ids=["G0", "bs0", "float64"])
def test_compile_report_checks_the_shape_first(kw, err, match):
    with pytest.raises(err, match=match):
        triton_fit.compile_report(90, **{"G": 16, "Dqk": 192, "Dv": 128, "bs": 64, "K": 16, **kw})
