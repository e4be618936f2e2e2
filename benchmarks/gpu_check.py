"""The whole-stack GPU check: the layers, the integrations, training and the NSA kernels on one GPU, one table.

    bash benchmarks/gpu_check.sh          # on the GPU machine: the environment, then this (results in $OUT)
    python benchmarks/gpu_check.py        # the same without the environment lines
    python benchmarks/gpu_check.py --cpu  # every row on the CPU at tiny sizes (gloo for NCCL; the NSA kernel rows
                                          # skipped): the plumbing, run by tests/benchmarks/test_gpu_check.py

One row per check: ``ok`` / ``FAIL`` / ``skip``, the worst relative RMS error over every compared tensor divided
by its tolerance (``sparseops.testing.TOLERANCES``; ``ok`` needs <= 1), what it compared or why it skipped, and
its seconds. A part that another piece of the project provides (the transformers experts backend, ``sparseops
train``) skips with the reason while it is missing. Exit status 1 when a row fails. docs/perf.md ("The GPU check").
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from sparseops.nn import MoELayer, NativeSparseAttention  # noqa: E402
from sparseops.nn.reference import moe_reference  # noqa: E402
from sparseops.testing import TOLERANCES, rel_rms_error  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_dsa  # noqa: E402  the DeepSeekSparseAttention rows

#: sizes per mode: the MoE layer (T tokens per rank), the NSA module (packed lengths), the transformers experts
SIZES = {
    "gpu": {"moe": dict(T=512, H=256, F=128, E=16, K=2), "nsa": dict(cu=[0, 1000, 1999, 3072], hidden=256),
            "hf": dict(T=1024, H=512, F=256, E=32, K=4)},
    "cpu": {"moe": dict(T=37, H=24, F=12, E=8, K=2), "nsa": dict(cu=[0, 70, 131], hidden=32),
            "hf": dict(T=40, H=32, F=16, E=8, K=2)},
}
#: ``sparseops train``'s model flags per mode: its default model on the GPU, a tiny one in the CPU rehearsal
TRAIN_MODEL = {
    "gpu": [],
    "cpu": ["--hidden-size", "16", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--ffn-size", "16",
            "--num-experts", "4", "--expert-ffn-size", "8", "--window-size", "16", "--select-count", "3",
            "--threads", "1"],
}

#: ``sparseops train`` for a few steps (one process under torchrun), ``{out}`` its output folder
#: (``{steps}``: 5 on the GPU, 2 in the CPU rehearsal)
TRAIN_ARGV = ["--steps", "{steps}", "--eval-sequences", "0", "--json", "{out}/train.json", "--save", "{out}/ckpt"]

#: seconds for each subprocess row, each also cut to what is left of ``--budget``
TIMEOUTS = {"train": 120, "nsa_bench": 180, "nsa_tests": 120}

#: where a run writes without --out or $OUT: beside the other benchmarks' results, ignored by git
DEFAULT_OUT = Path("sparseops-results") / "gpu_check"

#: the whole check's default budget in seconds (under 8 minutes on one H200 with the start-up around it)
BUDGET_S = 450


class Skip(Exception):
    """A row that cannot run here; the message says why."""


# ------------------------------------------------------------------------------------------------- comparisons


def worst(pairs, dtype, reported=()) -> tuple[float, str]:
    """``(max over pairs of rel_rms_error / tolerance, what it compared)`` for ``[(name, got, want)]``;
    ``reported``: more pairs whose worst ratio is named in the text but not gated."""
    tol = TOLERANCES[dtype]
    r, n = max((rel_rms_error(a, b) / tol, n) for n, a, b in pairs)
    text = f"{len(pairs)} tensors, worst {n}"
    if reported:
        r2, n2 = max((rel_rms_error(a, b) / tol, n) for n, a, b in reported)
        text += f"; {len(reported)} reported only, worst {n2} at {r2:.2g} x tol"
    return r, text


def _moe_params(s: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, F, E = s["H"], s["F"], s["E"]
    return {"router": torch.randn(E, H, generator=g, dtype=torch.float64) * H ** -0.5,
            "w1": torch.randn(E, F, H, generator=g, dtype=torch.float64) * H ** -0.5,
            "w3": torch.randn(E, F, H, generator=g, dtype=torch.float64) * H ** -0.5,
            "w2": torch.randn(E, H, F, generator=g, dtype=torch.float64) * F ** -0.5,
            "shared": None, "expert_bias": None}


def _load_moe(layer: MoELayer, P: dict, lo: int, hi: int) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(P["router"])
        for n in ("w1", "w3", "w2"):
            getattr(layer.experts, n).copy_(P[n][lo:hi])


def _moe_inputs(s: dict, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64),
            torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64))


def _moe_run(layer: MoELayer, x0, g0, dtype, device, autocast: bool = False) -> dict:
    """One forward (under ``torch.autocast(bf16)`` with ``autocast``) + backward of ``(y * g).sum() + aux``;
    everything returned on the CPU."""
    x = x0.to(device, dtype).requires_grad_(True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        y, aux = layer(x)
    if autocast and y.dtype != torch.bfloat16:
        raise RuntimeError(f"y: expected bfloat16 under autocast, got {y.dtype}")
    ((y * g0.to(device, dtype)).sum() + aux.loss).backward()
    with torch.no_grad():
        idx = layer.router.route(x.detach())[2]
    return {"y": y.detach().cpu(), "x": x.grad.cpu(), "indices": idx.cpu().tolist(),
            "grads": {n: p.grad.cpu() for n, p in layer.named_parameters()}}


def _moe_oracle(P: dict, xs, gs, s: dict, indices) -> dict:
    """The float64 per-token oracle over every rank's tokens: outputs and the gradients of the same loss."""
    leaves = {n: P[n].clone().requires_grad_(True) for n in ("router", "w1", "w3", "w2")}
    xs = [x.clone().requires_grad_(True) for x in xs]
    ref = moe_reference(xs, {**P, **leaves}, top_k=s["K"], indices=indices, aux_loss_coeff=1e-2)
    loss = sum((y * g).sum() for y, g in zip(ref["ys"], gs)) + ref["aux_loss"]
    grads = torch.autograd.grad(loss, xs + list(leaves.values()))
    return {"ys": [y.detach() for y in ref["ys"]], "xs": list(grads[:len(xs)]),
            "grads": dict(zip(leaves, grads[len(xs):]))}


