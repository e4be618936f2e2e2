"""The ``sparseops`` command: info, check (passes on the real ops, fails on a broken one), bench, --help."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparseops
from sparseops import cli, testing

REPO = Path(__file__).resolve().parents[1]


def _merged(family: str) -> bool:
    """The public ops start as placeholders (``_todo``) until the op branches land on main."""
    return all(getattr(sparseops, n).__name__ != "_todo" for n in sparseops.__all__ if n.startswith(family + "_"))


MERGED = [f for f in ("moe", "nsa") if _merged(f)]


def _needs(family: str):
    return pytest.mark.skipif(not _merged(family), reason=f"public {family} ops are still placeholders (not merged yet)")


def _run_module(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "sparseops", *args], capture_output=True, text=True, env=e, timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# info, --version, --help
# ---------------------------------------------------------------------------------------------------------------


def test_info_prints_versions_and_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"sparseops     {sparseops.__version__}" in out
    assert torch.__version__ in out
    assert "triton" in out and "python" in out
    assert "cpu tensors -> torch" in out  # auto never picks triton for CPU tensors
    assert "deterministic" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"sparseops {sparseops.__version__}"


@pytest.mark.parametrize("sub", [[], ["info"], ["check"], ["bench"], ["fit"]], ids=["top", "info", "check", "bench", "fit"])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main([*sub, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sparseops")
    if sub == ["check"]:
        assert "--backend" in out and "--dtype" in out and "--seed" in out and "--tiny" in out
    if sub == ["bench"]:
        assert "--quick" in out and "--smoke" in out and "--out" in out and "--op" in out
    if sub == ["fit"]:
        assert "--arch" in out and "--block-size" in out and "--dtype" in out


def test_no_subcommand_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    assert "usage: sparseops" in capsys.readouterr().out


def test_bad_choice_is_a_usage_error():
    with pytest.raises(SystemExit) as ei:
        cli.main(["check", "--backend", "cuda-magic"])
    assert ei.value.code == 2


def test_python_dash_m_is_the_same_command():
    # one subprocess covers __main__.py: --version and info through `python -m sparseops`
    r = _run_module("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"sparseops {sparseops.__version__}"


# ---------------------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not MERGED, reason="public MoE/NSA ops are still placeholders (not merged yet)")
def test_check_tiny_passes(capsys):
    op = "all" if len(MERGED) == 2 else MERGED[0]
    rc = cli.main(["check", "--tiny", "--backend", "torch", "--seed", "3", "--op", op])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out
    for name in sparseops.__all__:
        if name.startswith(tuple(f + "_" for f in MERGED)):
            assert name in out
    cases = {"moe": ("ep-partial", "ep-empty", "capacity"), "nsa": ("varlen-causal-gqa", "noncausal-dup")}
    for case in (c for f in MERGED for c in cases[f]):
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
        pytest.param("moe_token_unpermute_with_ep_grad", 1, "moe", marks=_needs("moe")),  # probs_grad off by 1 %
        pytest.param("nsa_selected_attention_grad", 2, "nsa", marks=_needs("nsa")),  # dv off by 1 %
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
    assert cli._compare(good)[3]
    assert not cli._compare([("x", (e * 1.001).float(), e, tol, None)])[3]
    nan = e.float().clone()
    nan[2, 1] = math.nan
    assert not cli._compare([("x", nan, e, tol, None)])[3]
    assert not cli._compare([("x", None, e, tol, None)])[3]
    assert not cli._compare([("x", e.float()[:4], e, tol, None)])[3]
    assert cli._compare([("x", None, None, tol, None)])[3]
    idx = torch.arange(6)
    assert cli._compare([("i", idx.int(), idx, cli.EXACT, None)])[3]
    assert not cli._compare([("i", idx.flip(0), idx, cli.EXACT, None)])[3]
    # a mask hides elements that are implementation-defined (stats of fully masked rows)
    masked = e.float().clone()
    masked[0] = 123.0
    keep = torch.ones_like(e, dtype=torch.bool)
    keep[0] = False
    assert cli._compare([("x", masked, e, tol, keep)])[3]
    assert not cli._compare([("x", masked, e, tol, None)])[3]


def test_backend_selection(monkeypatch):
    monkeypatch.setattr(cli._checks, "triton_available", lambda: True)
    monkeypatch.setattr(cli._checks, "triton_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.available_backends("all")[0] == ["torch"]
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        cli.available_backends("triton")
    monkeypatch.setattr(cli._checks, "triton_interpret", lambda: True)
    assert cli.available_backends("all")[0] == ["torch", "triton"]
    assert cli.available_backends("torch")[0] == ["torch"]
    monkeypatch.setattr(cli._checks, "triton_available", lambda: False)
    with pytest.raises(SystemExit, match="does not import"):
        cli.available_backends("triton")


def test_check_triton_unavailable_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(cli._checks, "triton_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--backend", "triton"]) == 2
    assert "--backend triton is not available" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_device_cuda_without_cuda_is_a_clear_error(capsys):
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------


def test_bench_missing_scripts_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: None)
    assert cli.main(["bench", "--op", "moe", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/moe.py not found" in err and "source checkout" in err


def test_bench_summary_prints_table_and_files():
    lines = cli.summarize_bench(
        "moe",
        {
            "rows": [{"shape": "T=8", "torch_ms": 1.5, "triton_ms": 0.5}, {"shape": "T=64", "torch_ms": 2.25}],
            "gate": [{"what": "fp32 out", "err": 1e-7, "tol": 1e-5}, {"what": "bf16 out", "err": 2e-3, "tol": 1e-2}],
            "json": "/tmp/x/moe.json",
            "png": "/tmp/x/moe.png",
        },
    )
    text = "\n".join(lines)
    assert "torch_ms" in text and "triton_ms" in text and "T=64" in text
    assert "2/2 within tolerance" in text
    assert "/tmp/x/moe.json" in text and "/tmp/x/moe.png" in text


FAKE_BENCH = """
import json
from pathlib import Path

