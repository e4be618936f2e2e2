"""The public surface: names, signatures, docstrings, no triton at import, unknown backend errors."""

from __future__ import annotations

import inspect

import pytest
import torch

import sparseops
from sparseops import testing

#: the fixed public signatures (CANN parameter names in snake_case), positional-or-keyword then keyword-only
SIGNATURES = {
    "moe_token_permute_with_ep": (
        ["tokens", "indices", "probs", "range", "num_out_tokens", "padded_mode"],
        ["num_experts", "backend", "validate"],
    ),
    "moe_token_unpermute_with_ep": (
        ["permuted_tokens", "sorted_indices", "probs", "topk_num", "range", "padded_mode", "restore_shape"],
        ["backend", "validate"],
    ),
    "moe_token_unpermute_with_ep_grad": (
        ["unpermuted_tokens_grad", "sorted_indices", "permuted_tokens", "probs", "padded_mode", "restore_shape",
         "range", "topk_num"],
        ["backend", "validate"],
    ),
    "moe_token_permute_with_ep_grad": (
        ["permuted_tokens_grad", "sorted_indices", "permuted_probs_grad", "topk_num", "range", "padded_mode"],
        ["backend", "validate"],
    ),
    "nsa_selected_attention": (
        ["query", "key", "value", "topk_indices", "scale_value", "head_num", "selected_block_size",
         "selected_block_count"],
        ["atten_mask", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "backend", "validate"],
    ),
    "nsa_selected_attention_grad": (
        ["query", "key", "value", "attention_out", "attention_out_grad", "softmax_max", "softmax_sum",
         "topk_indices"],
        ["scale_value", "selected_block_size", "selected_block_count", "head_num", "actual_seq_qlen",
         "actual_seq_kvlen", "atten_mask", "sparse_mode", "input_layout", "deterministic", "backend", "validate"],
    ),
}
OPS = sorted(SIGNATURES)


def _op(name):
    return getattr(sparseops, name)


def test_all_names_exist_and_are_callable():
    assert sparseops.__all__, "sparseops.__all__ is empty"
    assert len(set(sparseops.__all__)) == len(sparseops.__all__), "duplicate names in __all__"
    for name in sparseops.__all__:
        assert hasattr(sparseops, name), f"sparseops.__all__ names {name!r}, which does not exist"
        if name != "__version__":
            assert callable(getattr(sparseops, name)), f"sparseops.{name} is not callable"
    for name in OPS:
        assert name in sparseops.__all__, f"{name} missing from sparseops.__all__"


def test_version_is_a_string():
    assert isinstance(sparseops.__version__, str)
    assert sparseops.__version__.count(".") >= 1


