"""The test-only fault injection's syntax (the faults themselves: tests/cli/test_train.py)."""

from __future__ import annotations

import pytest

from sparseops.training.faults import Fault, parse_fault


def test_parse_fault():
    assert parse_fault("hang:rank=1:step=3") == Fault("hang", 1, 3)
    assert parse_fault("nan:step=0:rank=2") == Fault("nan", 2, 0)
    assert parse_fault(None) is None and parse_fault("") is None
    assert Fault("kill", 1, 3).at(3, 1) and not Fault("kill", 1, 3).at(3, 0)
    assert parse_fault("kill:rank=1:step=3:restart=0") == Fault("kill", 1, 3, 0)  # torchrun's first attempt only
    assert Fault("kill", 1, 3, 0).at(3, 1, 0) and not Fault("kill", 1, 3, 0).at(3, 1, 1)


@pytest.mark.parametrize("text", ["hang", "sleep:rank=1:step=3", "hang:rank=1", "hang:rank=x:step=1",
                                  "kill:rank=1:step=2:extra", "kill:rank=1:step=2:restart=x"])
def test_parse_fault_rejects(text):
    with pytest.raises(ValueError, match="SPARSEOPS_TRAIN_FAULT: expected '<kind>:rank=<r>:step=<s>'"):
        parse_fault(text)
