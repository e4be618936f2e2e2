"""``sparseops._triton.launch``: fewer pipeline stages when shared memory runs short, then a clear error.

A stand-in kernel raises Triton's own ``OutOfResources`` (what a launch raises when the compiled kernel needs more
than the device has), so this runs without a GPU or the interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

from sparseops import _triton  # noqa: E402


class _Kernel:
    """Fits in shared memory from ``fits`` stages down (0: never); records the stage count of every try."""

    def __init__(self, name, fits, what="shared memory"):
        self.__name__, self.fits, self.what, self.tries, self.args = name, fits, what, [], None

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages=None, **meta):
            self.tries.append(num_stages)
            if num_stages is None or num_stages > self.fits:
                raise OutOfResources(200_000 if self.what == "shared memory" else 2048, 101_376, self.what)
            self.args = (grid, args, num_warps, meta)

        return run


def test_retries_with_fewer_stages_and_remembers():
    k = _Kernel("k_retry", fits=1)
    _triton.launch(k, (3,), torch.device("cpu"), (1, 2), num_warps=4, num_stages=3, BLOCK=16)
    assert k.tries == [3, 2, 1] and k.args == ((3,), (1, 2), 4, {"BLOCK": 16})
    k.tries.clear()
    _triton.launch(k, (3,), torch.device("cpu"), (1, 2), num_warps=4, num_stages=3, BLOCK=16)
    assert k.tries == [1]  # the fitting stage count is remembered per kernel and constexpr set
    k.tries.clear()
    _triton.launch(k, (3,), torch.device("cpu"), (1, 2), num_warps=4, num_stages=3, BLOCK=32)
    assert k.tries == [3, 2, 1]  # another constexpr set is another compiled kernel


def test_no_fit_raises_value_error_naming_shape_need_and_way_out():
    k = _Kernel("k_never", fits=0)
    with pytest.raises(ValueError) as e:
        _triton.launch(k, (1,), torch.device("cpu"), (), num_warps=8, num_stages=2,
                       shape="selected_block_size=128, Dqk=256, Dv=256", BLOCK=64)
    msg = str(e.value)
    for part in ("k_never", "selected_block_size=128", "200000 bytes of shared memory", "101376 bytes",
                 "backend='torch'"):
        assert part in msg, (part, msg)
    assert k.tries == [2, 1]
    k.tries.clear()
    with pytest.raises(ValueError, match="200000 bytes of shared memory"):
        _triton.launch(k, (1,), torch.device("cpu"), (), num_warps=8, num_stages=2,
                       shape="selected_block_size=128, Dqk=256, Dv=256", BLOCK=64)
    assert k.tries == []  # remembered: the same error again, without compiling or trying the stages


def test_other_resources_are_not_retried():
    k = _Kernel("k_threads", fits=0, what="threads")
    with pytest.raises(ValueError, match="2048 of threads"):
        _triton.launch(k, (1,), torch.device("cpu"), (), num_warps=64, num_stages=2)
    assert k.tries == [2]  # fewer stages do not give more threads
