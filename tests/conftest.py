"""Fixtures shared by the test suite."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture
def override():
    """``override(SETTINGS, **knobs)``: change a backend's tuning knobs for the rest of the test.

    The settings object's own context manager (``SETTINGS.override``), entered now and left when the test ends,
    so that a test chooses a code path the way a tuning script does, without touching module globals.
    """
    with contextlib.ExitStack() as stack:
        yield lambda settings, **knobs: stack.enter_context(settings.override(**knobs))
