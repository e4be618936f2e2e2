"""``_settings.Settings`` under ``torch.compile``: ``get()`` traces without a graph break and the graph keeps the
knobs it was traced with (docs/internals.md, "Settings")."""

import dataclasses

import torch

from sparseops._settings import Settings


@dataclasses.dataclass(frozen=True)
class _Knobs:
    scale: int = 2


def test_get_is_a_constant_under_compile():
    knobs = Settings(_Knobs())
    fn = torch.compile(lambda x: x * knobs.get().scale, backend="eager", fullgraph=True)
    x = torch.ones(3)
    torch.compiler.reset()
    assert torch.equal(fn(x), x * 2)
    with knobs.override(scale=5):
        assert knobs.get().scale == 5
        assert torch.equal(fn(x), x * 2)  # the traced constant
        torch.compiler.reset()
        assert torch.equal(fn(x), x * 5)  # traced again
    torch.compiler.reset()
