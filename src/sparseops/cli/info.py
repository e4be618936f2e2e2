"""Print versions, the device, triton availability and which backend auto picks."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

HELP = "versions, device, backend availability"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sparseops info`` takes no options."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _dist_version(name: str) -> str:
    """An installed distribution's version, without importing it, or ``not installed``."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpp_extensions() -> list:
    """The C++ CPU kernels (``sparseops._cpp.Extension``), none built by asking."""
    from sparseops import _cpu_attention
    from sparseops.dsa import indexer

    return [_cpu_attention.EXTENSION, indexer.EXTENSION]


def info_lines() -> list[str]:
    """The lines ``sparseops info`` prints."""
    import torch

    import sparseops
    from sparseops import _checks, _compile

    def triton_version() -> str:
        if not _checks.triton_available():
            return "not installed"
        import triton

        return triton.__version__

    def auto_pick(device_type: str) -> str:
        picked = _checks.resolve_backend("auto", torch.device(device_type))
        if device_type == "cuda" and not torch.cuda.is_available():
            return f"{picked} (no CUDA device on this machine)"
        return picked

    lines = [
        f"sparseops     {sparseops.__version__}  ({Path(sparseops.__file__).resolve().parent})",
        f"torch         {torch.__version__}",
        f"triton        {triton_version()}",
        f"transformers  {_dist_version('transformers')} (the integrations: docs/transformers.md)",
        f"python        {platform.python_version()} ({sys.executable})",
        f"platform      {platform.platform()}",
        f"cpu           {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}        {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
        lines.append(f"cuda runtime  {torch.version.cuda}")
    else:
        lines.append("cuda          no CUDA device")
    interp = _checks.triton_interpret()
    lines += [
        f"triton usable {'yes' if _checks.triton_available() else 'no'}"
        f" (TRITON_INTERPRET={'1: kernels run on CPU tensors' if interp else '0'})",
        f"auto backend  cpu tensors -> {auto_pick('cpu')}; cuda tensors -> {auto_pick('cuda')}",
        f"cpu kernels   {_compile.status()}",
        *(f"c++ kernels   {ext.what}: {ext.status()}" for ext in _cpp_extensions()),
        f"deterministic sparseops.is_deterministic()={sparseops.is_deterministic()}, "
        f"torch.are_deterministic_algorithms_enabled()={torch.are_deterministic_algorithms_enabled()}",
    ]
    return lines


def run(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0
