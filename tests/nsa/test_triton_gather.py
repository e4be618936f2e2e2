"""The token-granularity Triton kernels (nsa/triton_gather.py) against the float64 reference: forward, stats and
every gradient, both dK/dV paths (atomics, and the deterministic workspace: bitwise repeatable), several head
blocks, varlen, -1 slots, duplicates, non-causal, through the public op.

Runs where CUDA is available, or on the CPU under the Triton interpreter, in its own process:
``TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee python -m pytest tests/nsa/test_triton_gather.py``.
"""

from __future__ import annotations

import pytest
import torch

from sparseops import _checks

if not _checks.triton_interpret() and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

import sparseops  # noqa: E402
from sparseops._varlen import normalize_cu_seqlens  # noqa: E402
from sparseops.nsa import reference, triton_gather  # noqa: E402
from sparseops.testing import assert_close, make_nsa_inputs  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cpu" if _checks.triton_interpret() else "cuda"

CASES = [
    # id; seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, bs, K, causal, empty_frac, duplicates
    ("bs1-varlen-dups", [6, 0, 9], [8, 3, 9], 4, 2, 16, 8, 1, 5, True, 0.2, True),
    ("bs4-noncausal-G3", [7], [13], 3, 1, 24, 24, 4, 3, False, 0.0, False),
    ("bs8-G1", [5, 4], [17, 9], 2, 2, 8, 8, 8, 2, True, 0.1, True),
    ("bs2-G80-two-head-blocks", [4], None, 80, 1, 16, 16, 2, 20, True, 0.0, False),
]


def _inputs(case, seed=0):
    _, sq, skv, N1, N2, Dqk, Dv, bs, K, causal, ef, dup = case
    return make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=bs, K=K, causal=causal, empty_frac=ef,
                           duplicates=dup, seed=seed, device=DEVICE)


def _args(a):
    cu_q = normalize_cu_seqlens("q", a["actual_seq_qlen"], a["query"].shape[0])
    cu_kv = normalize_cu_seqlens("kv", a["actual_seq_kvlen"], a["key"].shape[0])
    return (a["topk_indices"], a["scale_value"], a["selected_block_size"], cu_q, cu_kv, a["sparse_mode"] == 2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case, deterministic):
    a = _inputs(case)
    q, k, v = a["query"], a["key"], a["value"]
    args = _args(a)
    out, m, l = triton_gather.forward(q, k, v, *args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dq, dk, dv = triton_gather.backward(q, k, v, out, dout, m, l, *args, deterministic=deterministic)
    r = [t.cpu().double() for t in (q, k, v)]
    rargs = (a["topk_indices"].cpu(), *args[1:])
    r_out, r_m, r_l = reference.forward(*r, *rargs)
    r_dq, r_dk, r_dv = reference.backward(*r, r_out, dout.cpu().double(), r_m, r_l, *rargs)
    for name, got, want in (("out", out, r_out), ("m", m, r_m), ("l", l, r_l), ("dq", dq, r_dq), ("dk", dk, r_dk),
                            ("dv", dv, r_dv)):
        assert_close(got.cpu(), want, torch.float32, name=name)


def test_deterministic_backward_is_bitwise_repeatable(monkeypatch):
    a = _inputs(CASES[0], seed=1)
    q, k, v = a["query"], a["key"], a["value"]
    args = _args(a)
    out, m, l = triton_gather.forward(q, k, v, *args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    monkeypatch.setattr(triton_gather, "WORKSPACE_BYTES", 1)  # one token per workspace chunk
    g1 = triton_gather.backward(q, k, v, out, dout, m, l, *args, deterministic=True)
    g2 = triton_gather.backward(q, k, v, out, dout, m, l, *args, deterministic=True)
    for x, y in zip(g1, g2):
        assert torch.equal(x, y)


def test_public_op_runs_the_gather_kernels():
    a = _inputs(CASES[1])
    kw = {n: a[n] for n in ("topk_indices", "scale_value", "head_num", "selected_block_size",
                            "selected_block_count", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    q, k, v = (a[n].clone().requires_grad_() for n in ("query", "key", "value"))
    out = sparseops.nsa_selected_attention(q, k, v, backend="triton", **kw)[0]
    out.sum().backward()
    ref = sparseops.nsa_selected_attention(*(a[n].cpu().double() for n in ("query", "key", "value")),
                                           backend="reference", **{**kw, "topk_indices": kw["topk_indices"].cpu()})
    assert_close(out.cpu(), ref[0], torch.float32)
    assert q.grad is not None and torch.isfinite(k.grad).all()
