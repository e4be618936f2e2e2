"""CPU kernels fused by ``torch.compile`` (inductor), with the eager PyTorch code as the fallback.

A chain of eager ops makes one pass over memory per op (and, for fp16 / bf16, extra up-cast passes); inductor
fuses such a chain into one C++ loop that reads each input once and writes each output once. The compiled
kernel computes the same expressions as the eager code (fp32 math, every output rounded once), so either
path is exact to the same tolerances; the sums may add in a different order.

- Compiled lazily, on the first call that qualifies (a few seconds, once per process and dtype; inductor's
  on-disk cache makes later processes faster). Nothing happens at import time.
- Shapes are dynamic (one compile serves every size); sizes 0 and 1 stay on the eager path, as inductor
  would specialise on them. Dims equal at the first call share a symbol (dynamo's duck sizing); a later
  call where they differ recompiles once (duck sizing stays on: the kernels specialised without it are
  slower).
- Off when ``SPARSEOPS_COMPILE=0`` is set, while ``torch.compile`` is tracing the caller, when dynamo is
  disabled (``TORCHDYNAMO_DISABLE=1``), and after a failed compile (no C++ compiler, an unsupported
  platform, dynamo's recompile limit): a failure is reported once with ``warnings.warn`` and the eager path
  is used from then on for those argument dtypes. The kernels write only the output tensors they are given,
  so a failed attempt leaves nothing half-done that the eager path would not overwrite.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable

import torch

from ._checks import fmt_exc


def enabled() -> bool:
    """Whether compiled CPU kernels may be used (``SPARSEOPS_COMPILE`` is not ``0``)."""
    return os.environ.get("SPARSEOPS_COMPILE", "1") != "0"


class CompiledKernel:
    """``fn`` compiled with ``torch.compile(dynamic=True)`` on first use; ``__call__`` returns False (and
    runs nothing) when the compiled kernel is unavailable, so the caller runs its eager code.

    Each combination of argument dtypes and size-1 dims gets its own copy of ``fn``'s code object, so its own
    dynamo cache and recompile budget: a process that calls with fp32, bf16 and fp16 tensors, or with shapes
    that dynamo specialises differently, never pushes another combination's kernel over
    ``torch._dynamo.config.recompile_limit``. A failure (a compile error, or that limit) is per combination:
    warned once, then the eager path.
    """

    def __init__(self, fn: Callable[..., None], name: str):
        self.fn = fn
        self.name = name
        self._compiled: dict[tuple, Callable[..., None] | None] = {}
        self.failed: str | None = None
        self.calls = 0

    def _compile(self) -> Callable[..., None]:
        fn = self.fn
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        return torch.compile(copy, dynamic=True, fullgraph=True)

    def __call__(self, *args) -> bool:
        if not enabled() or torch.compiler.is_compiling():
            return False
        from torch import _dynamo  # here, not at import time: it takes seconds to import

        if getattr(_dynamo.config, "disable", False):
            return False  # torch.compile would run fn unfused: full-size temporaries
        # dtypes, and which dims are 1 (dynamo specialises those: a new graph, so a budget of its own)
        key = tuple((a.dtype, tuple(d == 1 for d in a.shape)) for a in args if isinstance(a, torch.Tensor))
        compiled = self._compiled.get(key, False)
        if compiled is None:
            return False
        if compiled is False:
            compiled = self._compiled[key] = self._compile()
        try:
            with torch.no_grad():
                compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compile failure means: use the eager path
            self._compiled[key] = None
            self.failed = fmt_exc(exc)
            dtypes = ", ".join(str(d).replace("torch.", "") for d, _ in key)
            warnings.warn(
                f"sparseops: torch.compile of the CPU kernel {self.name} failed for dtypes ({dtypes}) "
                f"({self.failed}); using the eager PyTorch path for them from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        self.calls += 1
        return True


#: every kernel made by :func:`kernel`, for ``sparseops info``
KERNELS: list[CompiledKernel] = []


def kernel(name: str) -> Callable[[Callable[..., None]], CompiledKernel]:
    """Decorator: wrap an out-parameter function (it writes its results into tensors it is given and returns
    None) as a lazily compiled :class:`CompiledKernel`."""

    def wrap(fn: Callable[..., None]) -> CompiledKernel:
        k = CompiledKernel(fn, name)
        KERNELS.append(k)
        return k

    return wrap


def status() -> str:
    """One line for ``sparseops info``."""
    if not enabled():
        return "off (SPARSEOPS_COMPILE=0): eager PyTorch on the CPU"
    failed = [f"{k.name} ({k.failed})" for k in KERNELS if k.failed]
    if failed:
        return "on, but eager for some dtypes after a failed compile: " + "; ".join(failed)
    return "on: torch.compile (inductor) fuses the CPU hot loops on first use; SPARSEOPS_COMPILE=0 turns it off"
