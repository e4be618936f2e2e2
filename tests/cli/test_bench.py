"""``sparseops bench``: finds the repository's benchmark scripts or says what it needs, passes --quick /
--smoke / --out to each subject's ``main``, writes to ./sparseops-results/ by default (never into the
recorded results unless --record), and reports the files written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparseops import cli
from sparseops.cli import bench

REPO = Path(__file__).resolve().parents[2]

FAKE_BENCH = """
import argparse
import json
from pathlib import Path

def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if {fail!r} == "raise":
        raise RuntimeError("correctness gate failed")
    mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = {{"rows": [{{"H": 8, "ours ms": 0.1}}], "mode": mode, "duration_s": 75.0}}
    (args.out / "moe.json").write_text(json.dumps([rec]))
    (args.out / "moe.png").write_bytes(b"png")
    print(f"H | ours ms | mode\\n8 | 0.1 | {{mode}}")
    return 1 if {fail!r} == "rc" else 0
"""


@pytest.fixture(autouse=True)
def _restore_imports(monkeypatch):
    """The loader imports each checkout's scripts as the package ``benchmarks``: give the next test the
    modules and ``sys.path`` this one found."""
    def ours(k):
        return k == "benchmarks" or k.startswith("benchmarks.")

    saved, path = {k: v for k, v in sys.modules.items() if ours(k)}, list(sys.path)
    monkeypatch.setattr(bench, "_ADDED_TO_PATH", [])
    yield
    for k in [k for k in sys.modules if ours(k)]:
        del sys.modules[k]
    sys.modules.update(saved)
    sys.path[:] = path


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A checkout whose benchmarks/moe.py is the stand-in above; the working directory elsewhere."""
    def make(fail: str = "no"):
        (tmp_path / "repo" / "benchmarks").mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / "benchmarks" / "moe.py").write_text(FAKE_BENCH.format(fail=fail))
        (tmp_path / "cwd").mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / "cwd")
        monkeypatch.delenv("SPARSEOPS_BENCHMARKS", raising=False)
        return tmp_path / "repo"

    return make


def test_bench_missing_scripts_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(bench, "benchmarks_dir", lambda repo=None: None)
    assert cli.main(["bench", "--op", "moe", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/moe.py not found" in err and "source checkout" in err and "--repo PATH" in err


def test_bench_repo_without_benchmarks_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["bench", "--op", "moe", "--repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/moe.py not found" in err and str(tmp_path) in err


@pytest.mark.parametrize("fail", ["no", "raise", "rc"], ids=["ok", "gate-raises", "returns-1"])
def test_bench_runs_a_subject_main(fake_repo, tmp_path, capsys, fail):
    """The loading, --smoke/--out passthrough, the subject's own table and the file report, on a stand-in."""
    repo = fake_repo(fail)
    out = tmp_path / "out"
    rc = cli.main(["bench", "--op", "moe", "--smoke", "--out", str(out), "--repo", str(repo)])
    text = capsys.readouterr().out
    if fail == "raise":
        assert rc == 1 and "RuntimeError: correctness gate failed" in text
        return
    assert rc == (1 if fail == "rc" else 0), text
    assert "8 | 0.1 | smoke" in text  # the subject's own table, run with --smoke
    assert str(out / "moe.json") in text and str(out / "moe.png") in text


def test_bench_out_that_cannot_be_written_is_a_usage_error(fake_repo, tmp_path, capsys):
    """--out under a file: exit 2 naming --out before any subject runs (each would fail, exit 1)."""
    repo = fake_repo()
    (tmp_path / "a-file").write_text("")
    assert cli.main(["bench", "--op", "moe", "--smoke", "--out", str(tmp_path / "a-file" / "o"), "--repo", str(repo)]) == 2
    captured = capsys.readouterr()
    assert "--out: expected a directory that can be written" in captured.err and "== benchmarks" not in captured.out


def test_bench_default_output_is_the_working_directory(fake_repo, tmp_path, capsys):
    """A user's run lands in ./sparseops-results/ (ignored by git), never in the repository's records;
    a second run names how long the last one of the same mode took."""
    repo = fake_repo()
    assert cli.main(["bench", "--op", "moe", "--quick", "--repo", str(repo)]) == 0
    results = tmp_path / "cwd" / "sparseops-results"
    assert (results / "moe.json").is_file() and (results / "moe.png").is_file()
    assert not (repo / "benchmarks" / "results").exists()
    assert "8 | 0.1 | quick" in capsys.readouterr().out
    assert cli.main(["bench", "--op", "moe", "--quick", "--repo", str(repo)]) == 0
    text = capsys.readouterr().out
    assert "the last quick run in" in text and "took 1:15" in text


def test_bench_record_writes_the_recorded_results(fake_repo, capsys):
    repo = fake_repo()
    assert cli.main(["bench", "--op", "moe", "--quick", "--record", "--repo", str(repo)]) == 0
    assert json.loads((repo / "benchmarks" / "results" / "moe.json").read_text())[-1]["mode"] == "quick"
    assert not (Path.cwd() / "sparseops-results").exists()


def test_bench_smoke_without_out_writes_a_temporary_directory(fake_repo, capsys):
    repo = fake_repo()
    assert cli.main(["bench", "--op", "moe", "--smoke", "--repo", str(repo)]) == 0
    text = capsys.readouterr().out
    assert not (repo / "benchmarks" / "results").exists(), "a smoke run wrote into the recorded results"
    assert not (Path.cwd() / "sparseops-results").exists()
    assert "sparseops-bench-smoke-moe-" in text and "moe.json" in text


def test_bench_scripts_load_under_an_importable_name():
    """What `make run` once failed at: the moe_layer script's EP worker, pickled by module and name for the
    spawned processes, must import again there. Its spawned run: tests/test_make_run.py (the bench step)."""
    import pickle

    mod = bench.load_benchmark("moe_layer", str(REPO))
    assert mod.__name__ == "benchmarks.moe_layer" and mod._ep_worker.__module__ == mod.__name__
    assert pickle.loads(pickle.dumps(mod._ep_worker)) is mod._ep_worker
    assert str(REPO) in sys.path  # where a spawned process, which starts with this sys.path, finds it


def test_bench_loads_each_checkout_under_its_own_name(tmp_path, monkeypatch):
    """Two checkouts in one process: each --repo gets its own scripts (the package name is the same)."""
    mods = []
    for tag in ("a", "b"):
        (tmp_path / tag / "benchmarks").mkdir(parents=True)
        (tmp_path / tag / "benchmarks" / "moe.py").write_text(f"TAG = {tag!r}\ndef main(argv=None):\n    return 0\n")
        mods.append(bench.load_benchmark("moe", str(tmp_path / tag)))
    assert [m.TAG for m in mods] == ["a", "b"]
    assert str(tmp_path / "b") in sys.path and str(tmp_path / "a") not in sys.path


def test_bench_written_files_are_the_subjects_own(tmp_path):
    """nsa_module --smoke writes nsa_module_smoke.json: reported, not '(nothing named nsa_module.* written)';
    moe_layer's files in the same folder are not moe's."""
    for f in ("nsa_module_smoke.json", "moe.json", "moe.png", "moe_layer.json", "nsa.json", "dsa.json"):
        (tmp_path / f).write_text("{}")
    names = {s: [Path(p).name for p in bench.written_files(tmp_path, s, 0.0)] for s in bench.SUBJECTS}
    assert names == {"moe": ["moe.json", "moe.png"], "nsa": ["nsa.json"], "moe_layer": ["moe_layer.json"],
                     "nsa_module": ["nsa_module_smoke.json"], "dsa": ["dsa.json"]}
