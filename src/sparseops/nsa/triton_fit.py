"""What the NSA Triton kernels need on a given GPU, compiled without one (``sparseops fit``).

``compile_report`` compiles every launch of the forward and of the three backward variants for ``sm_<arch>``
(``_triton.offline_compile``: Triton's bundled ``ptxas``, nothing run) and reads each kernel's shared memory,
registers and spills. It checks the shape with the public op's own checks (``checks.check_args``) first, so it
lives beside the backend rather than in it (a backend never validates).
"""

from __future__ import annotations

import torch

from .. import _checks, _triton
from . import checks, triton_impl


def compile_report(arch: int, *, G: int, N2: int = 1, Dqk: int, Dv: int, bs: int, K: int,
                   dtype: torch.dtype = torch.bfloat16, causal: bool = True) -> list[dict]:
    """Compile, without running and without a GPU, every launch of the forward and of the three backward variants
    (atomic, deterministic, ``dq_atomic``) for ``sm_<arch>`` at this shape.

    Args:
        arch: compute capability ``major * 10 + minor``, one of ``_triton.SHARED_LIMIT``.
        G, N2, Dqk, Dv: query heads per KV head, KV heads, the QK and V head dims.
        bs, K: ``selected_block_size`` and ``selected_block_count``.
        dtype: the inputs' dtype (float16, bfloat16 or float32).
        causal: ``sparse_mode = 2`` (else 0).

    Returns:
        One dict per launch, ``{"variant", "kernel", "rows", "keys", "warps", "stages", "shared", "registers",
        "spill_bytes"}`` (``rows``, ``keys``: tile rows and key rows of a forward / dQ / dK/dV step; the rows tell
        the wide and ordinary launches apart, the keys show a block taken in parts), or per variant that does not
        fit that GPU ``{"variant", "error"}`` (what ``backend="triton"`` would raise there).

    Raises ``ValueError`` / ``TypeError`` for a shape the op rejects, before compiling anything.
    """
    triton_impl._check_dtype(torch.empty(0, dtype=dtype))
    # before sizing the example tensors with them; the launch grid's second axis is N2: past CUDA's limit there
    # no launch exists to compile
    for name, n, hi in (("G", G, None), ("N2", N2, _triton.GRID_LIMITS[1]), ("Dqk", Dqk, None), ("Dv", Dv, None),
                        ("selected_block_size", bs, None), ("selected_block_count", K, None)):
        _checks.check_int(name, n, lo=1, hi=hi)
    seqs = [3 * max(bs, 16) // 2, 5]  # a partial last key block, a second sequence
    T = sum(seqs)
    cum = [seqs[0], T]

    def example(device):
        q = torch.zeros(T, N2 * G, Dqk, dtype=dtype, device=device)
        k = torch.zeros(T, N2, Dqk, dtype=dtype, device=device)
        v = torch.zeros(T, N2, Dv, dtype=dtype, device=device)
        return q, k, v, torch.zeros(T, N2, K, dtype=torch.int32, device=device)

    # the op's checks on storage-less tensors (the example's block ids are all valid): a shape they refuse (G, Dqk
    # or K past its limit) is an error, not an allocation of its example tensors
    scale, bs, cu_q, cu_kv, causal, _ = checks.check_args(
        *example("meta"), 1.0, N2 * G, bs, K, None, cum, cum, 2 if causal else 0, "TND", False)
    q, k, v, topk = example("cpu")
    out = torch.zeros(T, N2 * G, Dv, dtype=dtype)
    m, l = torch.zeros(T, N2 * G), torch.ones(T, N2 * G)
    rows = []
    for variant, det, dqa in (("forward", None, False), ("backward", False, False),
                              ("deterministic", True, False), ("DQ_ATOMIC", False, True)):
        try:
            with triton_impl.SETTINGS.override(dq_atomic=dqa), _triton.offline_compile(arch) as launches:
                if det is None:
                    triton_impl.forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal)
                else:
                    triton_impl.backward(q, k, v, out, out, m, l, topk, scale, bs, cu_q, cu_kv, causal,
                                         deterministic=det)
        except _triton.DoesNotFit as e:
            rows.append({"variant": variant, "error": str(e)})
            continue
        for x in launches:
            tile = x.meta.get("PACK", x.meta.get("BLOCK_E", 0)) * x.meta.get("BLOCK_G", 0)
            keys = x.meta.get("BLOCK_KC", x.meta.get("BLOCK_KR", x.meta.get("BLOCK_BS"))) if tile else None
            rows.append({"variant": variant, "kernel": x.kernel, "rows": tile or None, "keys": keys,
                         "warps": x.num_warps, "stages": x.stages, "shared": x.shared, **x.resources()})
    return rows