def check_moe_layer(ctx: dict, dtype: torch.dtype, autocast: bool = False):
    """The layer in ``dtype`` against the float64 oracle. ``autocast``: fp32 parameters, the forward under
    ``torch.autocast(bf16)`` (the router in fp32, the experts in bf16; docs/moe-layer.md, "Under torch.autocast"),
    against the oracle on the bf16 values of the experts' weights, with the bf16 tolerance."""
    s = ctx["sizes"]["moe"]
    P = _moe_params(s)
    torch.manual_seed(0)
    layer = MoELayer(s["H"], s["F"], s["E"], s["K"], aux_loss_coeff=1e-2, device=ctx["device"], dtype=dtype)
    _load_moe(layer, P, 0, s["E"])
    x0, g0 = _moe_inputs(s, 0)
    got = _moe_run(layer, x0, g0, dtype, ctx["device"], autocast)
    if autocast:
        if any(g.dtype != torch.float32 for g in got["grads"].values()):
            raise RuntimeError("the parameters' gradients: expected float32 under autocast")
        P = {**P, **{n: P[n].to(torch.bfloat16).double() for n in ("w1", "w3", "w2")}}
    ref = _moe_oracle(P, [x0], [g0], s, [got["indices"]])  # the same choices (a near-tie may flip in bf16)
    g = got["grads"]
    pairs = [("y", got["y"], ref["ys"][0]), ("x.grad", got["x"], ref["xs"][0]),
             ("router.grad", g["router.weight"], ref["grads"]["router"])]
    pairs += [(f"{n}.grad", g[f"experts.{n}"], ref["grads"][n]) for n in ("w1", "w3", "w2")]
    if autocast:
        r, what = worst(pairs, torch.bfloat16)
        return r, f"{what} (bf16 tolerance)"
    return worst(pairs, dtype)


