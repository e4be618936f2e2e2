"""The C++ CPU kernels of NSA selected attention (``sparseops.nsa.cpu_gather``; docs/nsa.md "The C++ CPU path")
against the float64 reference: output, stats and every gradient, every dtype, blocks and token granularity, G
from 1 to 128 (partial vector lanes), odd head dims, varlen with empty sequences, -1 slots and duplicates; the
torch backend routing to them; bitwise-repeatable backward; invisible keys never read; the fallback when they
cannot be built."""

import warnings

import pytest
import torch

import sparseops
from sparseops import _cpu_attention
from sparseops._varlen import normalize_cu_seqlens
from sparseops.nsa import cpu_gather, reference, torch_impl, torch_plan
from sparseops.testing import assert_close, make_nsa_inputs, torch_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

CASES = [
    # id; seqlens_q, seqlens_kv, N1, N2, Dqk, Dv, bs, K, causal, empty_frac, duplicates
    ("bs1-varlen-len0", [9, 0, 23], [11, 2, 23], 4, 2, 16, 8, 1, 7, True, 0.2, True),
    ("bs2-G20-noncausal", [13, 6], [20, 6], 20, 1, 24, 24, 2, 5, False, 0.3, True),
    ("bs4-S2-not-multiple", [19], [19], 6, 3, 17, 12, 4, 3, True, 0.0, False),
    ("bs8-kv-longer", [5, 7], [30, 17], 3, 1, 8, 8, 8, 2, True, 0.1, True),
    ("mqa-G128", [6], None, 128, 1, 8, 8, 1, 4, True, 0.0, False),
    ("bs16-G16-dups", [40, 3], [40, 35], 16, 1, 32, 17, 16, 3, True, 0.1, True),
    ("bs32-G1-noncausal", [17, 30], [17, 64], 2, 2, 16, 16, 32, 4, False, 0.3, True),
    ("bs64-G16-D128", [130], None, 32, 2, 128, 128, 64, 3, True, 0.0, False),
    ("head-dim-256", [24], None, 8, 1, 256, 72, 16, 2, True, 0.0, False),
    # blocks of 128 (two visits of 64 each), tiles of 8 tokens across sequences and an empty one, duplicates
    ("bs128-tiles-across-seqs", [5, 0, 21, 12], [5, 0, 300, 12], 16, 1, 24, 20, 128, 3, True, 0.2, True),
]


pytestmark = pytest.mark.usefixtures("nan_uninitialised")


@pytest.fixture(autouse=True)
def _built():
    if not cpu_gather.available(torch.zeros(1)):
        pytest.skip(f"the C++ CPU kernels are not built here: {cpu_gather.EXTENSION.state['failed']}")


def _inputs(case, dtype, seed=0):
    _, sq, skv, N1, N2, Dqk, Dv, bs, K, causal, ef, dup = case
    return make_nsa_inputs(sq, skv, N1=N1, N2=N2, Dqk=Dqk, Dv=Dv, bs=bs, K=K, dtype=dtype, causal=causal,
                           empty_frac=ef, duplicates=dup, seed=seed)


def _args(a):
    cu_q = normalize_cu_seqlens("q", a["actual_seq_qlen"], a["query"].shape[0])
    cu_kv = normalize_cu_seqlens("kv", a["actual_seq_kvlen"], a["key"].shape[0])
    return a["topk_indices"], a["scale_value"], a["selected_block_size"], cu_q, cu_kv, a["sparse_mode"] == 2


def _qkv(a):
    return a["query"], a["key"], a["value"]


def _dout(a, dtype):
    shape = (*a["query"].shape[:2], a["value"].shape[2])
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)


def _cpp(a, dout):
    q, k, v = _qkv(a)
    out, m, l = cpu_gather.forward(q, k, v, *_args(a))
    return (out, m, l, *cpu_gather.backward(q, k, v, out, dout, m, l, *_args(a)))


