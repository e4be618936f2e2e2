"""Tuning knobs as frozen settings objects, one per backend, swapped by a context manager.

A backend declares its knobs once::

    @dataclasses.dataclass(frozen=True)
    class TorchSettings:
        chunk_bytes: int = 32 << 20

    SETTINGS = Settings(TorchSettings())

reads them where it needs them (``SETTINGS.get().chunk_bytes``), and tests or tuning scripts choose other
values for a block of code::

    with nsa_torch.SETTINGS.override(chunk_bytes=1 << 16):
        ...

The values live in a ``ContextVar``, so an override is local to its thread (and to its ``asyncio`` task)
and is undone on exit even when the block raises. Unknown knob names raise ``TypeError``.

Under ``torch.compile`` dynamo cannot trace a ``ContextVar`` read (a graph break at every ``get()``): there
``get()`` reads the knobs when the graph is traced and the graph keeps them as constants, so an override entered
after a function was compiled reaches it only after ``torch.compiler.reset()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Generic, TypeVar

S = TypeVar("S")


def _reader(var: contextvars.ContextVar):
    """A function of no arguments reading ``var``, marked as torch.compiler.assume_constant_result marks (without
    importing torch._dynamo, slow, at import time): dynamo calls it when it traces and keeps the result as a
    constant. No arguments: newer dynamo (torch 2.14) refuses a marked function whose arguments (a ContextVar)
    it cannot turn into constants."""
    def read():
        return var.get()

    read._dynamo_marked_constant = True
    return read


class Settings(Generic[S]):
    """A holder of one frozen dataclass of knobs: ``get()`` reads it, ``override(**changes)`` swaps it."""

    def __init__(self, default: S, name: str | None = None):
        if not dataclasses.is_dataclass(default) or isinstance(default, type):
            raise TypeError(f"default: expected a dataclass instance, got {type(default).__name__}")
        self._default = default
        self._var: contextvars.ContextVar[S] = contextvars.ContextVar(
            name or type(default).__name__, default=default)
        self._read = _reader(self._var)

    def get(self) -> S:
        """The settings in force in this context (under ``torch.compile``: when the graph is traced)."""
        return self._read()

    @property
    def default(self) -> S:
        """The settings a fresh process runs with."""
        return self._default

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator[S]:
        """Run the block with the given knobs changed (the others as they are now); yields the new settings."""
        current = self._var.get()
        names = {f.name for f in dataclasses.fields(current)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"{type(current).__name__}: unknown knob(s) {unknown}; known: {sorted(names)}")
        token = self._var.set(dataclasses.replace(current, **changes))
        try:
            yield self._var.get()
        finally:
            self._var.reset(token)
