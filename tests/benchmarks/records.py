"""What every benchmark smoke test checks of a run's record (used by the tests of this folder)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def check_record(record: dict, out: Path, name: str) -> None:
    """A smoke run measured rows, passed its correctness gate, and saved itself and its chart under ``out``."""
    assert record["mode"] == "smoke"
    assert record["rows"], "no rows measured"
    assert record["gate"] and all(c["err"] <= c["tol"] for c in record["gate"])
    saved = json.loads((out / f"{name}.json").read_text())
    assert isinstance(saved, list) and saved[-1]["rows"] == json.loads(json.dumps(record["rows"]))
    assert saved[-1]["env"]["torch"] == torch.__version__
    assert (out / f"{name}.png").stat().st_size > 0