def _ep_worker(rank: int, ws: int, s: dict, device_type: str) -> dict:
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    P = _moe_params(s)
    El = s["E"] // ws
    layer = MoELayer(s["H"], s["F"], s["E"], s["K"], aux_loss_coeff=1e-2, ep_group=dist.group.WORLD,
                     dispatcher="alltoall", device=device, dtype=torch.float32)
    _load_moe(layer, P, rank * El, (rank + 1) * El)
    x0, g0 = _moe_inputs(s, rank)
    return _moe_run(layer, x0, g0, torch.float32, device)


def check_moe_ep(ctx: dict, ws: int):
    from sparseops.distributed import spawn

    cuda = ctx["device"].type == "cuda"
    if cuda and torch.cuda.device_count() < ws:
        raise Skip(f"needs {ws} GPUs, {torch.cuda.device_count()} here")
    s = ctx["sizes"]["moe"]
    res = spawn(_ep_worker, ws, s, ctx["device"].type, backend="nccl" if cuda else "gloo", timeout=120.0)
    xs, gs = zip(*[_moe_inputs(s, r) for r in range(ws)])
    ref = _moe_oracle(_moe_params(s), list(xs), list(gs), s, [r["indices"] for r in res])
    El = s["E"] // ws
    pairs = [("router.grad (sum over ranks)", sum(r["grads"]["router.weight"] for r in res), ref["grads"]["router"])]
    for q, r in enumerate(res):
        pairs += [(f"rank {q} y", r["y"], ref["ys"][q]), (f"rank {q} x.grad", r["x"], ref["xs"][q])]
        pairs += [(f"rank {q} {n}.grad", r["grads"][f"experts.{n}"], ref["grads"][n][q * El:(q + 1) * El])
                  for n in ("w1", "w3", "w2")]
    r, what = worst(pairs, torch.float32)
    return r, f"{'nccl' if cuda else 'gloo'}, alltoall, fp32 vs the one-process float64 oracle: {what}"


def check_transformers_experts(ctx: dict):
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        import sparseops.integrations.transformers as integ
    except ImportError as exc:
        raise Skip(f"sparseops.integrations.transformers not importable ({type(exc).__name__}: {exc})") from None
    s, device, dtype = ctx["sizes"]["hf"], ctx["device"], torch.bfloat16
    cfg = Qwen3MoeConfig(hidden_size=s["H"], moe_intermediate_size=s["F"], num_experts=s["E"],
                         num_experts_per_tok=s["K"], hidden_act="silu")

    def experts(impl: str, dt, dev):
        c = Qwen3MoeConfig(**cfg.to_dict())
        c._experts_implementation = impl
        torch.manual_seed(0)
        m = Qwen3MoeExperts(c)
        with torch.no_grad():
            m.gate_up_proj.normal_(0, s["H"] ** -0.5)
            m.down_proj.normal_(0, s["F"] ** -0.5)
        return m.to(dev, dt)

    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64)
    dy = torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64)
    idx = torch.rand(s["T"], s["E"], generator=g).argsort(-1)[:, :s["K"]]
    w = torch.softmax(torch.randn(s["T"], s["K"], generator=g, dtype=torch.float64), -1)
    w = w.to(dtype).double()  # the weights bf16 can hold: the oracle and both runs see the same

    def run(impl: str, dt, dev):
        m = experts(impl, dt, dev)
        x = x0.to(dev, dt, copy=True).requires_grad_(True)  # a copy: x0 itself stays a plain input
        start = time.perf_counter()
        y = m(x, idx.to(dev), w.to(dev, dt))
        y.backward(dy.to(dev, dt))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return {"y": y.detach().cpu(), "x": x.grad.cpu(), "gate_up": m.gate_up_proj.grad.cpu(),
                "down": m.down_proj.grad.cpu(), "s": time.perf_counter() - start}

    ref = run("eager", torch.float64, torch.device("cpu"))
    out, notes = {}, []
    for impl in (integ.NAME, "grouped_mm"):
        run(impl, dtype, device)  # warm-up (kernels compiled, cuBLAS handles)
        got = run(impl, dtype, device)
        out[impl] = worst([(k, got[k], ref[k]) for k in ("y", "x", "gate_up", "down")], dtype)[0]
        notes.append(f"{impl} {out[impl]:.2g} x tol, {got['s'] * 1e3:.1f} ms")
    return out[integ.NAME], f"bf16 vs float64 eager on the same routing: {'; '.join(notes)} (fwd+bwd)"


