"""``sparseops fit``: the NSA Triton kernels compiled offline for a GPU architecture (no GPU needed)."""

from __future__ import annotations

import pytest

from sparseops import _checks, cli


def _compiled_triton():
    pytest.importorskip("triton")
    if _checks.triton_interpret():
        pytest.skip("sparseops fit needs compiled Triton")


def test_fit_paper_shape_on_hopper(capsys):
    """``sparseops fit``: every launch of the forward and the three backward variants, compiled for sm_90."""
    _compiled_triton()
    assert cli.main(["fit", "--arch", "90", "--kv-heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiled for sm_90 (H100 / H200, 227 KiB" in out and "G=16, N2=1, Dqk=192, Dv=128, bs=64, K=16" in out
    for variant, kernel in (("forward", "nsa_fwd_kernel"), ("backward", "nsa_bwd_dkv_kernel"),
                            ("deterministic", "nsa_bwd_reduce_kernel"), ("DQ_ATOMIC", "nsa_bwd_delta_kernel")):
        assert any(line.split()[:2] == [variant, kernel] for line in out.splitlines()), (variant, kernel, out)
    # the forward's wide packs (4 tokens x 16 heads) and ordinary programs (one token)
    fwd = [line.split()[2] for line in out.splitlines() if line.split()[:2] == ["forward", "nsa_fwd_kernel"]]
    assert fwd == ["rows=64", "rows=16"], out
    assert "fits: backend='triton'" in out and "without register spills" in out


def test_fit_shape_that_does_not_fit_returns_1(capsys):
    """fp32 (a checking dtype) at G = 32, Dqk = Dv = 256, bs = 128 on consumer Ampere: the dK/dV kernel does not
    fit, the forward does in steps of 32 keys; in bf16 the same shape fits, the dQ kernel taking its 128-key blocks
    in steps of 64. (Two KV heads and K = 16: the constants of tests/nsa/test_triton_fit.py's shortfall test, which
    runs first in the same process, so the backward kernels come from Triton's cache.)"""
    _compiled_triton()
    shape = ["--arch", "86", "-G", "32", "--kv-heads", "2", "--dqk", "256", "--dv", "256", "--block-size", "128"]
    assert cli.main(["fit", *shape, "--dtype", "fp32"]) == 1
    out = capsys.readouterr().out
    fwd = [line.split() for line in out.splitlines() if line.split()[:2] == ["forward", "nsa_fwd_kernel"]]
    assert [x[3] for x in fwd] == ["keys=32"], out
    assert "backward       does not fit: nsa_bwd_dkv_kernel: G=32" in out and "101376 bytes" in out
    assert "does not fit: DQ_ATOMIC, backward, deterministic." in out and "'auto' runs the torch path" in out
    assert cli.main(["fit", *shape]) == 0
    out = capsys.readouterr().out
    dq = [line.split() for line in out.splitlines() if line.split()[:2] == ["backward", "nsa_bwd_dq_kernel"]]
    assert [x[3] for x in dq] == ["keys=64"], out


@pytest.mark.parametrize("args, message", [
    (["--block-size", "63"], "--block-size: selected_block_size: expected 1, 2, 4, 8 or a multiple of 16 in [16, 128], got 63"),
    (["--dv", "256"], "value"),  # Dv > Dqk
    (["--dtype", "fp32", "--block-count", "0"], "selected_block_count"),
    (["--dqk", "-5"], "--dqk: Dqk: expected >= 1, got -5"),  # a negative dim: a usage error, not a traceback
    (["-G", "-1"], "-G: G: expected >= 1, got -1"),
    # past a limit: refused before the example tensors are allocated (they would take terabytes)
    (["--kv-heads", "100000000"], "--kv-heads: N2: expected <= 65535, got 100000000"),
    (["--block-count", "100000000"], "--block-count: selected_block_count: expected <= 128"),
    (["-G", "100000"], "G = N1 / N2 <= 32"),
])
def test_fit_bad_shape_is_a_usage_error(args, message, capsys):
    _compiled_triton()
    assert cli.main(["fit", *args]) == 2
    assert message in capsys.readouterr().err


def test_fit_under_the_interpreter_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["fit"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err
