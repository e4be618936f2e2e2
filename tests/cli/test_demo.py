"""``sparseops demo --quick``: the losses fall, the JSON keeps its schema, the expert-parallel rerun matches."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from sparseops.cli import demo


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparseops demo")
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def _is_float(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.mark.distributed
def test_quick_run_schema_and_ep(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert demo.run(_args("--quick", "--steps", "30", "--ep", "2", "--json", str(path), "--out", str(tmp_path))) == 0
    r = json.loads(path.read_text())
    assert set(r) >= {"nsa", "window_only", "ep", "seconds", "config"}
    steps = r["config"]["train"]["steps"]
    for key in ("nsa", "window_only"):
        assert len(r[key]["loss"]) == steps and all(_is_float(v) for v in r[key]["loss"])
        assert _is_float(r[key]["recall"]) and 0.0 <= r[key]["recall"] <= 1.0
        assert sum(r[key]["loss"][-5:]) < sum(r[key]["loss"][:5])  # it learns (the value distribution at least)
    assert r["ep"]["world_size"] == 2 and _is_float(r["ep"]["max_abs_loss_diff"])
    assert (r["ep"]["mode"], r["ep"]["dispatcher"]) == ("replicated", "alltoall")  # the exact configuration
    assert r["ep"]["check_steps"] == steps  # every step checked
    # every rank runs the whole batch and each token's expert outputs are summed on its own rank: every loss is
    # bitwise the one-process loss, in fp32 too
    assert r["ep"]["max_abs_loss_diff"] == 0.0 and r["ep"]["bitwise_steps"] == steps
    assert len(r["ep"]["loss"]) == steps and r["ep"]["recall"] == r["nsa"]["recall"]
    assert r["config"]["chance"] == pytest.approx(1 / r["config"]["task"]["num_values"])
    assert r["config"]["threads"] == 1
    assert _is_float(r["seconds"]) and r["seconds"] > 0
    out = capsys.readouterr().out
    assert "nsa" in out and "window_only" in out and "EP = 2 (replicated, alltoall)" in out and "wall time" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "demo.png").stat().st_size > 0


@pytest.mark.parametrize("argv, match", [(("--steps", "0"), "--steps"), (("--ep", "3"), "--ep"),
                                         (("--threads", "0"), "--threads"), (("--seed", str(2**64)), "--seed"),
                                         (("--ep-mode", "model"), None), (("--dispatcher", "ring"), None)],
                         ids=["no-steps", "ep-not-dividing", "no-threads", "seed-past-torch", "bad-ep-mode", "bad-dispatcher"])
def test_bad_arguments_write_nothing(tmp_path, argv, match):
    if match is None:  # argparse's choices reject it (exit status 2) before anything runs
        with pytest.raises(SystemExit) as exc:
            _args(*argv, "--out", str(tmp_path / "o"))
        assert exc.value.code == 2 and not (tmp_path / "o").exists()
        return
    with pytest.raises(SystemExit, match=match):
        demo.run(_args(*argv, "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag, target, match", [
    ("--out", "a-file/o", "--out: expected a directory that can be written"),  # a file where a folder goes
    ("--json", "a-dir", "--json: expected a file path"),  # a folder where the file goes
    ("--json", "a-file/r.json", "--json: expected a directory that can be written"),
], ids=["out-under-a-file", "json-is-a-folder", "json-under-a-file"])
def test_unwritable_outputs_fail_before_training(tmp_path, monkeypatch, flag, target, match):
    """Refused before the first step (the results are written after the last one), nothing created."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    monkeypatch.setattr(demo, "_train_all", lambda *a, **k: pytest.fail("trained before checking " + flag))
    with pytest.raises(SystemExit, match=match):
        demo.run(_args("--quick", flag, str(tmp_path / target)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"]