def _nsa_module(ctx: dict) -> NativeSparseAttention:
    torch.manual_seed(0)
    m = NativeSparseAttention(ctx["sizes"]["nsa"]["hidden"], num_heads=16, num_kv_heads=1, head_dim=32,
                              compress_block_size=32, compress_stride=16, select_block_size=64, select_count=4,
                              window_size=128, rope_theta=10000.0, dtype=torch.float64)
    with torch.no_grad():  # spread the scores so that the selection is decided by clear margins
        m.q_proj.weight.mul_(4)
        m.gate_proj.bias.normal_()
    return m


def _nsa_run(mod, x0, dy, cu, dev, dt, autocast: bool = False, compiled: bool = False):
    """One forward (under ``torch.autocast(bf16)`` with ``autocast``) and backward of the module; on the CPU.
    ``compiled``: under ``torch.compile`` (Inductor on CUDA, ``aot_eager`` on the CPU: dynamo's tracing is the
    same), the lengths a list so that every branch and the gated sum are traced (docs/nsa-module.md)."""
    x = x0.to(dev, dt, copy=True).requires_grad_(True)  # a copy: x0 itself stays a plain input
    run = mod
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(mod, backend="inductor" if dev.type == "cuda" else "aot_eager")
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        y, info = run(x, list(cu) if compiled else torch.tensor(cu, dtype=torch.int32, device=dev), return_info=True)
    y.backward(dy.to(dev, y.dtype))
    return y.detach().cpu(), x.grad.cpu(), {n: p.grad.cpu() for n, p in mod.named_parameters()}, info


def check_nsa_module(ctx: dict, dtype: torch.dtype, autocast: bool = False, compiled: bool = False):
    """The module in ``dtype`` against itself in float64 on the CPU. ``autocast``: fp32 parameters under
    ``torch.autocast(bf16)`` against the float64 module on the bf16 values of x and the parameters, and whether
    it computed what a bf16 copy computes (docs/nsa-module.md, "The module"). ``compiled``: under
    ``torch.compile``, Inductor's kernels around the branches' custom ops on CUDA."""
    cu = ctx["sizes"]["nsa"]["cu"]
    ref_m = _nsa_module(ctx)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(cu[-1], ctx["sizes"]["nsa"]["hidden"], generator=g, dtype=torch.float64)
    dy = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    if autocast:
        with torch.no_grad():
            for p in ref_m.parameters():
                p.copy_(p.bfloat16())
        x0 = x0.bfloat16().double()
    m = copy.deepcopy(ref_m).to(ctx["device"], dtype)
    y, gx, gp, info = _nsa_run(m, x0, dy, cu, ctx["device"], dtype, autocast, compiled)
    y_ref, gx_ref, gp_ref, info_ref = _nsa_run(ref_m, x0, dy, cu, torch.device("cpu"), torch.float64)
    copy_note = ""
    if autocast:
        if y.dtype != torch.bfloat16:
            raise RuntimeError(f"y: expected bfloat16 under autocast, got {y.dtype}")
        y_low = _nsa_run(copy.deepcopy(ref_m).to(ctx["device"], torch.bfloat16), x0, dy, cu, ctx["device"],
                         torch.bfloat16)[0]
        copy_note = f"; y bitwise the bf16 copy's: {torch.equal(y, y_low)}"
        dtype = torch.bfloat16  # the tolerance of what it computed in
    same = (info["topk_indices"].cpu() == info_ref["topk_indices"]).float().mean().item()
    pairs = [("y", y, y_ref), ("x.grad", gx, gx_ref)]
    params = [(f"{n}.grad", gp[n], gp_ref[n]) for n in gp]
    # bf16: the parameter gradients are sums over every token of bf16 products: reported, not gated
    r, what = worst(pairs, dtype, params) if dtype == torch.bfloat16 else worst(pairs + params, dtype)
    return r, (f"T = {cu[-1]} in {len(cu) - 1} sequences, G = 16, vs the module in float64 on the CPU: {what}; "
               f"selected blocks equal to float64's: {same:.1%}{copy_note}")


