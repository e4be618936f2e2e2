"""``sparseops._triton``: ``launch`` passes the arguments by name, takes fewer pipeline stages when shared memory
runs short, then raises a clear error; ``offline_compile`` compiles the MoE kernels for real GPUs.

A stand-in kernel raises Triton's own ``OutOfResources`` (what a launch raises when the compiled kernel needs more
than the device has), so the launch tests run without a GPU or the interpreter; the offline compiles need
compiled Triton (skipped under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

from sparseops import _checks, _triton  # noqa: E402
from sparseops.moe import triton_impl as moe_triton  # noqa: E402

needs_compiler = pytest.mark.skipif(_checks.triton_interpret(), reason="offline compile needs compiled Triton")


class _Kernel:
    """Fits in shared memory from ``fits`` stages down (0: never); records the stage count of every try."""

    def __init__(self, name, fits, what="shared memory"):
        self.__name__, self.fits, self.what, self.tries, self.args = name, fits, what, [], None

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages=None, **kwargs):
            assert not args, "kernel arguments travel by name"
            self.tries.append(num_stages)
            if num_stages is None or num_stages > self.fits:
                raise OutOfResources(200_000 if self.what == "shared memory" else 2048, 101_376, self.what)
            self.args = (grid, num_warps, kwargs)

        return run


def test_retries_with_fewer_stages_and_remembers():
    k = _Kernel("k_retry", fits=1)
    _triton.launch(k, (3,), torch.device("cpu"), {"x": 1, "y": 2}, num_warps=4, num_stages=3, BLOCK=16)
    assert k.tries == [3, 2, 1] and k.args == ((3,), 4, {"x": 1, "y": 2, "BLOCK": 16})
    k.tries.clear()
    _triton.launch(k, (3,), torch.device("cpu"), {"x": 5, "y": 2}, num_warps=4, num_stages=3, BLOCK=16)
    assert k.tries == [1]  # the fitting stage count is remembered per kernel and constexpr set, whatever the args
    k.tries.clear()
    _triton.launch(k, (3,), torch.device("cpu"), {"x": 1, "y": 2}, num_warps=4, num_stages=3, BLOCK=32)
    assert k.tries == [3, 2, 1]  # another constexpr set is another compiled kernel


def test_no_fit_raises_value_error_naming_shape_need_and_way_out():
    k = _Kernel("k_never", fits=0)
    with pytest.raises(ValueError) as e:
        _triton.launch(k, (1,), torch.device("cpu"), {}, num_warps=8, num_stages=2,
                       shape="selected_block_size=128, Dqk=256, Dv=256", BLOCK=64)
    msg = str(e.value)
    for part in ("k_never", "selected_block_size=128", "200000 bytes of shared memory", "101376 bytes",
                 "backend='torch'"):
        assert part in msg, (part, msg)
    assert k.tries == [2, 1]
    k.tries.clear()
    with pytest.raises(ValueError, match="200000 bytes of shared memory"):
        _triton.launch(k, (1,), torch.device("cpu"), {}, num_warps=8, num_stages=2,
                       shape="selected_block_size=128, Dqk=256, Dv=256", BLOCK=64)
    assert k.tries == []  # remembered: the same error again, without compiling or trying the stages


def test_other_resources_are_not_retried():
    k = _Kernel("k_threads", fits=0, what="threads")
    with pytest.raises(ValueError, match="2048 of threads"):
        _triton.launch(k, (1,), torch.device("cpu"), {}, num_warps=64, num_stages=2)
    assert k.tries == [2]  # fewer stages do not give more threads


def test_a_grid_past_cudas_limits_does_not_fit():
    """A grid CUDA cannot launch (N2 > 65535 KV heads on the NSA kernels' axis 1) is DoesNotFit, before any try
    (``backend="auto"`` then runs the torch path), on every device alike."""
    k = _Kernel("k_grid", fits=9)
    with pytest.raises(_triton.DoesNotFit, match="k_grid: N2=70000 needs 70000 programs along grid axis 1, CUDA "
                       "launches at most 65535"):
        _triton.launch(k, (4, 70000), torch.device("cpu"), {}, num_warps=4, num_stages=2, shape="N2=70000")
    assert k.tries == []
    _triton.launch(k, (4, 65535, 1), torch.device("cpu"), {}, num_warps=4, num_stages=2)
    assert k.tries == [2]


@pytest.mark.parametrize("arch", [90, 100, 80, 120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=["bf16", "fp16", "fp32", "fp64"])
@needs_compiler
def test_moe_kernels_compile_and_fit(arch, dtype):
    """The four MoE kernels at a model's hidden size (7168, the tiles' cap) and a small odd one, with and without
    probs, compile for Hopper, datacenter Blackwell, Ampere and consumer Blackwell and fit."""
    g = torch.Generator().manual_seed(0)
    T, K = 6, 4
    with _triton.offline_compile(arch) as launches:
        for H in (7168, 33):
            tokens = torch.randn(T, H, generator=g).to(dtype)
            si = torch.randperm(T * K, generator=g)
            for probs in (torch.rand(T, K, generator=g).to(dtype), None):
                s, e = 3, 20
                moe_triton.permute(tokens, si, probs, K, s, e)
                perm = torch.randn(e - s, H, generator=g).to(dtype)
                moe_triton.unpermute(perm, si, probs, K, s, e)
                moe_triton.unpermute_grad(tokens, si, perm, probs, K, s, e)
                moe_triton.permute_grad(perm, si, None if probs is None else probs.flatten()[: e - s], K, s, e)
    names = [x.kernel for x in launches]
    assert names == ["moe_permute_kernel", "moe_unpermute_kernel", "moe_unpermute_grad_kernel",
                     "moe_unpermute_kernel"] * 4
    assert all(x.shared <= _triton.SHARED_LIMIT[arch] for x in launches)


@needs_compiler
def test_offline_compile_rejects_unknown_arch_and_nesting():
    with pytest.raises(ValueError, match="arch: expected one of"):
        with _triton.offline_compile(75):
            pass
    with _triton.offline_compile(90):
        with pytest.raises(RuntimeError, match="does not nest"):
            with _triton.offline_compile(80):
                pass
    from triton.runtime import driver

    assert not isinstance(driver._active, _triton._OfflineDriver)  # restored on the way out
