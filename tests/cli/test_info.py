"""``sparseops info``: versions, the device and which backend auto picks."""

from __future__ import annotations

import torch

import sparseops
from sparseops import cli


def test_info_prints_versions_and_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"sparseops     {sparseops.__version__}" in out
    assert torch.__version__ in out
    assert "triton" in out and "python" in out
    assert "cpu tensors -> torch" in out  # auto never picks triton for CPU tensors
    assert "deterministic" in out
