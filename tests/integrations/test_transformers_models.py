"""experts_implementation="sparseops" in a whole tiny model of every transformers MoE family.

The families whose modeling file decorates an experts class (``experts_families``: a new transformers family is
picked up without a list here), each as a 2-layer model built from its own config classes
(``transformers_cases.tiny_family_model``; text-only inputs for multimodal families), every parameter random.
The five families of test_transformers_experts.py are tested there. Against the stock ``eager`` experts in float64:
the logits and the gradient of every parameter after a backward of a scalar loss, sparseops in float64 and fp32.
Then greedy ``generate`` on a left-padded batch (eager's tokens and logits) and ``from_pretrained(..., experts_implementation="sparseops")`` on a few families.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23", reason="needs the sparseops[transformers] extra")

from sparseops.testing import TOLERANCES, assert_close, rel_rms_error  # noqa: E402

from .test_transformers_experts import CONFIGS  # noqa: E402
from .transformers_cases import experts_families, experts_modules, tiny_family_model  # noqa: E402

#: families whose own eager experts compute in fp32 inside a float64 model, so the float64 comparison is only
#: fp32-exact: beam's and inkling2's gates, muse_spark's post-expert norm, openai_privacy_filter's GEMMs, and
#: nemotron_h's accumulator (``zeros_like(hidden_states, dtype=top_k_weights.dtype)``: the fp32 router weights)
FP32_EXACT = {"beam", "inkling2", "inkling2_loop", "muse_spark", "nemotron_h", "openai_privacy_filter"}

FAMILIES = [f for f in experts_families() if f not in CONFIGS]


@pytest.fixture(scope="module", autouse=True)
def _register():
    import sparseops.integrations.transformers  # noqa: F401


def _ids(shape=(2, 9), seed=1):
    return torch.randint(3, 64, shape, generator=torch.Generator().manual_seed(seed))


def run_model(model, impl: str, ids):
    """Logits and every parameter's gradient of ``mean(logits ** 2)``, with the experts implementation ``impl``."""
    model.set_experts_implementation(impl)
    assert all(e.config._experts_implementation == impl for e in experts_modules(model))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # families that sample in the forward (DiffusionGemma's canvas)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a sparseops fallback fails the family
        logits = model(input_ids=ids).logits
    logits.double().pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_model_logits_and_every_gradient_match_eager(family):
    ids = _ids()
    model = tiny_family_model(family)
    assert experts_modules(model), f"{family}: the tiny config has no MoE layer"
    ref_logits, ref_grads = run_model(model, "eager", ids)
    # eager's own fp32 error per tensor: a gradient near zero (an unused router bias) is only that exact
    e32_logits, e32_grads = run_model(copy.deepcopy(model).to(torch.float32), "eager", ids)
    floor = {n: rel_rms_error(g, ref_grads[n]) for n, g in e32_grads.items()}
    floor["logits"] = rel_rms_error(e32_logits, ref_logits)
    for dtype in (torch.float64, torch.float32):
        m = copy.deepcopy(model)
        if dtype != torch.float64:
            m = m.to(dtype)
        logits, grads = run_model(m, "sparseops", ids)
        assert set(grads) == set(ref_grads), f"{family}: gradients of {set(ref_grads) ^ set(grads)} differ in presence"
        if dtype == torch.float64:
            tol = torch.float32 if family in FP32_EXACT else torch.float64
            assert_close(logits, ref_logits, tol, f"{family} float64 logits")
            for name, ref in ref_grads.items():
                assert_close(grads[name], ref, tol, f"{family} float64 grad {name}")
        else:
            for name, got, ref in [("logits", logits, ref_logits)] + [(n, grads[n], r) for n, r in ref_grads.items()]:
                err = rel_rms_error(got, ref)
                assert err <= max(TOLERANCES[dtype], 2 * floor[name]), (
                    f"{family} fp32 {name}: relative RMS error {err:.3e} > tolerance {TOLERANCES[dtype]:.0e} "
                    f"and > 2x eager's own fp32 error {floor[name]:.3e}")


# multimodal, hybrid Mamba / conv, MLA, no-gate, per-layer-input and DSA-indexer families
GENERATE_FAMILIES = ["deepseek_v2", "gemma4", "glm4v_moe", "granitemoehybrid", "jamba", "lfm2_moe", "nemotron_h",
                     "qwen3_vl_moe"]


@pytest.mark.parametrize("family", GENERATE_FAMILIES)
def test_generate_and_from_pretrained_with_sparseops(family, tmp_path):
    model = tiny_family_model(family).to(torch.float32)
    ids = _ids((2, 5))
    out = {}
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    for impl in ("eager", "sparseops"):
        model.set_experts_implementation(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out[impl] = model.generate(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=4,
                                       do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True)
    assert out["sparseops"].sequences.shape == (2, 9)
    assert torch.equal(out["sparseops"].sequences, out["eager"].sequences)
    for step, (got, ref) in enumerate(zip(out["sparseops"].logits, out["eager"].logits)):
        assert_close(got, ref, torch.float32, f"{family} generate logits, step {step}")
    model.set_experts_implementation("eager")
    model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path, experts_implementation="sparseops").eval()
    assert all(e.config._experts_implementation == "sparseops" for e in experts_modules(back))
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    with torch.no_grad():
        ref = model.double()(input_ids=ids).logits
        assert_close(back(input_ids=ids).logits, ref, torch.float32, f"{family} logits after from_pretrained")
    back.set_experts_implementation("eager")
    assert all(e.config._experts_implementation == "eager" for e in experts_modules(back))


def test_under_autocast_the_sparseops_experts_run_in_its_dtype():
    """An fp32 model under ``torch.autocast(bf16)``, as eager's ``F.linear`` experts would: the sparseops experts'
    GEMMs (``mm`` into preallocated outputs) run in bf16, never fp32, and the logits and every gradient are as close
    to the float64 model's as eager's under the same autocast (within the bf16 tolerance or 2x eager's error)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.out:
                self.seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    ids = _ids()
    model = tiny_family_model("qwen3_moe")
    ref_logits, ref_grads = run_model(model, "eager", ids)
    runs = {}
    for impl in ("eager", "sparseops"):
        spy = GemmDtypes()
        with torch.autocast("cpu", dtype=torch.bfloat16), spy:
            runs[impl] = run_model(copy.deepcopy(model).to(torch.float32), impl, ids)
        if impl == "sparseops":
            assert spy.seen == {torch.bfloat16}, spy.seen
    (e_logits, e_grads), (logits, grads) = runs["eager"], runs["sparseops"]
    for name, got, ref, eager in [("logits", logits, ref_logits, e_logits)] + [
            (n, grads[n], r, e_grads[n]) for n, r in ref_grads.items()]:
        err, floor = rel_rms_error(got, ref), rel_rms_error(eager, ref)
        assert err <= max(TOLERANCES[torch.bfloat16], 2 * floor), (name, err, floor)