# ------------------------------------------------------------------------------------------------ subprocesses


def _env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "src")] + ([str(ROOT / ".peers")] if (ROOT / ".peers").is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_command(argv: list[str], timeout: float, log: Path) -> tuple[int | None, str]:
    """Run ``argv`` (stdout and stderr to ``log``); ``(exit status or None on timeout, its last lines)``."""
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
    return rc, " | ".join(tail)[-300:]


def _command_row(argv: list[str], timeout: float, log: Path, deadline: float | None = None):
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < 20:
            raise Skip(f"the budget is spent ({left:.0f} s left; --budget)")
        timeout = min(timeout, left)
    rc, tail = run_command(argv, timeout, log)
    if rc is None:
        raise RuntimeError(f"still running after {timeout} s ({log}): {tail}")
    if rc:
        raise RuntimeError(f"exit status {rc} ({log}): {tail}")
    return None, f"{log.name}: {tail}"


def check_train(ctx: dict, autocast: bool = False):
    from sparseops.cli import SUBCOMMANDS

    if "train" not in SUBCOMMANDS:
        raise Skip("`sparseops train` is not a subcommand of this checkout yet")
    name = "train_autocast" if autocast else "train"
    out = ctx["out"] / name
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
            "sparseops", "train", *(a.format(out=out, steps=2 if ctx["device"].type == "cpu" else 5) for a in TRAIN_ARGV)]
    argv += TRAIN_MODEL[ctx["device"].type] + (["--autocast", "bfloat16"] if autocast else [])
    _command_row(argv, TIMEOUTS["train"], ctx["out"] / f"{name}.log", ctx.get("deadline"))
    losses = json.loads((out / "train.json").read_text()).get("loss") if (out / "train.json").is_file() else None
    if not losses or not all(isinstance(v, float) and v == v for v in losses):
        raise RuntimeError(f"no finite per-step losses in {out / 'train.json'}: {losses!r}"[:300])
    return None, f"{len(losses)} steps, loss {losses[0]:.4g} -> {losses[-1]:.4g}; {ctx['out'] / f'{name}.log'}"


def check_nsa_bench(ctx: dict):
    if ctx["device"].type != "cuda":
        raise Skip("needs CUDA (rehearsed on the CPU by tests/benchmarks/test_gpu_nsa.py)")
    argv = [sys.executable, str(ROOT / "benchmarks" / "gpu_nsa.py"), "--quick", "--out", str(ctx["out"] / "gpu_nsa.json")]
    return _command_row(argv, TIMEOUTS["nsa_bench"], ctx["out"] / "gpu_nsa.log", ctx.get("deadline"))


def check_nsa_tests(ctx: dict):
    if ctx["device"].type != "cuda":
        raise Skip("needs CUDA (the same tests run under TRITON_INTERPRET=1 in CI)")
    import importlib.util

    xdist = ["-p", "xdist.plugin", "-n", "8"] if importlib.util.find_spec("xdist") else []
    argv = [sys.executable, "-m", "pytest", "tests/nsa/test_triton_impl.py", "tests/nsa/test_triton_plan.py",
            "tests/nsa/test_triton_gather.py", "tests/moe/test_triton_impl.py", "-q", "-x", "-p", "no:cacheprovider", *xdist]
    return _command_row(argv, TIMEOUTS["nsa_tests"], ctx["out"] / "pytest.log", ctx.get("deadline"))


