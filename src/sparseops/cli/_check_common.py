"""What ``sparseops check`` shares between the op families: a check's result, the comparison of outputs
against the float64 reference, and the helpers the per-family checks build inputs with."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from sparseops import testing

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: exact outputs (index maps, bitwise-determinism) are held to this tolerance
EXACT = 0.0


@dataclass
class Result:
    op: str
    backend: str
    dtype: str
    case: str
    err: float = math.nan
    tol: float = math.nan
    ms: float = math.nan
    worst: str = ""
    ok: bool = False
    error: str | None = None
    trace: str | None = None


# an output check: (name, actual, expected float64 or exact, tolerance, mask of elements to compare or None)
Cmp = tuple[str, "torch.Tensor | None", "torch.Tensor | None", float, "torch.Tensor | None"]


def tolerance(in_dtype: torch.dtype, out: torch.Tensor | None) -> float:
    """The looser of the inputs' and the output's tolerance (an output is rounded once to its dtype)."""
    t = testing.TOLERANCES[in_dtype]
    if out is not None and out.dtype in testing.TOLERANCES:
        t = max(t, testing.TOLERANCES[out.dtype])
    return t


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def norm_range(rng, N: int) -> tuple[int, int]:
    s, e = rng
    s, e = (s + N if s < 0 else s), (e + N if e < 0 else e)
    return min(max(s, 0), N), min(max(e, 0), N)


def oracle(fn, *args):
    """Run the reference on one thread: it is thousands of tiny ops, which threads only slow down (and a
    busy machine makes an OpenMP pool crawl)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(n)


def f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def cpu(t):
    return None if t is None else t.detach().cpu()


def rand(shape, dtype, g, device):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


class Timer:
    def __init__(self, device):
        self.device, self.ms = device, 0.0

    def __enter__(self):
        sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.ms += (time.perf_counter() - self.t0) * 1e3


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """No gradient reached ``t`` (e.g. an empty EP window): that is a zero gradient."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def compare(cmps: list[Cmp]) -> tuple[float, float, str, bool, str | None]:
    """Worst output by err/tol. A missing output where one is expected (or the reverse) fails."""
    worst = (0.0, 0.0, "", -1.0)
    problems = []
    for name, actual, expected, tol, mask in cmps:
        if actual is None and expected is None:
            continue
        if actual is None or expected is None:
            problems.append(f"{name}: expected {'None' if expected is None else 'a tensor'}, got "
                            f"{'None' if actual is None else 'a tensor'}")
            worst = max(worst, (math.inf, tol, name, math.inf), key=lambda w: w[3])
            continue
        if tuple(actual.shape) != tuple(expected.shape):
            problems.append(f"{name}: expected shape {list(expected.shape)}, got {list(actual.shape)}")
            worst = max(worst, (math.inf, tol, name, math.inf), key=lambda w: w[3])
            continue
        a, e = cpu(actual), cpu(expected)
        if mask is not None:
            m = mask.cpu()
            a, e = a[m], e[m]
        if tol == EXACT:
            err = 0.0 if torch.equal(a.to(e.dtype) if a.dtype != e.dtype else a, e) else _exact_err(a, e)
        else:
            err = testing.rel_rms_error(a, e)
        ratio = (0.0 if err == 0 else math.inf) if tol == 0 else err / tol
        if not err <= tol:
            ratio = max(ratio, 1.0 + 1e-9) if ratio == ratio else math.inf
        if ratio > worst[3]:
            worst = (err, tol, name, ratio)
    err, tol, name, ratio = worst
    ok = not problems and ratio <= 1.0
    return err, tol, name, ok, "; ".join(problems) or None


def _exact_err(a: torch.Tensor, e: torch.Tensor) -> float:
    """For an exact output: the share of elements that differ (nonzero means FAIL)."""
    if a.numel() == 0:
        return 0.0
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    same = (a64 == e64) | (torch.isnan(a64) & torch.isnan(e64))
    return float((~same).sum()) / a.numel()