def _ref(a, dout):
    q, k, v = (x.double() for x in _qkv(a))
    out, m, l = reference.forward(q, k, v, *_args(a))
    return (out, m, l, *reference.backward(q, k, v, out, dout.double(), m, l, *_args(a)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_reference(case, dtype):
    a = _inputs(case, dtype)
    dout = _dout(a, dtype)
    got = _cpp(a, dout)
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"), got, _ref(a, dout)):
        assert_close(x, y, dtype, name=name)
    q, k, v = _qkv(a)
    assert got[0].dtype == q.dtype and got[3].dtype == q.dtype and got[4].dtype == k.dtype
    assert got[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def _spy(monkeypatch):
    calls = []
    for fn in ("forward", "backward"):
        real = getattr(cpu_gather, fn)
        monkeypatch.setattr(cpu_gather, fn, lambda *x, _r=real, _f=fn, **kw: calls.append(_f) or _r(*x, **kw))
    return calls


@pytest.mark.parametrize("case, routed", [(CASES[0], True), (CASES[5], True), (CASES[6], False)],
                         ids=["token-granularity", "G16", "G1-blocks"])
def test_torch_backend_routes_where_they_suit(case, routed, monkeypatch):
    """The torch backend takes the kernels for token granularity and for G >= 16 (fp32), and keeps its own
    block tiles for few heads per KV head; either way the result is the reference's."""
    calls = _spy(monkeypatch)
    a = _inputs(case, torch.float32)
    q, k, v = (a[n].clone().requires_grad_() for n in ("query", "key", "value"))
    kw = {n: a[n] for n in a if n not in ("query", "key", "value")}
    out, m, l = sparseops.nsa_selected_attention(q, k, v, backend="torch", **kw)
    dout = _dout(a, torch.float32)
    out.backward(dout)
    assert calls == (["forward", "backward"] if routed else [])
    for name, x, y in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), _ref(a, dout)[:1] + _ref(a, dout)[3:]):
        assert_close(x, y, torch.float32, name=name)


def test_knob_and_environment_turn_them_off(override, monkeypatch):
    calls = _spy(monkeypatch)
    a = _inputs(CASES[0], torch.float32)
    with torch_plan.SETTINGS.override(cpu_kernels=False):
        torch_impl.forward(*_qkv(a), *_args(a))
    monkeypatch.setenv("SPARSEOPS_CPU_KERNELS", "0")
    assert not cpu_gather.available(a["query"])
    torch_impl.forward(*_qkv(a), *_args(a))
    assert calls == []


def test_backward_bitwise_repeatable_and_threads_agree(monkeypatch):
    a = _inputs(CASES[7], torch.float32, seed=3)
    dout = _dout(a, torch.float32)
    r1, r2 = _cpp(a, dout), _cpp(a, dout)
    for x, y in zip(r1, r2):
        assert torch.equal(x, y)
    for n in (1, 3):
        with torch_threads(n):
            for x, y in zip(_cpp(a, dout), r1):
                assert_close(x, y, torch.float32)
    monkeypatch.setattr(_cpu_attention, "TASK_BYTES", 1)  # one dK / dV buffer: the same sums up to rounding
    for x, y in zip(_cpp(a, dout), r1):
        assert_close(x, y, torch.float32)


def test_invisible_keys_are_never_read():
    """NaN in every key and value no query sees (causal future, -1 slots' blocks, the tail past S2) leaves
    every output and gradient finite and equal to the clean inputs' result."""
    a = _inputs(("causal", [48], None, 16, 1, 16, 16, 16, 2, True, 0.0, False), torch.float32)
    topk = a["topk_indices"].clone()
    topk[:, :, 1] = -1
    topk[:, :, 0] = 0
    a["topk_indices"] = topk
    dout = _dout(a, torch.float32)
    clean = _cpp(a, dout)
    a["key"], a["value"] = a["key"].clone(), a["value"].clone()
    a["key"][16:], a["value"][16:] = float("nan"), float("nan")
    dirty = _cpp(a, dout)
    for x, y in zip(clean[:4], dirty[:4]):
        assert torch.equal(x, y)
    assert torch.equal(clean[4][:16], dirty[4][:16]) and torch.equal(clean[5][:16], dirty[5][:16])
    assert dirty[4][16:].abs().max() == 0 and dirty[5][16:].abs().max() == 0


def test_rows_with_no_key_and_empty_inputs():
    a = _inputs(CASES[5], torch.float32)
    a["topk_indices"] = torch.full_like(a["topk_indices"], -1)
    out, m, l, dq, dk, dv = _cpp(a, _dout(a, torch.float32))
    assert all(x.abs().max() == 0 for x in (out, m, l, dq, dk, dv))
    q, k, v = _qkv(a)
    e = cpu_gather.forward(q[:0], k, v, a["topk_indices"][:0], 0.5, 16, [0, 0], [0, k.shape[0]], True)
    assert [x.shape[0] for x in e] == [0, 0, 0]
    g = cpu_gather.backward(q[:0], k, v, e[0], e[0], e[1], e[2], a["topk_indices"][:0], 0.5, 16, [0, 0],
                            [0, k.shape[0]], True)
    assert g[0].shape[0] == 0 and g[1].abs().max() == 0 and g[2].abs().max() == 0


def test_huge_scores_stay_finite():
    """A score that overflows fp32 is held at the largest finite value, as on the torch path."""
    a = _inputs(CASES[5], torch.float32)
    a["query"] = a["query"] * 1e20
    out, m, l, dq, dk, dv = _cpp(a, _dout(a, torch.float32))
    assert torch.isfinite(out).all() and torch.isfinite(m).all() and torch.isfinite(l).all()


def test_failed_build_warns_once_and_the_torch_path_runs(monkeypatch):
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(cpu_gather.EXTENSION, "state", {"module": None, "failed": None})

    def fail(*_, **__):
        raise OSError("no compiler here")

    monkeypatch.setattr(ext, "load", fail)
    a = _inputs(CASES[0], torch.float32)
    with pytest.warns(RuntimeWarning, match="could not be built.*no compiler here"):
        assert not cpu_gather.available(a["query"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _, _ = torch_impl.forward(*_qkv(a), *_args(a))
    assert_close(out, _ref(a, _dout(a, torch.float32))[0], torch.float32)


# block ids whose id * bs overflows int64 or wraps to a row before k (validate=False and torch.compile pass them
# unchecked), the most negative id, and the first ids past the sequence's block count
HUGE_IDS = [2**60 - 1, 2**60 - 2**36, 2**62 - 1, 2**63 - 1, -(2**63), -2]


@pytest.mark.parametrize("bs", [16, 4, 1], ids=["blocks", "token-granularity", "bs1"])
def test_out_of_range_ids_are_empty_slots(bs, monkeypatch):
    """Ids outside [0, ceil(S2 / bs)) reach the kernels with validate=False: each is an empty slot, so the
    forward and every gradient equal (bitwise) the same call with those ids set to -1."""
    calls = _spy(monkeypatch)
    T, G, K = 32, 16, 4
    a = make_nsa_inputs([T], None, N1=G, N2=1, Dqk=16, Dv=16, bs=bs, K=K, dtype=torch.float32, causal=True, seed=5)
    blocks = -(-T // bs)
    bad = torch.tensor(HUGE_IDS + [blocks, blocks + 1])
    topk = a["topk_indices"].to(torch.int64)  # int64: the huge ids do not fit the builder's int32
    topk[:, :, 1] = bad[torch.arange(T) % len(bad)][:, None]
    topk[:, :, 3] = bad.flip(0)[torch.arange(T) % len(bad)][:, None]
    kw = {n: a[n] for n in a if n not in ("query", "key", "value", "topk_indices")}
    dout = _dout(a, torch.float32)

    def run(ids):
        q, k, v = (a[n].clone().requires_grad_() for n in ("query", "key", "value"))
        out, m, l = sparseops.nsa_selected_attention(q, k, v, ids, backend="torch", validate=False, **kw)
        out.backward(dout)
        return out, m, l, q.grad, k.grad, v.grad

    got, want = run(topk), run(torch.where((topk < 0) | (topk >= blocks), -1, topk))
    assert calls == ["forward", "backward"] * 2
    for name, x, y in zip(("out", "m", "l", "dq", "dk", "dv"), got, want):
        assert torch.equal(x, y), name


def test_head_mean_probs_out_of_range_positions_are_empty():
    """The DSA loss's target (bs = 1 positions, unchecked under torch.compile): a position outside [0, S) of its
    sequence gives 0, as -1 does, and leaves the other slots' values unchanged."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(20, 16, 8, generator=g), torch.randn(20, 1, 8, generator=g)
    cu = [0, 12, 20]
    idx = torch.randint(0, 8, (20, 6), generator=g)
    idx[:, 2] = torch.tensor(HUGE_IDS + [12, 13, 8])[torch.arange(20) % 9]
    idx[12:, 4] = 8  # past the second sequence's 8 keys
    lens = torch.tensor([12] * 12 + [8] * 8)[:, None]
    want = cpu_gather.head_mean_probs(q, k, torch.where((idx < 0) | (idx >= lens), -1, idx), 0.3, cu)
    got = cpu_gather.head_mean_probs(q, k, idx, 0.3, cu)
    assert torch.equal(got, want)
