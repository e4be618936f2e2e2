"""Triton launchers for NSA selected attention (the GPU path; also runs under ``TRITON_INTERPRET=1``).

Same internal signatures as ``reference.py`` (docs/internals.md). Arguments are already validated. The launch
plans (token packs, wide packs, the dK/dV work list) and the tuning knobs (``SETTINGS``) live in
``triton_plan.py``; the kernels in ``triton_kernels.py`` (forward) and ``triton_kernels_bwd.py`` (backward).

Token granularity (``selected_block_size`` < 16) runs the gather kernels of ``triton_gather.py``.

- ``forward``: one program per (token pack, KV head), an fp32 online softmax over the selected blocks. A pack
  is one token (G >= 9) or ``pack_size(G)`` consecutive tokens of one sequence (G <= 8), whose distinct selected
  blocks are each loaded and multiplied once for all its rows; a row sees a block where its own token selected
  it (counted in the kernel from ``topk``: a block picked twice counts twice) and, under causal masking, up to
  its own token's position. With half-precision inputs, wide packs of 64 rows run instead where their tokens
  share enough blocks (``triton_plan._q_plan``); their products compile to wgmma / tcgen05 on sm_90 / sm_100.
  A block is taken in steps of fewer keys where it does not fit the device whole.
- ``backward``: dQ query-major with the forward's grids, packing and wide packs (no atomics; it also writes
  ``D = rowsum(dY * O)``; a block in steps of fewer keys where it does not fit whole), then dK/dV
  key-block-major over an inverse index (for each key block of each KV head, the stably sorted list of
  query tokens that selected it, no host sync), cut into chunks (one program each, so that a block picked
  by every token does not serialise the kernel), a block wider than ``dkv_key_rows`` keys into parts of that
  many (grid axis 1). Default: chunks add their fp32 partials into fp32 dk/dv with atomics.
  ``deterministic=True``: chunks write their partials to a workspace, reduced in chunk order by a
  second kernel: bitwise reproducible. ``dq_atomic``: dQ from the dK/dV kernel with atomics instead.

Every kernel is launched through ``_triton.launch`` with its arguments by name. float64 inputs are rejected
(``TypeError``): the API routes them to the torch backend.
"""

from __future__ import annotations

import torch

from .. import _checks, _triton
from .triton_plan import (
    SETTINGS,
    _dkv_key_rows,
    _dkv_tile,
    _dkv_warps,
    _dq_atomic_fits,
    _head_blocks,
    _key_blocks,
    _next_pow2,
    _q_plan,
    _token_meta,
    build_inverse_index,
)

__all__ = ["SETTINGS", "forward", "backward"]

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
#: the pack-table arguments of the forward and dQ kernels, in the order of ``_q_plan``'s tuples
_PACK_ARGS = ("pk_t0", "pk_n", "pk_ids", "pk_nu")


def _check_dtype(q):
    if q.dtype not in _SUPPORTED:
        raise TypeError(
            f"query: the triton backend supports float16, bfloat16 and float32, got {str(q.dtype).replace('torch.', '')}"
            " (use backend='torch' for float64)"
        )


def _shape(G: int, K: int, bs: int, Dqk: int, Dv: int) -> str:
    return f"G={G}, selected_block_count={K}, selected_block_size={bs}, Dqk={Dqk}, Dv={Dv}"


def _dot_args(q) -> dict:
    import triton.language as tl

    if _checks.triton_interpret() or q.dtype == torch.float32:
        # fp32 dots must be exact (no tf32); the interpreter cannot do bf16/fp16 arithmetic
        return {"DOT": tl.float32, "PREC": "ieee"}
    return {"DOT": tl.float16 if q.dtype == torch.float16 else tl.bfloat16, "PREC": "tf32"}


