"""``sparseops._backend``: which backend ``auto`` picks (no CUDA needed: the choice is a pure function of device,
dtype and what imports), the errors of a missing Triton module, and the dispatcher's contract."""

import sys

import pytest
import torch

import sparseops
from sparseops import _backend, _checks
from sparseops.moe.api import FAMILY as MOE
from sparseops.nsa.api import FAMILY as NSA


@pytest.fixture
def triton_importable(monkeypatch):
    monkeypatch.setattr(_checks, "triton_available", lambda: True)


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        ("cpu", torch.float32, ("torch", False)),
        ("cuda", torch.bfloat16, ("triton", True)),  # True: auto chose Triton (a kernel that does not fit: torch)
        ("cuda", torch.float32, ("triton", True)),
        ("cuda", torch.float64, ("torch", False)),  # the kernels take fp32/fp16/bf16; float64 is a testing dtype
    ],
    ids=["cpu", "cuda-bf16", "cuda-fp32", "cuda-fp64-falls-back"],
)
def test_auto_backend(triton_importable, device, dtype, expected):
    assert _backend.resolve(NSA, "auto", torch.device(device), dtype) == expected


def test_triton_on_cpu_is_a_clear_error():
    grad, si = torch.randn(3, 4), torch.arange(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        sparseops.moe_token_unpermute_with_ep_grad(grad, si, topk_num=2, backend="triton")


def _without_triton_module(monkeypatch):
    """Importing ``sparseops.moe.triton_impl`` fails, even after another test imported it."""
    import sparseops.moe

    monkeypatch.setitem(sys.modules, "sparseops.moe.triton_impl", None)
    monkeypatch.delattr(sparseops.moe, "triton_impl", raising=False)


def test_missing_triton_module_is_a_clear_error(monkeypatch):
    _without_triton_module(monkeypatch)
    with pytest.raises(ValueError, match="backend: 'triton'"):
        _backend.module(MOE, "triton")


def test_auto_falls_back_to_torch_when_the_triton_module_is_missing(monkeypatch):
    _without_triton_module(monkeypatch)
    monkeypatch.setattr(_checks, "resolve_backend", lambda backend, device: "triton" if backend == "auto" else backend)
    cpu = torch.device("cpu")
    assert _backend.resolve(MOE, "auto", cpu) == ("torch", False)
    with pytest.raises(ValueError, match="backend: 'triton'"):
        _backend.resolve(MOE, "triton", cpu)


def test_backends_are_called_by_keyword_with_one_signature_each():
    # call() passes arguments by name: every backend module of a family takes the same parameter names
    import inspect

    for family in (MOE, NSA):
        for fn in family.functions:
            params = [list(inspect.signature(getattr(_backend.module(family, name), fn)).parameters)
                      for name in ("reference", "torch", "triton")]
            assert params[0] == params[1] == params[2], (family, fn, params)


def test_call_runs_the_named_function_and_rejects_unknown_ones():
    si = torch.tensor([1, 0, 2, 3], dtype=torch.int32)
    x = torch.randn(4, 3)
    got = _backend.call(MOE, "torch", "unpermute", permuted_tokens=x, sorted_indices=si, probs=None, K=2, s=0, e=4)
    want = _backend.module(MOE, "reference").unpermute(x, si, None, 2, 0, 4)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="fn: expected one of"):
        _backend.call(MOE, "torch", "forward")
    with pytest.raises(TypeError, match="family: expected a sparseops._backend.Family"):
        _backend.module("moe", "torch")
    with pytest.raises(ValueError, match="backend: expected 'reference', 'torch' or 'triton'"):
        _backend.module(NSA, "auto")


def test_auto_reruns_on_torch_where_a_kernel_does_not_fit_and_remembers_the_shape(monkeypatch):
    # what auto does on a GPU whose shared memory is too small for a kernel, with a stand-in Triton module
    from sparseops import _triton

    calls = []

    def forward(**kw):
        calls.append("triton")
        raise _triton.DoesNotFit("nsa_fwd_kernel needs 300000 bytes of shared memory")

    fake = type(sys)("fake_triton_impl")
    fake.forward, fake.backward = forward, forward
    real = _backend.module

    monkeypatch.setattr(_backend, "module", lambda family, name: fake if name == "triton" else real(family, name))
    monkeypatch.setattr(_backend, "_DOES_NOT_FIT", set())
    a = sparseops.testing.make_nsa_inputs([5, 7], N1=2, N2=1, Dqk=16, Dv=16, K=2, dtype=torch.float32)
    cu = [0, 5, 12]
    kw = dict(q=a["query"], k=a["key"], v=a["value"], topk=a["topk_indices"], scale=0.25, bs=16, cu_q=cu,
              cu_kv=cu, causal=True)
    want = _backend.call(NSA, "torch", "forward", **kw)
    with pytest.warns(RuntimeWarning, match="backend='auto' runs this shape on the torch path"):
        got = _backend.call(NSA, "triton", "forward", fallback_key=("shape",), **kw)
    assert calls == ["triton"] and all(torch.equal(x, y) for x, y in zip(got, want))
    again = _backend.call(NSA, "triton", "forward", fallback_key=("shape",), **kw)  # remembered: no try
    assert calls == ["triton"] and all(torch.equal(x, y) for x, y in zip(again, want))
    with pytest.raises(_triton.DoesNotFit):  # without a fallback key (an explicit "triton"): the error
        _backend.call(NSA, "triton", "forward", **kw)
    _backend.forget_fits()
    with pytest.warns(RuntimeWarning):
        _backend.call(NSA, "triton", "forward", fallback_key=("shape",), **kw)
    assert calls == ["triton"] * 3
