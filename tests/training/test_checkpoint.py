"""Which checkpoint ``--resume`` picks (saving, loading and resuming runs: tests/cli/test_train.py)."""

from __future__ import annotations

import pytest

from sparseops.training.checkpoint import checkpoint_path, newest_complete, scan


def _ckpt(root, step, complete=True):
    p = checkpoint_path(root, step)
    p.mkdir(parents=True)
    (p / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (p / ".metadata").write_bytes(b"x")
    return p


def test_newest_complete_skips_incomplete_with_a_warning(tmp_path):
    _ckpt(tmp_path, 2)
    p10 = _ckpt(tmp_path, 10)
    _ckpt(tmp_path, 12, complete=False)
    (tmp_path / "step_x").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert scan(tmp_path)[0] == [(2, checkpoint_path(tmp_path, 2)), (10, p10)]
    with pytest.warns(UserWarning, match="step_12 is incomplete"):
        assert newest_complete(tmp_path) == (10, p10)



def test_a_complete_checkpoint_named_is_the_one(tmp_path):
    """``--resume DIR/step_<s>``: that checkpoint, not DIR's newest (to resume from an earlier one); an incomplete
    one named is refused."""
    p2 = _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 10)
    assert newest_complete(p2) == (2, p2)
    with pytest.raises(ValueError, match="step_4', which holds no complete checkpoint"):
        newest_complete(_ckpt(tmp_path, 4, complete=False))


@pytest.mark.parametrize("make, match", [(lambda root: None, "which does not exist"),
                                         (lambda root: _ckpt(root, 3, complete=False), "incomplete: step_3"),
                                         (lambda root: root.mkdir(), "holds no complete checkpoint"),
                                         (lambda root: root.write_text(""), "which is not a directory")],
                         ids=["missing", "only-incomplete", "empty", "a-file"])
def test_no_complete_checkpoint_names_the_flag_and_dir(tmp_path, make, match):
    root = tmp_path / "ck"
    make(root)
    with pytest.raises(ValueError, match=f"--resume: expected a directory with a complete checkpoint, or a complete "
                                         f"checkpoint DIR/step_<s>, got '{root}'"):
        newest_complete(root)
    with pytest.raises(ValueError, match=match):
        newest_complete(root)