def _launch_q(kernel, plan, dev, args: dict, **meta) -> None:
    """Launch the ``_q_plan`` launches of ``kernel`` with ``args`` and each launch's pack table and run flags. A
    launch that does not fit the device's shared memory takes a block in smaller steps (``BLOCK_KC`` halved, down
    to 16); a wide one that still does not fit leaves all its tokens to the ordinary launch."""
    wide_failed = False
    for i, (n, pk, run, tile, warps) in enumerate(plan):
        gate = run is not None and not wide_failed
        pack = dict(zip(_PACK_ARGS, pk))
        while True:
            try:
                _triton.launch(kernel, (n, meta["N2"]), dev, {**args, **pack, "run": run if gate else pk[0]},
                               num_warps=warps, GATE=gate, **tile, **meta)
            except _triton.DoesNotFit:
                if tile["BLOCK_KC"] > 16:
                    tile = {**tile, "BLOCK_KC": tile["BLOCK_KC"] // 2}
                    continue
                if i + 1 < len(plan):
                    wide_failed = True
                    break
                raise
            break


def forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal):
    _check_dtype(q)
    if bs < 16:  # token granularity: the gather kernels
        from . import triton_gather

        return triton_gather.forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal)
    from . import triton_kernels as kern

    T1, N1, Dqk = q.shape
    N2, Dv = k.shape[1], v.shape[2]
    G, K = N1 // N2, topk.shape[2]
    out = torch.empty(T1, N1, Dv, dtype=q.dtype, device=q.device)
    m = torch.empty(T1, N1, dtype=torch.float32, device=q.device)
    l = torch.empty(T1, N1, dtype=torch.float32, device=q.device)
    if T1 == 0:
        return out, m, l
    q, k, v, topk = q.contiguous(), k.contiguous(), v.contiguous(), topk.contiguous()
    _, pos, kv0, s2 = _token_meta(cu_q, cu_kv, q.device)
    heads = _head_blocks(Dqk, Dv)
    _launch_q(
        kern.nsa_fwd_kernel, _q_plan(q, topk, cu_q, _key_blocks(s2, bs), G, K, bs, heads, pos), q.device,
        dict(q=q, k=k, v=v, topk=topk, o=out, m_out=m, l_out=l, tok_pos=pos, tok_kv0=kv0, tok_s2=s2,
             scale=float(scale)),
        num_stages=SETTINGS.get().fwd_stages, shape=_shape(G, K, bs, Dqk, Dv),
        N1=N1, N2=N2, G=G, K=K, BS=bs, BLOCK_BS=_next_pow2(bs), Dqk=Dqk, Dv=Dv,
        CAUSAL=bool(causal), **heads, **_dot_args(q), USE_WHILE=_checks.triton_interpret(),
    )
    return out, m, l


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    _check_dtype(q)
    if bs < 16:
        from . import triton_gather

        return triton_gather.backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic)
    from . import triton_kernels_bwd as kern

    T1, N1, Dqk = q.shape
    T2, N2, Dv = v.shape
    G, K = N1 // N2, topk.shape[2]
    dev = q.device
    if T1 == 0 or T2 == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    st = SETTINGS.get()
    q, k, v, topk = q.contiguous(), k.contiguous(), v.contiguous(), topk.contiguous()
    dout = dout.contiguous()
    m = m.to(torch.float32).contiguous()
    l = l.to(torch.float32).contiguous()
    out = out.contiguous()
    delta = torch.empty(T1, N1, dtype=torch.float32, device=dev)  # rowsum(dout * out), written by the dQ kernel
    seq_id, pos, kv0, s2 = _token_meta(cu_q, cu_kv, dev)
    heads = _head_blocks(Dqk, Dv)
    dots = _dot_args(q)
    block_bs = _next_pow2(bs)
    shape = _shape(G, K, bs, Dqk, Dv)
    interpret = _checks.triton_interpret()
    dq_atomic = st.dq_atomic and not deterministic and _dq_atomic_fits(bs, heads)
    if dq_atomic:
        # dQ comes from the dK/dV kernel; D = rowsum(dY * O) as the dQ kernel would have written it
        block_dv = max(16, _next_pow2(Dv))
        block_r = max(1, 4096 // block_dv)
        _triton.launch(kern.nsa_bwd_delta_kernel, (-(-(T1 * N1) // block_r),), dev,
                       dict(o=out, do=dout, delta=delta, n_rows=T1 * N1),
                       num_warps=4, Dv=Dv, BLOCK_R=block_r, BLOCK_DV=block_dv)
        dq32 = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    else:
        dq32 = delta  # unused stand-in pointer
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        _launch_q(
            kern.nsa_bwd_dq_kernel, _q_plan(q, topk, cu_q, _key_blocks(s2, bs), G, K, bs, heads, pos, dq=True), dev,
            dict(q=q, k=k, v=v, o=out, do=dout, m_in=m, l_in=l, delta=delta, topk=topk, dq=dq, tok_pos=pos,
                 tok_kv0=kv0, tok_s2=s2, scale=float(scale)),
            num_stages=st.fwd_stages, shape=shape,
            N1=N1, N2=N2, G=G, K=K, BS=bs, BLOCK_BS=block_bs, Dqk=Dqk, Dv=Dv,
            CAUSAL=bool(causal), **heads, **dots, USE_WHILE=interpret,
        )

    ix = build_inverse_index(topk, seq_id, bs, cu_kv, st.chunk)
    if ix["n_blocks"] == 0:
        return dq32.to(q.dtype) if dq_atomic else dq, torch.zeros_like(k), torch.zeros_like(v)
    key_rows = _dkv_key_rows(bs)
    common = dict(
        N1=N1, N2=N2, G=G, BS=bs, BLOCK_BS=block_bs, BLOCK_KR=key_rows, Dqk=Dqk, Dv=Dv, **_dkv_tile(G, dev),
        CAUSAL=bool(causal), **heads, **dots, num_warps=_dkv_warps(bs, heads), num_stages=st.dkv_stages,
        shape=shape, USE_WHILE=interpret,
    )
    n_ch = ix["n_chunks"]
    grid = (n_ch, block_bs // key_rows)
    args = dict(q=q, k=k, v=v, do=dout, m_in=m, l_in=l, delta=delta, ent_tok=ix["ent_tok"], ch_blk=ix["ch_blk"],
                ch_e0=ix["ch_e0"], ch_e1=ix["ch_e1"], blk_row0=ix["blk_row0"], blk_p0=ix["blk_p0"],
                blk_n=ix["blk_n"], tok_pos=pos, scale=float(scale))
    if deterministic:
        ws_k = torch.empty(n_ch, block_bs, Dqk, dtype=torch.float32, device=dev)
        ws_v = torch.empty(n_ch, block_bs, Dv, dtype=torch.float32, device=dev)
        _triton.launch(kern.nsa_bwd_dkv_kernel, grid, dev,
                       {**args, "dk": ws_k, "dv": ws_v, "ws_k": ws_k, "ws_v": ws_v, "dq": ws_k},
                       DETERMINISTIC=True, DQ_ATOMIC=False, **common)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        block_d = 64 if min(Dqk, Dv) >= 64 else 16
        n_cols = -(-Dqk // block_d) + -(-Dv // block_d)
        _triton.launch(
            kern.nsa_bwd_reduce_kernel, (ix["n_blocks"], n_cols), dev,
            dict(ws_k=ws_k, ws_v=ws_v, blk_c0=ix["blk_c0"], blk_c1=ix["blk_c1"], blk_row0=ix["blk_row0"],
                 blk_n=ix["blk_n"], dk=dk, dv=dv),
            num_warps=4, N2=N2, BS=bs, BLOCK_BS=block_bs, Dqk=Dqk, Dv=Dv, BLOCK_D=block_d,
        )
        return dq, dk, dv
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv32 = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    _triton.launch(kern.nsa_bwd_dkv_kernel, grid, dev,
                   {**args, "dk": dk32, "dv": dv32, "ws_k": dk32, "ws_v": dv32, "dq": dq32},
                   DETERMINISTIC=False, DQ_ATOMIC=dq_atomic, **common)
    return dq32.to(q.dtype) if dq_atomic else dq, dk32.to(k.dtype), dv32.to(v.dtype)
