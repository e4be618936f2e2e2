"""The recycled CPU buffers (`sparseops.moe.workspace`): a block is handed out again only when nothing references
it (views, autograd's saved tensors, a retained graph), the pool's byte limit, and results that do not depend
on whether buffers are recycled."""

import pytest
import torch

from sparseops.moe import torch_impl, workspace
from sparseops.nn import MoELayer

pytestmark = pytest.mark.skipif(workspace._use_count is None, reason="this torch has no storage use count")


@pytest.fixture
def pooled():
    """Every CPU buffer of the MoE ops through a fresh pool (also the small ones of these tests)."""
    workspace.release()
    with torch_impl.SETTINGS.override(huge_min_bytes=1):
        yield
    workspace.release()


def rows():
    return torch_impl._empty_rows(64, 32, torch.float32, torch.device("cpu"))


def test_block_is_reused_only_when_nothing_references_it(pooled):
    a = rows()
    ptr = a.data_ptr()
    assert rows().data_ptr() != ptr  # a is alive
    view = a[3:]
    del a
    assert rows().data_ptr() != ptr  # a view keeps the block busy
    del view
    assert rows().data_ptr() == ptr  # free again: the first free block of its size is handed out
    b = rows()
    assert b.shape == (64, 32) and b.dtype == torch.float32
    bf = torch_impl._empty_rows(64, 32, torch.bfloat16, torch.device("cpu"))
    assert bf.dtype == torch.bfloat16 and bf.shape == (64, 32)


def test_saved_tensors_and_retained_graphs_keep_blocks_busy(pooled):
    w = torch.randn(64, 32, requires_grad=True)
    buf = rows().copy_(torch.randn(64, 32))
    ref = buf.clone()
    y = (w * buf).sum()  # autograd saves buf for w's gradient
    ptr = buf.data_ptr()
    del buf
    other = [rows() for _ in range(3)]
    assert all(t.data_ptr() != ptr for t in other)
    for t in other:
        t.fill_(float("nan"))
    (g1,) = torch.autograd.grad(y, w, retain_graph=True)
    assert torch.equal(g1, ref)
    del other
    again = [rows().fill_(float("nan")) for _ in range(3)]  # the retained graph still holds buf
    assert all(t.data_ptr() != ptr for t in again)
    (g2,) = torch.autograd.grad(y, w)
    assert torch.equal(g2, ref)
    del y, again
    assert rows().data_ptr() == ptr  # the graph is gone: buf's block is free again


def test_limit_and_disabled_pool(pooled):
    with torch_impl.SETTINGS.override(pool_bytes=2 << 20):
        keep = [rows() for _ in range(3)]  # one 2 MiB block fits the limit; the others are plain tensors
        assert workspace.POOL.held_bytes() <= 2 << 20
        del keep
    workspace.release()
    with torch_impl.SETTINGS.override(pool_bytes=0):
        rows()
        assert workspace.POOL.held_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_bitwise_the_same_with_recycled_buffers(dtype):
    """Forward + backward twice with every buffer recycled equals the run with fresh buffers, bitwise."""
    torch.manual_seed(0)
    layer = MoELayer(32, 16, 6, 2, shared_ffn_size=8).to(dtype)
    x = torch.randn(37, 32).to(dtype)
    gy = torch.randn(37, 32).to(dtype)

    def step():
        xx = x.detach().requires_grad_(True)
        y = layer(xx)[0]
        grads = torch.autograd.grad(y, [xx, *layer.parameters()], gy)
        return [y.detach(), *grads]

    with torch_impl.SETTINGS.override(pool_bytes=0):
        ref = step()
    workspace.release()
    with torch_impl.SETTINGS.override(huge_min_bytes=1):
        for _ in range(2):
            out = step()
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert workspace.POOL.held_bytes() > 0
    workspace.release()
