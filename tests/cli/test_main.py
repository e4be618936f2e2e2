"""The ``sparseops`` command's entry point: --help, --version, usage errors, ``python -m sparseops``, and that
none of them imports torch (the subcommand modules import it inside ``run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sparseops
from sparseops import cli

REPO = Path(__file__).resolve().parents[2]


def _run_module(*args: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=120)


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
        assert "--record" in out and "--repo" in out
    if sub == ["fit"]:
        assert "--arch" in out and "--block-size" in out and "--dtype" in out


def test_every_subcommand_follows_the_convention():
    """HELP, add_arguments and run in each module of the tuple: registering one is one entry there."""
    import importlib

    for name in cli.SUBCOMMANDS:
        mod = importlib.import_module(f"sparseops.cli.{name}")
        assert isinstance(mod.HELP, str) and mod.HELP, name
        assert callable(mod.add_arguments) and callable(mod.run), name


def test_no_subcommand_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    assert "usage: sparseops" in capsys.readouterr().out


def test_bad_choice_is_a_usage_error():
    with pytest.raises(SystemExit) as ei:
        cli.main(["check", "--backend", "cuda-magic"])
    assert ei.value.code == 2


def test_python_dash_m_is_the_same_command():
    r = _run_module("-m", "sparseops", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"sparseops {sparseops.__version__}"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["check", "--help"], ["bench", "--help"]],
                         ids=["help", "version", "check-help", "bench-help"])
def test_help_and_version_do_not_import_torch(args):
    """The parser is built from torch-free modules: what --help imports is listed by ``-X importtime``."""
    r = _run_module("-X", "importtime", "-m", "sparseops", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "sparseops.cli" in imported  # the listing is real
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], "torch imported by " + " ".join(args)
