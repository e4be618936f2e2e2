"""Flag checks the subcommands share, each a ``SystemExit`` with a one-line message naming the flag (exit
status 2), made before any work: a seed torch accepts, an output folder that can be written."""

from __future__ import annotations

import os
from pathlib import Path

#: the seeds every generator the commands seed accepts, with room for the offsets added to them
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 2**32


def check_seed(prog: str, seed: int) -> None:
    if not SEED_MIN <= seed <= SEED_MAX:
        raise SystemExit(f"{prog}: --seed: expected an int in [{SEED_MIN}, {SEED_MAX}], got {seed}")


def check_out_dir(prog: str, flag: str, folder: str | os.PathLike) -> None:
    """``folder`` is a directory that can be written, or can be created: its nearest existing ancestor is a
    writable directory. Creates nothing (a run that fails another check leaves no folder behind)."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise SystemExit(f"{prog}: {flag}: expected a directory that can be written, got {os.fspath(folder)!r} "
                         f"({os.fspath(probe)!r} is a file)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SystemExit(f"{prog}: {flag}: expected a directory that can be written, got {os.fspath(folder)!r} "
                         f"({os.fspath(probe)!r} is not writable)")


def check_out_file(prog: str, flag: str, path: str | os.PathLike) -> None:
    """``path`` is a file that can be written: not a directory, in a folder :func:`check_out_dir` accepts."""
    path = Path(path)
    if path.is_dir():
        raise SystemExit(f"{prog}: {flag}: expected a file path, got {os.fspath(path)!r}, a directory")
    check_out_dir(prog, flag, path.parent)
