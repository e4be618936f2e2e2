"""The C++ CPU kernels: built on first use with torch's own ``torch.utils.cpp_extension.load`` (docs/internals.md).

Each :class:`Extension` is one C++ source (with the shared header ``csrc/cpu.h``), compiled with ``-O3
-march=native`` the first time a call needs it (the sources include pybind11, no torch header: docs/nsa.md has
the build time), once per machine, cached under torch's ``TORCH_EXTENSIONS_DIR`` and named by a hash of the sources, the CPU's feature
flags and the torch version (a build for another CPU or torch is never reused). When it cannot be built (no C++ compiler, no ninja) a
``RuntimeWarning`` says so once and the callers run their torch ops; ``SPARSEOPS_CPU_KERNELS=0`` turns every
extension off. Nothing is built at import time.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

#: dtypes the kernels take (fp32 and float64 natively; fp16 / bf16 inputs are computed in fp32, as on the torch paths)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: the most bytes a kernel's per-thread gradient buffers may take together (fewer threads above it)
TASK_BYTES = 1 << 30

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-pthread"]


def enabled() -> bool:
    """Whether the C++ kernels may be used (``SPARSEOPS_CPU_KERNELS`` is not ``0``)."""
    return os.environ.get("SPARSEOPS_CPU_KERNELS", "1") != "0"


def _cpu_tag() -> bytes:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return (flags or platform.processor() or platform.machine()).encode()


def _ninja() -> str | None:
    """ninja on PATH, or beside this interpreter (a venv's ninja package when the venv is not activated)."""
    return shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))


class Extension:
    """One C++ source built on first use: :meth:`module` returns it, or None when it cannot be built."""

    def __init__(self, name: str, source: Path, what: str):
        self.name, self.source, self.what = name, source, what
        self.state: dict = {"module": None, "failed": None}
        self._lock = threading.Lock()

    def build_name(self) -> str:
        """The extension's name: a hash of the sources, the CPU's flags and the torch version."""
        text = self.source.read_bytes() + b"".join(p.read_bytes() for p in sorted(_CSRC.glob("*.h")))
        tag = hashlib.sha256(text + _cpu_tag() + torch.__version__.encode()).hexdigest()[:12]
        return f"sparseops_{self.name}_{tag}"

    def status(self) -> str:
        """What a call would find, without building: ``built``, ``builds on first use``, ``off`` or why it
        cannot be built (for ``sparseops info``)."""
        from torch.utils.cpp_extension import get_default_build_root

        if not enabled():
            return "off (SPARSEOPS_CPU_KERNELS=0)"
        if self.state["failed"] is not None:
            return f"failed to build ({self.state['failed'][:120]})"
        if self.state["module"] is not None:
            return f"built ({Path(self.state['module'].__file__).parent})"
        # torch's build folder: ROOT/NAME under TORCH_EXTENSIONS_DIR, else ROOT/<python and accelerator>/NAME
        root, name = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()), self.build_name()
        built = [*root.glob(f"{name}/*.so"), *root.glob(f"*/{name}/*.so")]
        if built:
            return f"built ({built[0].parent})"
        cxx = os.environ.get("CXX", "c++")
        missing = [tool for tool, found in ((cxx, shutil.which(cxx)), ("ninja", _ninja())) if found is None]
        if missing:
            return f"cannot be built here: no {' and no '.join(missing)} (the torch ops run instead)"
        return "builds on first use (10-30 s, once per machine and torch)"

    def _build(self):
        from torch.utils.cpp_extension import load

        path = os.environ.get("PATH")
        # ninja only beside this interpreter (a venv not activated): on PATH for torch's build, then put back
        moved = shutil.which("ninja") is None and _ninja() is not None
        if moved:
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + (path or "")
        try:
            return load(name=self.build_name(), sources=[str(self.source)],
                        extra_include_paths=[str(_CSRC)], extra_cflags=_FLAGS, verbose=False)
        finally:
            if moved:
                if path is None:
                    del os.environ["PATH"]
                else:
                    os.environ["PATH"] = path

    def module(self):
        """The built extension, or None when it cannot be built (warned once)."""
        st = self.state
        if st["module"] is not None or st["failed"] is not None:
            return st["module"]
        with self._lock:
            if st["module"] is None and st["failed"] is None:
                try:
                    st["module"] = self._build()
                except Exception as exc:  # noqa: BLE001 - any build failure means: the torch ops
                    st["failed"] = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"sparseops: the C++ CPU kernels of {self.what} could not be built "
                                  f"({st['failed'][:300]}); the torch ops run instead", RuntimeWarning,
                                  stacklevel=3)
        return st["module"]

    def available(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` can run here: a CPU tensor of a dtype in :data:`DTYPES`, enabled, not while
        ``torch.compile`` traces, built."""
        return (x.device.type == "cpu" and x.dtype in DTYPES and enabled() and not torch.compiler.is_compiling()
                and self.module() is not None)
