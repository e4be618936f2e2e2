"""``sparseops check``: passes on the real ops, fails on a broken one, reports exceptions, picks backends."""

from __future__ import annotations

import math

import pytest
import torch

import sparseops
from sparseops import _checks, cli, testing
from sparseops.cli import _check_common, check


def test_check_tiny_passes(capsys):
    rc = cli.main(["check", "--tiny", "--backend", "torch", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out
    for name in sparseops.__all__:
        if name.startswith(("moe_", "nsa_")):
            assert name in out
    for case in ("ep-partial", "ep-empty", "capacity", "varlen-causal-gqa", "noncausal-dup"):
        assert case in out
    for dt in ("fp32", "fp16", "bf16"):
        assert f"  {dt}  " in out


def _perturbing(fn, index: int | None):
    """Wrap a public op so the torch backend returns a wrong result (output ``index``, or the only output)."""

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if kwargs.get("backend") != "torch":
            return out
        if index is None:
            return out * 1.01
        out = list(out)
        out[index] = out[index] * 1.01
        return tuple(out)

    return wrapper


@pytest.mark.parametrize(
    "name, index, family",
    [
        pytest.param("moe_token_unpermute_with_ep_grad", 1, "moe"),  # probs_grad off by 1 %
        pytest.param("nsa_selected_attention_grad", 2, "nsa"),  # dv off by 1 %
    ],
)
def test_check_fails_when_an_op_is_wrong(monkeypatch, capsys, name, index, family):
    monkeypatch.setattr(sparseops, name, _perturbing(getattr(sparseops, name), index))
    rc = cli.main(["check", "--tiny", "--backend", "torch", "--op", family, "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert rc == 1
    failing = [line for line in out.splitlines() if line.startswith(name + " ") and line.rstrip().endswith("FAIL")]
    assert failing, out
    # the other ops of the family still pass: the failure is attributed to the broken op only
    others = [line for line in out.splitlines() if line.rstrip().endswith("FAIL") and not line.startswith(name + " ")]
    assert not others, others


def test_check_reports_exceptions_and_returns_1(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(sparseops, "moe_token_permute_with_ep", boom)
    rc = cli.main(["check", "--tiny", "--backend", "torch", "--op", "moe", "--dtype", "fp16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "RuntimeError: kernel exploded" in out
    assert "FAIL" in out


def test_compare_can_fail():
    """The comparison itself: wrong values, NaN, a missing output, a wrong shape, an exact mismatch all fail."""
    e = torch.randn(5, 3, dtype=torch.float64)
    tol = testing.TOLERANCES[torch.float32]
    good = [("x", e.float(), e, tol, None)]
    assert _check_common.compare(good)[3]
    assert not _check_common.compare([("x", (e * 1.001).float(), e, tol, None)])[3]
    nan = e.float().clone()
    nan[2, 1] = math.nan
    assert not _check_common.compare([("x", nan, e, tol, None)])[3]
    assert not _check_common.compare([("x", None, e, tol, None)])[3]
    assert not _check_common.compare([("x", e.float()[:4], e, tol, None)])[3]
    assert _check_common.compare([("x", None, None, tol, None)])[3]
    idx = torch.arange(6)
    assert _check_common.compare([("i", idx.int(), idx, _check_common.EXACT, None)])[3]
    assert not _check_common.compare([("i", idx.flip(0), idx, _check_common.EXACT, None)])[3]
    # a mask hides elements that are implementation-defined (stats of fully masked rows)
    masked = e.float().clone()
    masked[0] = 123.0
    keep = torch.ones_like(e, dtype=torch.bool)
    keep[0] = False
    assert _check_common.compare([("x", masked, e, tol, keep)])[3]
    assert not _check_common.compare([("x", masked, e, tol, None)])[3]


def test_backend_selection(monkeypatch):
    monkeypatch.setattr(_checks, "triton_available", lambda: True)
    monkeypatch.setattr(_checks, "triton_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.available_backends("all")[0] == ["torch"]
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        check.available_backends("triton")
    monkeypatch.setattr(_checks, "triton_interpret", lambda: True)
    assert check.available_backends("all")[0] == ["torch", "triton"]
    assert check.available_backends("torch")[0] == ["torch"]
    monkeypatch.setattr(_checks, "triton_available", lambda: False)
    with pytest.raises(SystemExit, match="does not import"):
        check.available_backends("triton")


def test_check_triton_unavailable_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(_checks, "triton_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--backend", "triton"]) == 2
    assert "--backend triton is not available" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_device_cuda_without_cuda_is_a_clear_error(capsys):
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1], ids=["past-uint64", "below-int64"])
def test_check_seed_torch_refuses_is_a_usage_error(seed, capsys):
    """Refused before the first row (torch.Generator would fail every row with an overflow, exit 1)."""
    assert cli.main(["check", "--tiny", "--op", "moe", "--seed", str(seed)]) == 2
    captured = capsys.readouterr()
    assert "--seed: expected an int in" in captured.err and str(seed) in captured.err
    assert "checks, backends" not in captured.out



def test_check_says_what_runs_before_the_first_row(capsys):
    """Progress from the first second: the first check is named on stderr when it starts, before its row."""
    assert cli.main(["check", "--tiny", "--backend", "torch", "--op", "moe", "--dtype", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "importing torch" in err
    assert "[1/" in err and "moe_token_permute_with_ep torch fp32 full ..." in err
