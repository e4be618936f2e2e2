"""The Makefile's phony targets each have a recipe: a declared target without one does nothing and exits 0
(`make lint` printed "Nothing to be done" and passed)."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def test_every_phony_target_has_a_rule():
    text = MAKEFILE.read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    rules = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))
    assert phony, "no .PHONY line"
    assert [t for t in phony if t not in rules] == []
