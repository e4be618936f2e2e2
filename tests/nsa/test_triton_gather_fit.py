"""The token-granularity Triton kernels (nsa/triton_gather.py) compiled for real GPUs without one
(``sparseops._triton.offline_compile``, Triton's bundled ``ptxas``): DeepSeek-V3.2's MQA shape (G = 128, Dqk = 192,
Dv = 128, topk 2048) for sm_90 and the largest head dims for sm_80, forward and both backward paths; the shared
memory is checked against each GPU's limit by ``launch``. Needs compiled Triton: skipped under TRITON_INTERPRET."""

from __future__ import annotations

import pytest
import torch

from sparseops import _checks

if _checks.triton_interpret():
    pytest.skip("offline compile needs compiled Triton (TRITON_INTERPRET is set)", allow_module_level=True)
pytest.importorskip("triton")

from sparseops import _triton  # noqa: E402
from sparseops.nsa import triton_gather  # noqa: E402

SHAPES = [
    # arch, G, Dqk, Dv, bs, K, dtype
    (90, 128, 192, 128, 1, 2048, torch.bfloat16),
    (80, 16, 256, 256, 8, 64, torch.float32),
]


@pytest.mark.parametrize("arch, G, Dqk, Dv, bs, K, dtype", SHAPES)
def test_compiles(arch, G, Dqk, Dv, bs, K, dtype):
    T, cu = 5, [0, 5]
    q = torch.zeros(T, G, Dqk, dtype=dtype)
    k = torch.zeros(T, 1, Dqk, dtype=dtype)
    v = torch.zeros(T, 1, Dv, dtype=dtype)
    topk = torch.full((T, 1, K), -1, dtype=torch.int32)
    m, l = torch.zeros(T, G), torch.ones(T, G)
    out = torch.zeros(T, G, Dv, dtype=dtype)
    with _triton.offline_compile(arch) as launches:
        triton_gather.forward(q, k, v, topk, 0.1, bs, cu, cu, True)
        triton_gather.backward(q, k, v, out, out, m, l, topk, 0.1, bs, cu, cu, True, deterministic=False)
        triton_gather.backward(q, k, v, out, out, m, l, topk, 0.1, bs, cu, cu, True, deterministic=True)
    names = [getattr(x, "kernel", x) for x in launches]
    assert len(names) == 3, names