#: (row name, check): in the order they run and print
CHECKS = [
    ("MoELayer fp32 fwd+bwd vs float64 oracle", lambda c: check_moe_layer(c, torch.float32)),
    ("MoELayer bf16 fwd+bwd vs float64 oracle", lambda c: check_moe_layer(c, torch.bfloat16)),
    ("MoELayer fp32 under bf16 autocast vs float64 oracle", lambda c: check_moe_layer(c, torch.float32, True)),
    ("MoELayer EP world size 1", lambda c: check_moe_ep(c, 1)),
    ("MoELayer EP world size 2", lambda c: check_moe_ep(c, 2)),
    ("transformers experts 'sparseops' bf16", check_transformers_experts),
    ("NativeSparseAttention fp32 fwd+bwd", lambda c: check_nsa_module(c, torch.float32)),
    ("NativeSparseAttention bf16 fwd+bwd", lambda c: check_nsa_module(c, torch.bfloat16)),
    ("NativeSparseAttention fp32 under bf16 autocast", lambda c: check_nsa_module(c, torch.float32, autocast=True)),
    ("NativeSparseAttention fp32 under torch.compile", lambda c: check_nsa_module(c, torch.float32, compiled=True)),
    *gpu_dsa.ROWS,
    ("sparseops train (a few steps)", check_train),
    ("NSA Triton benchmark (gpu_nsa.py --quick)", check_nsa_bench),
    ("Triton kernel tests, compiled", check_nsa_tests),
    ("sparseops train --autocast bfloat16", lambda c: check_train(c, autocast=True)),
]


def table(rows: list[dict]) -> str:
    lines = ["| check | result | error / tol | seconds | detail |", "|---|---|---|---|---|"]
    for r in rows:
        e = "-" if r.get("ratio") is None else f"{r['ratio']:.3g}"
        lines.append(f"| {r['name']} | {r['status']} | {e} | {r['seconds']:.1f} | {r['detail']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU at tiny sizes (the plumbing; tests)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", DEFAULT_OUT)),
                   help=f"folder for gpu_check.json and the subprocess logs (default $OUT, else ./{DEFAULT_OUT})")
    p.add_argument("--only", nargs="+", metavar="WORD", default=None,
                   help="run only the rows whose name contains one of these words")
    p.add_argument("--budget", type=float, default=BUDGET_S, metavar="S",
                   help=f"seconds for the whole check (default {BUDGET_S}): a subprocess row gets at most what is "
                   "left, and skips when under 20 s is")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu for the CPU rehearsal)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = {"device": torch.device("cpu" if args.cpu else "cuda"), "sizes": SIZES["cpu" if args.cpu else "gpu"],
           "out": args.out.resolve(), "deadline": time.monotonic() + args.budget}
    meta = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows = []
    for name, fn in CHECKS:
        if args.only and not any(w.lower() in name.lower() for w in args.only):
            continue
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        row = {"name": name, "ratio": None}
        try:
            ratio, detail = fn(ctx)
            row.update(status="ok" if ratio is None or ratio <= 1.0 else "FAIL", ratio=ratio, detail=detail)
        except (Skip, gpu_dsa.Skip) as exc:
            row.update(status="skip", detail=str(exc))
        except Exception as exc:  # noqa: BLE001 - a failing row is reported; the others still run
            tb = traceback.format_exc().strip().splitlines()
            row.update(status="FAIL", detail=f"{type(exc).__name__}: {exc}"[:400] + f" (at {tb[-3].strip()[:120]})")
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[gpu_check] {name}: {row['status']} ({row['seconds']:.1f} s)", file=sys.stderr, flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
