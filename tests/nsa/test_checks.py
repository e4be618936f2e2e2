"""``sparseops.nsa.checks`` through the public ops: bad input (docs/nsa.md): each case raises the right exception naming the argument, through the forward and
the seed backward (one shared checker), before anything runs, and leaves the caller's tensors untouched."""

import pytest
import torch

import sparseops
from sparseops.testing import make_nsa_inputs

FWD_ONLY = ("query", "key", "value", "topk_indices", "scale_value", "head_num", "selected_block_size",
            "selected_block_count", "atten_mask", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")


def _base():
    a = make_nsa_inputs([5, 11], [9, 40], N1=4, N2=2, Dqk=16, Dv=8, bs=16, K=2, dtype=torch.float32)
    out, m, l = sparseops.nsa_selected_attention(**a)
    a.update(atten_mask=None, attention_out=out, attention_out_grad=torch.randn_like(out), softmax_max=m,
             softmax_sum=l, input_layout="TND")
    return a


def _assign(**kw):
    return lambda a: a.update(kw)


def _topk_val(t, n2, j, val):
    def f(a):
        a["topk_indices"] = a["topk_indices"].clone()
        a["topk_indices"][t, n2, j] = val
    return f


def _tensor(name, fn):
    return lambda a: a.update({name: fn(a[name])})


# id, mutation, exception, text that must appear in the message, applies to the forward too
CASES = [
    ("query-not-tensor", _assign(query=[1.0]), TypeError, "query", True),
    ("query-2d", _tensor("query", lambda t: t[:, 0]), ValueError, "query", True),
    ("query-int", _tensor("query", lambda t: t.long()), TypeError, "query", True),
    ("key-dtype", _tensor("key", lambda t: t.half()), TypeError, "key", True),
    ("value-dtype", _tensor("value", lambda t: t.double()), TypeError, "value", True),
    ("key-Dqk", _tensor("key", lambda t: t[..., :8]), ValueError, "key", True),
    ("value-T2", _tensor("value", lambda t: t[:-1]), ValueError, "value", True),
    ("value-N2", _tensor("value", lambda t: t[:, :1]), ValueError, "value", True),
    ("Dv>Dqk", _tensor("value", lambda t: torch.cat([t, t, t], -1)), ValueError, "Dv", True),
    ("Dqk>256", lambda a: a.update(query=torch.zeros(16, 4, 264), key=torch.zeros(49, 2, 264)), ValueError,
     "Dqk", True),
    ("head_num", _assign(head_num=2), ValueError, "head_num", True),
    ("N1%N2", lambda a: a.update(key=torch.zeros(49, 3, 16), value=torch.zeros(49, 3, 8),
                                 topk_indices=torch.zeros(16, 3, 2, dtype=torch.int32)), ValueError, "N2", True),
    ("G>32", lambda a: a.update(query=torch.zeros(16, 66, 16), head_num=66), ValueError, "G", True),
    ("topk-float", _tensor("topk_indices", lambda t: t.float()), TypeError, "topk_indices", True),
    ("topk-T1", _tensor("topk_indices", lambda t: t[:-1]), ValueError, "topk_indices", True),
    ("topk-N2", _tensor("topk_indices", lambda t: t[:, :1]), ValueError, "topk_indices", True),
    ("K!=topk", _assign(selected_block_count=3), ValueError, "selected_block_count", True),
    ("K=0", _assign(selected_block_count=0), ValueError, "selected_block_count", True),
    ("K>128", _assign(selected_block_count=129), ValueError, "selected_block_count", True),
    ("K*bs>8192", _assign(selected_block_count=128, selected_block_size=128), ValueError, "8192", True),
    ("bs-not-16x", _assign(selected_block_size=24), ValueError, "selected_block_size", True),
    ("bs<16", _assign(selected_block_size=0), ValueError, "selected_block_size", True),
    ("bs>128", _assign(selected_block_size=144), ValueError, "selected_block_size", True),
    ("bs-float", _assign(selected_block_size=16.0), TypeError, "selected_block_size", True),
    ("K-bool-tensor", _assign(selected_block_count=torch.tensor(True)), TypeError, "selected_block_count", True),
    ("scale-str", _assign(scale_value="0.1"), TypeError, "scale_value", True),
    ("scale-nan", _assign(scale_value=float("nan")), ValueError, "scale_value", True),
    ("scale-int-overflows-float", _assign(scale_value=10**400), ValueError, "scale_value", True),
    ("query-sparse-layout", _tensor("query", lambda t: t.to_sparse()), TypeError, "query", True),
    ("topk-sparse-layout", _tensor("topk_indices", lambda t: t.to_sparse()), TypeError, "topk_indices", True),
    ("sparse_mode=1", _assign(sparse_mode=1), ValueError, "sparse_mode", True),
    ("layout-BSND", _assign(input_layout="BSND"), ValueError, "input_layout", False),
    ("mask-3d", _assign(atten_mask=torch.zeros(1, 4, 4, dtype=torch.bool)), ValueError, "atten_mask", True),
    ("mask-float", _assign(atten_mask=torch.zeros(4, 4)), TypeError, "atten_mask", True),
    ("cu-q-decreasing", _assign(actual_seq_qlen=[11, 5, 16]), ValueError, "actual_seq_qlen", True),
    ("cu-q-not-T1", _assign(actual_seq_qlen=[5, 15]), ValueError, "actual_seq_qlen", True),
    ("cu-kv-not-T2", _assign(actual_seq_kvlen=[9, 48]), ValueError, "actual_seq_kvlen", True),
    ("cu-count-differs", _assign(actual_seq_qlen=[5, 10, 16]), ValueError, "actual_seq_kvlen", True),
    ("cu-float-elem", _assign(actual_seq_qlen=[5.0, 16.0]), TypeError, "actual_seq_qlen", True),
    ("block-id-past-seq", _topk_val(0, 0, 0, 1), ValueError, "topk_indices", True),  # seq 0 has S2=9: 1 block
    ("block-id-below-minus-1", _topk_val(7, 1, 1, -2), ValueError, "topk_indices", True),
    ("block-id-past-seq2", _topk_val(15, 0, 1, 3), ValueError, "topk_indices", True),  # S2=40: ids < 3
    ("backend-unknown", _assign(backend="cuda"), ValueError, "backend", True),
    ("validate-not-bool", _assign(validate=1), TypeError, "validate", True),
    ("stats-shape", _tensor("softmax_max", lambda t: t[..., :1]), ValueError, "softmax_max", False),
    ("stats-dtype", _tensor("softmax_sum", lambda t: t.half()), TypeError, "softmax_sum", False),
    ("out-shape", _tensor("attention_out", lambda t: t[:, :2]), ValueError, "attention_out", False),
    ("dout-dtype", _tensor("attention_out_grad", lambda t: t.bfloat16()), TypeError, "attention_out_grad", False),
    ("deterministic-str", _assign(deterministic="yes"), TypeError, "deterministic", False),
]


def _call_fwd(a):
    kw = {n: a[n] for n in FWD_ONLY}
    for extra in ("backend", "validate"):
        if extra in a:
            kw[extra] = a[extra]
    return sparseops.nsa_selected_attention(**kw)


def _call_grad(a):
    pos = [a[n] for n in ("query", "key", "value", "attention_out", "attention_out_grad", "softmax_max",
                          "softmax_sum", "topk_indices")]
    kw = {n: a[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num",
                            "actual_seq_qlen", "actual_seq_kvlen", "atten_mask", "sparse_mode", "input_layout")}
    for extra in ("backend", "validate", "deterministic"):
        if extra in a:
            kw[extra] = a[extra]
    return sparseops.nsa_selected_attention_grad(*pos, **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, untouched):
    _, mutate, exc, text, fwd_too = case
    a = _base()
    mutate(a)
    check = untouched(a)
    calls = [_call_grad] + ([_call_fwd] if fwd_too else [])
    for call in calls:
        with pytest.raises(exc, match=text):
            call(a)
    check()


def test_validate_false_skips_the_block_id_check_only():
    a = _base()
    _topk_val(15, 0, 1, 3)(a)
    a["validate"] = False
    out, m, l = _call_fwd(a)  # the out-of-range slot is ignored (undefined behaviour per docs/nsa.md, here masked)
    assert torch.isfinite(out).all()
    _assign(head_num=2)(a)
    with pytest.raises(ValueError, match="head_num"):
        _call_fwd(a)


def test_public_check_names():
    # the CANN layer reuses these instead of a copy of its own
    from sparseops.nsa import checks

    a = _base()
    got = checks.check_args(a["query"], a["key"], a["value"], a["topk_indices"], a["scale_value"], a["head_num"],
                            a["selected_block_size"], a["selected_block_count"], None, a["actual_seq_qlen"],
                            a["actual_seq_kvlen"], a["sparse_mode"], "TND", True)
    assert got == (a["scale_value"], 16, [0, 5, 16], [0, 9, 49], True, torch.device("cpu"))
    topk = a["topk_indices"].clone()
    topk[0, 0, 0] = 1  # sequence 0 has ceil(9 / 16) = 1 block
    with pytest.raises(ValueError, match=r"topk_indices: .*got 1 at \[0, 0, 0\]"):
        checks.check_block_ids(topk, 16, [0, 5, 16], [0, 9, 49])