def test_import_does_not_import_triton_or_dynamo(fresh_python):
    """Nothing heavy at import time: triton (a GPU stack) and torch._dynamo (seconds; the compiled CPU kernels
    import it on first use)."""
    code = (
        "import sys, sparseops, sparseops.testing\n"
        "bad = sorted(m for m in sys.modules if m in ('triton', 'torch._dynamo') or m.startswith('triton.'))\n"
        "print(repr(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = fresh_python(code, drop_env=("TRITON_INTERPRET",))
    assert r.returncode == 0, f"importing sparseops imported triton or torch._dynamo: {r.stdout} {r.stderr}"


@pytest.mark.parametrize("lower, higher", [
    ("sparseops._backend", ("sparseops.moe", "sparseops.nsa")),  # each family hands the dispatcher its FAMILY
    ("sparseops.distributed.parallel, sparseops.distributed.checkpoint", ("sparseops.nn",)),
])
def test_lower_layers_import_no_higher_one(lower, higher, fresh_python):
    """The layering of docs/internals.md: the dispatcher knows no op family, parallelize and the checkpoint
    helpers know no layer (they work with distributed.expert_parallel.ExpertParallelModule)."""
    code = (
        f"import sys, {lower}\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({higher!r}))\n"
        "print(repr(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = fresh_python(code)
    assert r.returncode == 0, f"importing {lower} imported {r.stdout.strip()} {r.stderr[-500:]}"


@pytest.mark.parametrize("name", [n for n in sorted(sparseops.__all__) if n != "__version__"])
def test_public_functions_have_docstrings(name):
    fn = _op(name) if name in SIGNATURES else getattr(sparseops, name)
    doc = inspect.getdoc(fn)
    assert doc and doc.strip(), f"sparseops.{name} has no docstring"
    if name != "is_deterministic":  # takes no argument
        assert "Args:" in doc, f"sparseops.{name}: docstring has no 'Args:' section"
    assert "Returns:" in doc, f"sparseops.{name}: docstring has no 'Returns:' section"


@pytest.mark.parametrize("name", OPS)
def test_signature(name):
    fn = _op(name)
    params = inspect.signature(fn).parameters
    pos = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    kwonly = [p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    want_pos, want_kw = SIGNATURES[name]
    assert pos == want_pos, f"{name}: positional parameters {pos}, expected {want_pos}"
    assert kwonly == want_kw, f"{name}: keyword-only parameters {kwonly}, expected {want_kw}"
    # every op takes backend= and validate= by keyword, defaulting to auto / validated
    assert params["backend"].default == "auto", f"{name}: backend default {params['backend'].default!r}"
    assert params["validate"].default is True, f"{name}: validate default {params['validate'].default!r}"


def _valid_call(name):
    """Tiny valid arguments for each op, so that only the backend keyword is wrong."""
    if name.startswith("moe_"):
        inp = testing.make_moe_inputs(5, 2, 4)
        tokens, indices, probs = inp["tokens"], inp["indices"], inp["probs"]
        from sparseops.moe import reference

        si = reference.sorted_indices_from(indices)
        if name == "moe_token_permute_with_ep":
            return (tokens, indices, probs), {}
        if name == "moe_token_unpermute_with_ep":
            return (torch.randn(10, 4), si, probs, 2), {}
        if name == "moe_token_unpermute_with_ep_grad":
            return (torch.randn(5, 4), si, torch.randn(10, 4), probs), {"topk_num": 2}
        return (torch.randn(10, 4), si, torch.randn(10), 2), {}
    inp = testing.make_nsa_inputs([5, 19], N1=2, N2=1, Dqk=16, Dv=16, K=2)
    q, k, v, topk = inp["query"], inp["key"], inp["value"], inp["topk_indices"]
    seq = {n: inp[n] for n in ("actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")}
    if name == "nsa_selected_attention":
        args = (q, k, v, topk, inp["scale_value"], inp["head_num"], inp["selected_block_size"],
                inp["selected_block_count"])
        return args, seq
    T1, N1 = q.shape[:2]
    stats = torch.ones(T1, N1, 8)
    args = (q, k, v, torch.zeros(T1, N1, 16), torch.randn(T1, N1, 16), stats, stats, topk)
    kw = {n: inp[n] for n in ("scale_value", "selected_block_size", "selected_block_count", "head_num")}
    return args, {**kw, **seq}


@pytest.mark.parametrize("name", OPS)
def test_unknown_backend_is_a_value_error_naming_backend(name):
    fn = _op(name)
    args, kwargs = _valid_call(name)
    fn(*args, **kwargs, backend="reference")  # the arguments themselves are fine
    with pytest.raises(ValueError, match="backend"):
        fn(*args, **kwargs, backend="cuda-magic")
    with pytest.raises(ValueError, match="backend"):
        fn(*args, **kwargs, backend="TORCH")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", "y", "0", "false", "off", "no", "2", ""])
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    # one reading of TRITON_INTERPRET everywhere (_checks.triton_interpret, which every launcher asks), Triton's
    # own: "false" is off, "true" is on
    from sparseops import _checks

    monkeypatch.setenv("TRITON_INTERPRET", value)
    want = value.lower() in ("1", "true", "yes", "on", "y")
    assert _checks.triton_interpret() is want
    getenv_bool = pytest.importorskip("triton._C.libtriton").getenv_bool
    assert getenv_bool("TRITON_INTERPRET", False) is want
