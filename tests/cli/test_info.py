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
    from importlib import metadata

    try:
        want = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        want = "not installed"
    assert f"transformers  {want}" in out
    assert "cpu tensors -> torch" in out  # auto never picks triton for CPU tensors
    assert "deterministic" in out


def test_info_says_whether_the_cpp_kernels_are_built_without_building_them(monkeypatch, tmp_path):
    from sparseops import _cpu_attention
    from sparseops.cli.info import info_lines
    from sparseops.dsa import indexer

    ext = indexer.EXTENSION
    monkeypatch.setattr(ext, "state", {"module": None, "failed": None})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSEOPS_CPU_KERNELS", "0")
    assert ext.status() == "off (SPARSEOPS_CPU_KERNELS=0)"
    monkeypatch.delenv("SPARSEOPS_CPU_KERNELS")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert ext.status().startswith("cannot be built here: no no-such-compiler-here")
    monkeypatch.delenv("CXX")
    assert ext.status().startswith("builds on first use") or ext.status().startswith("cannot be built")
    (tmp_path / ext.build_name()).mkdir()
    (tmp_path / ext.build_name() / f"{ext.build_name()}.so").touch()
    assert ext.status() == f"built ({tmp_path / ext.build_name()})"
    lines = [line for line in info_lines() if line.startswith("c++ kernels")]
    assert [line.split(":")[0] for line in lines] == [f"c++ kernels   {e.what}" for e in
                                                      (_cpu_attention.EXTENSION, indexer.EXTENSION)]
    assert not list(tmp_path.glob("*/*.o"))  # asking built nothing