def run(quick=False, smoke=False, out=None):
    if {fail}:
        raise RuntimeError("correctness gate failed")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rec = {{"rows": [{{"H": 8, "ours ms": 0.1, "peer ms": 0.3}}], "mode": "smoke" if smoke else "full"}}
    (out / "moe.json").write_text(json.dumps(rec))
    (out / "moe.png").write_bytes(b"png")
    return rec

def markdown_table(rec):
    lines = ["H | ours ms | peer ms | mode"]
    for r in rec["rows"]:
        lines.append(f"{{r['H']}} | {{r['ours ms']}} | {{r['peer ms']}} | {{rec['mode']}}")
    return "\\n".join(lines)
"""


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "gate-fails"])
def test_bench_runs_a_benchmark_script(tmp_path, monkeypatch, capsys, fail):
    """The loading, --smoke/--out passthrough, table and file report, on a stand-in script."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "moe.py").write_text(FAKE_BENCH.format(fail=fail))
    monkeypatch.setenv("SPARSEOPS_BENCHMARKS", str(bench))
    out = tmp_path / "out"
    rc = cli.main(["bench", "--op", "moe", "--smoke", "--out", str(out)])
    text = capsys.readouterr().out
    if fail:
        assert rc == 1
        assert "RuntimeError: correctness gate failed" in text
        return
    assert rc == 0, text
    assert "8 | 0.1 | 0.3 | smoke" in text  # the script's own table, run with smoke=True
    assert str(out / "moe.json") in text and str(out / "moe.png") in text


def test_bench_smoke_without_out_leaves_the_recorded_results_alone(tmp_path, monkeypatch, capsys):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "moe.py").write_text(FAKE_BENCH.format(fail=False))
    monkeypatch.setenv("SPARSEOPS_BENCHMARKS", str(bench))
    assert cli.main(["bench", "--op", "moe", "--smoke"]) == 0
    text = capsys.readouterr().out
    assert not (bench / "results").exists(), "a smoke run wrote into the recorded results"
    assert "sparseops-bench-smoke-moe-" in text and "moe.json" in text


@pytest.mark.skipif(
    not (REPO / "benchmarks" / "moe.py").is_file(),
    reason="benchmarks/moe.py not in this checkout yet (branch `bench` not merged)",
)
@_needs("moe")
def test_bench_moe_smoke(tmp_path, capsys):
    rc = cli.main(["bench", "--op", "moe", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "benchmarks/moe.py" in out
    assert any(tmp_path.iterdir()), "the benchmark wrote nothing into --out"


def _compiled_triton():
    pytest.importorskip("triton")
    if cli._checks.triton_interpret():
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
    in steps of 64."""
    _compiled_triton()
    shape = ["--arch", "86", "-G", "32", "--kv-heads", "1", "--dqk", "256", "--dv", "256", "--block-size", "128"]
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
    (["--block-size", "63"], "selected_block_size: expected a multiple of 16, got 63"),
    (["--dv", "256"], "value"),  # Dv > Dqk
    (["--dtype", "fp32", "--block-count", "0"], "selected_block_count"),
    (["--dqk", "-5"], "Dqk: expected >= 1, got -5"),  # was a traceback from torch.zeros, exit 1
    (["-G", "-1"], "G: expected >= 1, got -1"),
])
def test_fit_bad_shape_is_a_usage_error(args, message, capsys):
    _compiled_triton()
    assert cli.main(["fit", *args]) == 2
    assert message in capsys.readouterr().err


def test_fit_under_the_interpreter_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["fit"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err
