"""Triton launchers for NSA selected attention (the GPU path; also runs under ``TRITON_INTERPRET=1``).

Same internal signatures as ``reference.py`` (docs/internals.md). Arguments are already validated.

- ``forward``: one program per (token pack, KV head), an fp32 online softmax over the selected blocks.
  G >= 9: a pack is one token, its G query heads are the tile rows (padded to 16 for ``tl.dot``), the loop
  runs over its K slots in order. G <= 8: a pack is ``P = pack_size(G) = 16 // next_pow2(G)`` consecutive
  tokens of one sequence (the last pack of a sequence may be shorter; masked rows), tile row
  ``x = j * next_pow2(G) + g`` is head g of token j. ``build_pack_table`` (torch ops on the device) lists each
  pack's distinct selected blocks; each is loaded and multiplied once for all rows, and a row sees it where
  its own token selected it (counted in the kernel from ``topk``: a block picked twice counts twice) and,
  under causal masking, up to its own token's position. With half-precision inputs, packs of 64 rows
  (``wide_pack_size``: 4 tokens at G = 16) run instead where their tokens share enough blocks (``WIDE_SHARE``,
  decided on the device by ``_q_plan``; both launches gated by per-program run flags); their products compile
  to wgmma / tcgen05 on sm_90 / sm_100 (mma.sync GPUs: forward only, ``WIDE_SHARE_MMA_SYNC``). A block is
  taken in steps of fewer keys where it does not fit the device whole. Not yet run on a GPU.
- ``backward``: dQ query-major with the forward's grids, packing and wide packs (no atomics; it also writes
  ``D = rowsum(dY * O)``; a block in steps of fewer keys where it does not fit whole), then dK/dV
  key-block-major over an inverse index (for each key block of each KV head, the stably sorted list of
  query tokens that selected it, built with torch ops on the device, no host sync). Each index list is
  cut into chunks of ``CHUNK`` entries (one program each, so that a block picked by every token does
  not serialise the kernel), and a block wider than ``DKV_KEY_ROWS`` keys into parts of that many (grid
  axis 1). A step's tile rows are ``DKV_ROWS`` (sm_90, sm_100) or ``DKV_ROWS_MMA_SYNC`` (sm_8x, sm_120) (token,
  head) pairs. Default: chunks add their fp32 partials into fp32 dk/dv with atomics.
  ``deterministic=True``: chunks write their partials to a workspace, reduced in chunk order by a
  second kernel: bitwise reproducible.

float64 inputs are rejected (``TypeError``): the API routes them to the torch backend.
"""

from __future__ import annotations

import torch

from .. import _checks, _triton
from .._varlen import device_tensor, seq_lengths, token_seq_positions

#: entries (query tokens) per dK/dV program; also sizes the deterministic workspace
CHUNK = 256
#: target tile rows (tokens x heads) per step of the dK/dV kernel (wgmma / tcgen05 GPUs: sm_90, sm_100)
DKV_ROWS = 32
#: the same on mma.sync GPUs (sm_8x, sm_120): with 32 rows the kernel spills ~3.6 KB per thread at the paper's
#: shape on an A100 (192 = 128 + 64 head split) and ~300 bytes on sm_120, with 16 none (offline compile;
#: docs/nsa.md)
DKV_ROWS_MMA_SYNC = 16
#: key rows per dK/dV program: a wider (padded) block is split over programs (bs = 128: two of 64 rows), so
#: its K/V rows and fp32 accumulators fit in shared memory and registers (offline compile, docs/nsa.md); a power of
#: two (other values are rounded down)
DKV_KEY_ROWS = 64
#: tile rows the forward / dQ kernels fill by packing consecutive tokens when G < 16 (mma.sync needs M >= 16)
PACK_ROWS = 16
#: tile rows of a *wide* pack, tried by the forward and dQ on GPUs with warpgroup MMA (sm_90, sm_100; and under
#: the interpreter), by the forward alone on mma.sync GPUs (sm_8x, sm_120: the wide dQ spills 2-6 KB per thread
#: there): at 64 rows the products compile to wgmma / tcgen05 (16 and 32 rows stay mma.sync on sm_90: PTX of the
#: offline compile), and a block that the pack's tokens share is loaded once for all of them. 0: off.
WIDE_ROWS = 64
#: a (wide pack, KV head) runs as one wide program when its distinct blocks are at most this share of the block
#: steps its tokens take in ordinary programs (their packs' distinct blocks; K per token when G >= 9), else as
#: those ordinary programs. 0.5: a 64-row step costs about twice a 16-row one (4x the FLOPs on ~2x faster MMA,
#: the same K/V bytes). Decided on the device per (pack, KV head), no host sync. Untuned (``gpu_nsa.py --tune``).
WIDE_SHARE = 0.5
#: the same on mma.sync GPUs, where a 64-row step costs about 4x a 16-row one: wide packs never do more MMA work
#: than the ordinary programs they replace, and load fewer blocks. Untuned.
WIDE_SHARE_MMA_SYNC = 0.25
#: fp32 inputs take wide packs too (off: their exact ``ieee`` dots use no tensor cores, so 64 rows gain nothing;
#: the kernel tests turn it on so that a GPU run checks wide packs in fp32, as the interpreter always does)
WIDE_FP32 = False
#: wide packs only where a key block holds at most this many values (padded ``bs * (Dqk + Dv)``): 128 x (256 + 64)
#: and 64 x (256 + 256) compile without spills on sm_90 (at most 200 KiB of shared memory), 128 x (256 + 128)
#: spills ~400 bytes per thread in the dQ kernel (offline compile)
WIDE_MAX_BLOCK_VALUES = 40960
#: key rows per step of the dQ kernel: a wider (padded) block is taken in steps of this many; a dQ launch that
#: does not fit the device's shared memory is retried with half as many, down to 16 (bs = 128 with Dqk = 256
#: needs 64 on GPUs with 99 KiB per program: sm_86, sm_89, sm_120; offline compile, docs/nsa.md); a power of two
#: (other values are rounded down)
DQ_KEY_ROWS = 128
#: the same for the forward kernel (fp32 inputs at G = 32, Dqk = Dv = 256, bs = 128 need 64 on an H100 / H200)
FWD_KEY_ROWS = 128
#: default (non-deterministic) backward: compute dQ inside the dK/dV kernel with fp32 atomics instead of the
#: query-major dQ kernel (saves re-gathering every selected K/V block; costs a [T1, N1, Dqk] fp32 buffer).
#: Off until measured on a GPU (``benchmarks/gpu_nsa.py --tune`` times both); the deterministic path never uses it.
DQ_ATOMIC = False
#: launch settings (sm_90; see docs/nsa.md (GPU section))
FWD_STAGES = 2
DKV_WARPS = 8
DKV_STAGES = 2

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return _checks.triton_interpret()


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _key_rows(knob: int) -> int:
    """A key-rows knob as the kernels can take it: a power of two (rounded down), at least 16. A step count
    of ``padded block // rows`` must cover the block exactly: 48 would have skipped rows."""
    return max(16, 1 << (max(1, int(knob)).bit_length() - 1))


def _prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _check_dtype(q):
    if q.dtype not in _SUPPORTED:
        raise TypeError(
            f"query: the triton backend supports float16, bfloat16 and float32, got {str(q.dtype).replace('torch.', '')}"
            " (use backend='torch' for float64)"
        )


def _head_blocks(Dqk: int, Dv: int) -> dict:
    """Two power-of-two chunks for the QK head dim (192 -> 128 + 64) and one padded chunk for Dv."""
    d1 = max(16, _prev_pow2(Dqk))
    rest = Dqk - d1
    return {
        "BLOCK_D1": d1,
        "BLOCK_D2": max(16, _next_pow2(rest)) if rest > 0 else 16,
        "HAS_D2": rest > 0,
        "BLOCK_DV": max(16, _next_pow2(Dv)),
    }


def _block_values(bs: int, heads: dict) -> int:
    """Values of one key block's K and V rows as the kernels tile them: ``next_pow2(bs) * (Dqk + Dv)`` padded."""
    return _next_pow2(bs) * (heads["BLOCK_D1"] + (heads["BLOCK_D2"] if heads["HAS_D2"] else 0) + heads["BLOCK_DV"])


def _dkv_key_rows(bs: int) -> int:
    """Key rows per dK/dV program: the padded block, at most ``DKV_KEY_ROWS``."""
    return min(_next_pow2(bs), _key_rows(DKV_KEY_ROWS))


def _dkv_warps(bs: int, heads: dict) -> int:
    """8 warps; 16 when the fp32 dK/dV accumulators of one program pass 32K values (only with ``DKV_KEY_ROWS``
    above 64 and wide heads)."""
    return 16 if _block_values(_dkv_key_rows(bs), heads) > 32768 else DKV_WARPS


def _dq_atomic_fits(bs: int, heads: dict) -> bool:
    """Whether the dK/dV kernel may also compute dQ: its extra ``[rows, Dqk]`` product takes it from 80.5 to 112.5
    KiB of shared memory at the paper's shape (sm_90), and past 176 KiB once a program's ``key rows·(Dqk + Dv)``
    (padded) reaches 32K values (Dqk = Dv = 256 with 64 key rows); those shapes keep the query-major dQ kernel."""
    return _block_values(_dkv_key_rows(bs), heads) < 32768


def _shape(G: int, K: int, bs: int, Dqk: int, Dv: int) -> str:
    return f"G={G}, selected_block_count={K}, selected_block_size={bs}, Dqk={Dqk}, Dv={Dv}"


def _dot_args(q) -> dict:
    import triton.language as tl

    if _interpreting() or q.dtype == torch.float32:
        # fp32 dots must be exact (no tf32); the interpreter cannot do bf16/fp16 arithmetic
        return {"DOT": tl.float32, "PREC": "ieee"}
    return {"DOT": tl.float16 if q.dtype == torch.float16 else tl.bfloat16, "PREC": "tf32"}


def _token_meta(cu_q, cu_kv, device):
    """Per query token: position in its sequence (int32), first key row of its sequence (int64), S2 (int32)."""
    seq_id, pos = token_seq_positions(cu_q, device=device)
    kv0 = device_tensor(cu_kv[:-1], torch.int64, device)[seq_id]
    s2 = device_tensor(seq_lengths(cu_kv), torch.int32, device)[seq_id]
    return seq_id, pos.to(torch.int32), kv0, s2


def _key_blocks(s2, bs: int):
    """Key blocks of each query token's sequence, ``ceil(S2 / bs)`` (``s2 [T1]`` from ``_token_meta``)."""
    return torch.div(s2.to(torch.int64) + (bs - 1), bs, rounding_mode="floor")


def pack_size(G: int) -> int:
    """Query tokens per forward / dQ program: ``PACK_ROWS // next_pow2(G)`` for G < 16 (G = 1: 16, G = 2: 8,
    G = 3 or 4: 4, G = 5..8: 2), else 1."""
    return max(1, PACK_ROWS // _next_pow2(G))


def wide_pack_size(G: int) -> int:
    """Query tokens per wide program: ``WIDE_ROWS // next_pow2(G)`` (G = 16: 4, G = 32: 2, G = 1: 64)."""
    return max(1, WIDE_ROWS // _next_pow2(G))


def _wide_on(q, G: int, bs: int, heads: dict, dq: bool = False) -> bool:
    """Whether the forward (dQ: ``dq``) launches try wide packs: half-precision inputs (fp32 dots are exact ``ieee``
    ones, no tensor cores to gain; the interpreter takes them for every dtype), the dQ only on warpgroup-MMA GPUs,
    when a wide pack holds more tokens than an ordinary one and a key block is at most ``WIDE_MAX_BLOCK_VALUES``."""
    return (WIDE_ROWS > 0 and not (dq and _triton.mma_sync_only(_triton.arch(q.device)))
            and (q.dtype != torch.float32 or WIDE_FP32 or _interpreting())
            and wide_pack_size(G) > pack_size(G) and _block_values(bs, heads) <= WIDE_MAX_BLOCK_VALUES)


def _wide_share(q) -> float:
    return WIDE_SHARE_MMA_SYNC if _triton.mma_sync_only(_triton.arch(q.device)) else WIDE_SHARE


def _q_tile(G: int, K: int, bs: int, heads: dict, dq: bool = False, P: int | None = None) -> tuple[dict, int]:
    """Tile constexprs of the query-major kernels (rows = P tokens x BLOCK_G heads; ``P = pack_size(G)`` unless
    given) and their warp count: 4 for 16 rows, 8 for more. The packed dQ also takes 8 when a key block holds
    >= 32K values (padded ``bs * (Dqk + Dv)``, e.g. bs = 64 with Dqk = Dv = 256): with 4 it spills there (sm_90
    compile check)."""
    P = pack_size(G) if P is None else P
    block_g = _next_pow2(G) if P > 1 else max(16, _next_pow2(G))
    wide = dq and P > 1 and _block_values(bs, heads) >= 32768
    tile = {"BLOCK_G": block_g, "PACK": P, "BLOCK_K": _next_pow2(K),
            "BLOCK_KC": min(_next_pow2(bs), _key_rows(DQ_KEY_ROWS if dq else FWD_KEY_ROWS))}
    return tile, 4 if P * block_g <= 16 and not wide else 8


def build_pack_table(topk, cu_q, P: int, blocks) -> dict:
    """Packs of up to P consecutive query tokens of one sequence, and the distinct blocks each pack selected.

    Built with torch ops on the device; the pack count comes from the host-side ``cu_q`` (no sync).
    E.g. P = 4, sequences of 6, 0, 1 tokens (``cu_q = [0, 6, 6, 7]``): packs start at tokens 0, 4, 6 with
    4, 2, 1 tokens. ``blocks [T1]``: the key blocks of each token's sequence (``ceil(S2 / bs)``). Returns int
    tensors ``pk_t0 [n_packs]`` (first token, int64), ``pk_n [n_packs]`` (tokens in the pack, 1..P),
    ``pk_ids [n_packs, N2, P*K]`` (the block ids the pack's tokens selected, each once, ascending, then −1
    padding; a per-sequence id, like ``topk``) and ``pk_nu [n_packs, N2]`` (how many). A −1 slot and
    (``validate=False``) an id outside ``[0, blocks)`` list nothing: such an id is an empty slot, so it changes
    neither the programs' steps nor the wide-or-ordinary choice of ``_q_plan``, and the outputs equal those of
    the −1 slot bitwise. How often each token selected a block is recounted in the kernel from ``topk``.
    """
    dev = topk.device
    T1, N2, K = topk.shape
    lens = seq_lengths(cu_q)
    per_seq = [-(-s // P) for s in lens]
    n_packs = sum(per_seq)
    per_seq_t = device_tensor(per_seq, torch.int64, dev)
    pk_seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), per_seq_t, output_size=n_packs)
    first = torch.cumsum(per_seq_t, 0) - per_seq_t
    starts = device_tensor(cu_q[:-1], torch.int64, dev)
    ends = device_tensor(cu_q[1:], torch.int64, dev)
    pk_t0 = starts[pk_seq] + (torch.arange(n_packs, device=dev) - first[pk_seq]) * P
    pk_n = torch.clamp(ends[pk_seq] - pk_t0, max=P)
    o_j = torch.arange(P, device=dev)
    live = o_j[None, :] < pk_n[:, None]  # [n_packs, P]
    tok = torch.where(live, pk_t0[:, None] + o_j[None, :], 0)
    none = torch.iinfo(torch.int32).max  # sorts after every block id
    # [n_packs, P, N2, K]; compared in int64 before the cast, so that no int64 id wraps into a real block
    raw = topk[tok]
    ok = live[:, :, None, None] & (raw >= 0) & (raw < blocks.to(torch.int64)[tok][:, :, None, None])
    ids = torch.where(ok, raw, none).to(torch.int32)
    ids = ids.transpose(1, 2).reshape(n_packs, N2, P * K).sort(-1).values
    repeat = torch.cat([torch.zeros_like(ids[..., :1], dtype=torch.bool), ids[..., 1:] == ids[..., :-1]], -1)
    ids = torch.where(repeat, none, ids).sort(-1).values
    keep = ids != none
    return {
        "pk_t0": pk_t0,
        "pk_n": pk_n.to(torch.int32),
        "pk_ids": torch.where(keep, ids, -1).contiguous(),
        "pk_nu": keep.sum(-1, dtype=torch.int32),
        "n_packs": n_packs,
    }


def _q_launch(topk, cu_q, blocks, G, K, bs, heads, pos, dq=False):
    """Grid size, pack-table kernel arguments, constexprs and warps of the ordinary forward / dQ launch."""
    tile, warps = _q_tile(G, K, bs, heads, dq)
    if tile["PACK"] == 1:
        # the kernels never read the pack table: any int tensor stands in
        return topk.shape[0], (pos, pos, pos, pos), tile, warps
    pk = build_pack_table(topk, cu_q, tile["PACK"], blocks)
    return pk["n_packs"], (pk["pk_t0"], pk["pk_n"], pk["pk_ids"], pk["pk_nu"]), tile, warps


def _q_plan(q, topk, cu_q, blocks, G, K, bs, heads, pos, dq=False) -> list[tuple]:
    """The forward / dQ launches, ``[(n_programs, pack-table args, run, tile, warps)]``.

    Without wide packs (``_wide_on``): the ordinary launch, ``run = None`` (every program runs). With them: the
    wide launch, then the ordinary one, each with ``run [n_programs, N2]`` int8 flags that give every (token,
    KV head) to exactly one of them: a wide pack runs where its distinct blocks ``U`` are at most ``WIDE_SHARE``
    (``WIDE_SHARE_MMA_SYNC`` on mma.sync GPUs) of the block steps of the ordinary programs that cover its tokens,
    and those programs run where it does not.
    """
    n_s, pk_s, tile_s, warps_s = _q_launch(topk, cu_q, blocks, G, K, bs, heads, pos, dq)
    dev = topk.device
    if not _wide_on(q, G, bs, heads, dq):
        return [(n_s, pk_s, None, tile_s, warps_s)]
    T1 = topk.shape[0]
    P_w = wide_pack_size(G)
    tile_w, warps_w = _q_tile(G, K, bs, heads, dq, P=P_w)
    w = build_pack_table(topk, cu_q, P_w, blocks)
    tok_w = torch.repeat_interleave(torch.arange(w["n_packs"], device=dev), w["pk_n"].to(torch.int64),
                                    output_size=T1)  # the wide pack of each token
    if tile_s["PACK"] == 1:
        w_of_s = tok_w  # ordinary programs are tokens, K block steps each
        steps = w["pk_n"].to(torch.float32)[:, None] * K
    else:
        w_of_s = tok_w[pk_s[0]]  # packs never cross a sequence, wide ones are whole ordinary ones
        steps = torch.zeros(w["pk_nu"].shape, dtype=torch.float32, device=dev).index_add_(
            0, w_of_s, pk_s[3].to(torch.float32))
    run_w = w["pk_nu"].to(torch.float32) <= _wide_share(q) * steps  # [n_w, N2]
    run_s = ~run_w[w_of_s]
    return [
        (w["n_packs"], (w["pk_t0"], w["pk_n"], w["pk_ids"], w["pk_nu"]), run_w.to(torch.int8).contiguous(),
         tile_w, warps_w),
        (n_s, pk_s, run_s.to(torch.int8).contiguous(), tile_s, warps_s),
    ]


def pack_stats(q, topk, cu_q, cu_kv, bs: int, Dv: int) -> dict:
    """What the forward's launches will do for these inputs (same plan as ``forward``; a host sync, for
    benchmarks and docs): running ``wide_programs`` / ``ordinary_programs`` (per KV head) and their block steps
    (``wide_steps``, ``ordinary_steps``: key blocks loaded and multiplied), and ``token_steps`` = T1·N2·K, the
    block loads of one program per token."""
    T1, N2, K = topk.shape
    G = q.shape[1] // N2
    _, pos, _, s2 = _token_meta(cu_q, cu_kv, q.device)
    plan = _q_plan(q, topk, cu_q, _key_blocks(s2, bs), G, K, bs, _head_blocks(q.shape[2], Dv), pos)
    out = {"wide_programs": 0, "wide_steps": 0, "ordinary_programs": 0, "ordinary_steps": 0, "token_steps": T1 * N2 * K}
    for i, (n, pk, run, tile, _) in enumerate(plan):
        kind = "wide" if len(plan) == 2 and i == 0 else "ordinary"
        steps = torch.full((n, N2), K, device=q.device) if tile["PACK"] == 1 else pk[3]
        on = torch.ones_like(steps, dtype=torch.bool) if run is None else run.bool()
        out[f"{kind}_programs"] = int(on.sum())
        out[f"{kind}_steps"] = int(steps[on].sum())
    return out


def _launch_q(kernel, plan, dev, head, tail, **meta) -> None:
    """Launch the ``_q_plan`` launches of ``kernel`` with arguments ``(*head, *pack table, run, *tail)``. A launch
    that does not fit the device's shared memory takes a block in smaller steps (``BLOCK_KC`` halved, down to
    16); a wide one that still does not fit leaves all its tokens to the ordinary launch."""
    wide_failed = False
    for i, (n, pk, run, tile, warps) in enumerate(plan):
        gate = run is not None and not wide_failed
        while True:
            try:
                _triton.launch(kernel, (n, meta["N2"]), dev, (*head, *pk, run if gate else pk[0], *tail),
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
        (q, k, v, topk, out, m, l, pos, kv0, s2), (float(scale),),
        num_stages=FWD_STAGES, shape=_shape(G, K, bs, Dqk, Dv),
        N1=N1, N2=N2, G=G, K=K, BS=bs, BLOCK_BS=_next_pow2(bs), Dqk=Dqk, Dv=Dv,
        CAUSAL=bool(causal), **heads, **_dot_args(q), USE_WHILE=_interpreting(),
    )
    return out, m, l


def build_inverse_index(topk, seq_id, bs, cu_kv, chunk):
    """The dK/dV work list, built on the device without a host sync.

    Global key blocks are numbered ``gb = n2 * NB + blk_base[seq] + idx`` (NB = key blocks of all sequences).
    Returns a dict of int tensors: ``ent_tok`` (query token of each (token, n2, slot) entry, sorted stably by
    ``gb``), per chunk ``ch_blk`` (gb, -1 for the unused tail of the grid), ``ch_e0``/``ch_e1`` (entry range),
    per block ``blk_row0`` (flat ``key_row * N2 + n2`` of its first key), ``blk_p0`` (in-sequence position of
    its first key), ``blk_n`` (keys in it), ``blk_c0``/``blk_c1`` (its chunk range), and ``n_chunks`` (grid
    size: an upper bound, ``ceil(T1*N2*K / chunk) + N2*NB``).
    """
    dev = topk.device
    T1, N2, K = topk.shape
    lens = seq_lengths(cu_kv)
    nblk = [-(-s // bs) for s in lens]
    NB = sum(nblk)
    NBG = N2 * NB
    nblk_t = device_tensor(nblk, torch.int64, dev)
    blk_base = torch.cumsum(nblk_t, 0) - nblk_t
    # per global block
    blk_seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), nblk_t, output_size=NB)
    blk_loc = torch.arange(NB, device=dev) - blk_base[blk_seq]
    p0 = blk_loc * bs
    kv_start = device_tensor(cu_kv[:-1], torch.int64, dev)
    s2 = device_tensor(lens, torch.int64, dev)
    n_keys = torch.clamp(s2[blk_seq] - p0, max=bs)
    n2s = torch.arange(N2, device=dev)[:, None]
    blk_row0 = ((kv_start[blk_seq] + p0)[None, :] * N2 + n2s).reshape(-1)
    blk_p0 = p0.expand(N2, NB).reshape(-1).to(torch.int32)
    blk_n = n_keys.expand(N2, NB).reshape(-1).to(torch.int32)
    # entries
    idx = topk.to(torch.int64)
    gb = n2s[None] * NB + blk_base[seq_id][:, None, None] + idx  # [T1, N2, K]
    # -1 slots, and (validate=False) ids past the sequence's blocks, which the forward and dQ mask by p < S2: no
    # entry, so dK/dV stay the gradient of the forward instead of landing on the next sequence's keys
    live = (idx >= 0) & (idx < nblk_t[seq_id][:, None, None])
    gb = torch.where(live, gb, torch.full_like(gb, NBG)).reshape(-1)
    order = torch.argsort(gb, stable=True)
    gb_sorted = gb[order]
    ent_tok = torch.div(order, N2 * K, rounding_mode="floor").to(torch.int32)
    ar = torch.arange(NBG, device=dev)
    blk_e0 = torch.searchsorted(gb_sorted, ar)
    blk_e1 = torch.searchsorted(gb_sorted, ar, right=True)
    nch = torch.div(blk_e1 - blk_e0 + chunk - 1, chunk, rounding_mode="floor")
    blk_c1 = torch.cumsum(nch, 0)
    blk_c0 = blk_c1 - nch
    n_chunks = -(-(T1 * N2 * K) // chunk) + NBG
    c = torch.arange(n_chunks, device=dev)
    cb = torch.searchsorted(blk_c1, c, right=True)
    valid = cb < NBG
    cbc = torch.clamp(cb, max=max(NBG - 1, 0))
    e0 = blk_e0[cbc] + (c - blk_c0[cbc]) * chunk
    e1 = torch.minimum(e0 + chunk, blk_e1[cbc])
    zero = torch.zeros_like(e0)
    return {
        "ent_tok": ent_tok,
        "ch_blk": torch.where(valid, cb, torch.full_like(cb, -1)),
        "ch_e0": torch.where(valid, e0, zero),
        "ch_e1": torch.where(valid, e1, zero),
        "blk_row0": blk_row0,
        "blk_p0": blk_p0,
        "blk_n": blk_n,
        "blk_c0": blk_c0,
        "blk_c1": blk_c1,
        "n_chunks": n_chunks,
        "n_blocks": NBG,
    }


def backward(q, k, v, out, dout, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=False):
    _check_dtype(q)
    from . import triton_kernels as kern

    T1, N1, Dqk = q.shape
    T2, N2, Dv = v.shape
    G, K = N1 // N2, topk.shape[2]
    dev = q.device
    if T1 == 0 or T2 == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
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
    dq_atomic = DQ_ATOMIC and not deterministic and _dq_atomic_fits(bs, heads)
    if dq_atomic:
        # dQ comes from the dK/dV kernel; D = rowsum(dY * O) as the dQ kernel would have written it
        block_dv = max(16, _next_pow2(Dv))
        block_r = max(1, 4096 // block_dv)
        _triton.launch(kern.nsa_bwd_delta_kernel, (-(-(T1 * N1) // block_r),), dev, (out, dout, delta, T1 * N1),
                       num_warps=4, Dv=Dv, BLOCK_R=block_r, BLOCK_DV=block_dv)
        dq32 = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    else:
        dq32 = delta  # unused stand-in pointer
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        _launch_q(
            kern.nsa_bwd_dq_kernel, _q_plan(q, topk, cu_q, _key_blocks(s2, bs), G, K, bs, heads, pos, dq=True), dev,
            (q, k, v, out, dout, m, l, delta, topk, dq, pos, kv0, s2), (float(scale),),
            num_stages=FWD_STAGES, shape=shape,
            N1=N1, N2=N2, G=G, K=K, BS=bs, BLOCK_BS=block_bs, Dqk=Dqk, Dv=Dv,
            CAUSAL=bool(causal), **heads, **dots, USE_WHILE=_interpreting(),
        )

    ix = build_inverse_index(topk, seq_id, bs, cu_kv, CHUNK)
    if ix["n_blocks"] == 0:
        return dq32.to(q.dtype) if dq_atomic else dq, torch.zeros_like(k), torch.zeros_like(v)
    rows = DKV_ROWS_MMA_SYNC if _triton.mma_sync_only(_triton.arch(dev)) else DKV_ROWS
    # a step's tile rows: BLOCK_E tokens x all their heads, or one group of `rows` heads of one token
    gk = min(_next_pow2(G), max(16, rows))
    hg = _next_pow2(G) // gk
    block_e = max(1, rows // gk)
    key_rows = _dkv_key_rows(bs)
    common = dict(
        N1=N1, N2=N2, G=G, BS=bs, BLOCK_BS=block_bs, BLOCK_KR=key_rows, Dqk=Dqk, Dv=Dv,
        BLOCK_G=gk, HG=hg, BLOCK_E=block_e,
        CAUSAL=bool(causal), **heads, **dots, num_warps=_dkv_warps(bs, heads), num_stages=DKV_STAGES, shape=shape,
        USE_WHILE=_interpreting(),
    )
    n_ch = ix["n_chunks"]
    grid = (n_ch, block_bs // key_rows)
    args = (q, k, v, dout, m, l, delta, ix["ent_tok"], ix["ch_blk"], ix["ch_e0"], ix["ch_e1"],
            ix["blk_row0"], ix["blk_p0"], ix["blk_n"], pos)
    if deterministic:
        ws_k = torch.empty(n_ch, block_bs, Dqk, dtype=torch.float32, device=dev)
        ws_v = torch.empty(n_ch, block_bs, Dv, dtype=torch.float32, device=dev)
        _triton.launch(kern.nsa_bwd_dkv_kernel, grid, dev, (*args, ws_k, ws_v, ws_k, ws_v, ws_k, float(scale)),
                       DETERMINISTIC=True, DQ_ATOMIC=False, **common)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        block_d = 64 if min(Dqk, Dv) >= 64 else 16
        n_cols = -(-Dqk // block_d) + -(-Dv // block_d)
        _triton.launch(
            kern.nsa_bwd_reduce_kernel, (ix["n_blocks"], n_cols), dev,
            (ws_k, ws_v, ix["blk_c0"], ix["blk_c1"], ix["blk_row0"], ix["blk_n"], dk, dv),
            num_warps=4, N2=N2, BS=bs, BLOCK_BS=block_bs, Dqk=Dqk, Dv=Dv, BLOCK_D=block_d,
        )
        return dq, dk, dv
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv32 = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    _triton.launch(kern.nsa_bwd_dkv_kernel, grid, dev, (*args, dk32, dv32, dk32, dv32, dq32, float(scale)),
                   DETERMINISTIC=False, DQ_ATOMIC=dq_atomic, **common)
    return dq32.to(q.dtype) if dq_atomic else dq, dk32.to(k.dtype), dv32.to(v.dtype)


def compile_report(arch: int, *, G: int, N2: int = 1, Dqk: int, Dv: int, bs: int, K: int,
                   dtype: torch.dtype = torch.bfloat16, causal: bool = True) -> list[dict]:
    """Compile, without running and without a GPU, every launch of the forward and of the three backward variants
    (atomic, deterministic, ``DQ_ATOMIC``) for ``sm_<arch>`` at this shape (``_triton.offline_compile``).

    The shape is checked like the op's arguments first (``ValueError`` / ``TypeError``). Returns one dict per
    launch, ``{"variant", "kernel", "rows", "keys", "warps", "stages", "shared", "registers", "spill_bytes"}``
    (``rows``, ``keys``: tile rows and key rows of a forward / dQ / dK/dV step; the rows tell the wide and ordinary
    launches apart, the keys show a block taken in parts), or per variant
    that does not fit that GPU ``{"variant", "error"}`` (what ``backend="triton"`` would raise there).
    """
    global DQ_ATOMIC
    from . import api

    _check_dtype(torch.empty(0, dtype=dtype))
    for name, n in (("G", G), ("N2", N2), ("Dqk", Dqk), ("Dv", Dv), ("selected_block_size", bs),
                    ("selected_block_count", K)):
        _checks.check_int(name, n, lo=1)  # before sizing the example tensors with them
    seqs = [3 * max(bs, 16) // 2, 5]  # a partial last key block, a second sequence
    T = sum(seqs)
    q = torch.zeros(T, N2 * G, Dqk, dtype=dtype)
    k = torch.zeros(T, N2, Dqk, dtype=dtype)
    v = torch.zeros(T, N2, Dv, dtype=dtype)
    topk = torch.zeros(T, N2, K, dtype=torch.int32)
    cum = [seqs[0], T]
    scale, bs, cu_q, cu_kv, causal, _ = api._check_args(
        q, k, v, topk, 1.0, N2 * G, bs, K, None, cum, cum, 2 if causal else 0, "TND", True)
    out = torch.zeros(T, N2 * G, Dv, dtype=dtype)
    m, l = torch.zeros(T, N2 * G), torch.ones(T, N2 * G)
    rows = []
    for variant, det, dqa in (("forward", None, False), ("backward", False, False),
                              ("deterministic", True, False), ("DQ_ATOMIC", False, True)):
        saved, DQ_ATOMIC = DQ_ATOMIC, dqa
        try:
            with _triton.offline_compile(arch) as launches:
                if det is None:
                    forward(q, k, v, topk, scale, bs, cu_q, cu_kv, causal)
                else:
                    backward(q, k, v, out, out, m, l, topk, scale, bs, cu_q, cu_kv, causal, deterministic=det)
        except _triton.DoesNotFit as e:
            rows.append({"variant": variant, "error": str(e)})
            continue
        finally:
            DQ_ATOMIC = saved
        for x in launches:
            tile = x.meta.get("PACK", x.meta.get("BLOCK_E", 0)) * x.meta.get("BLOCK_G", 0)
            keys = x.meta.get("BLOCK_KC", x.meta.get("BLOCK_KR", x.meta.get("BLOCK_BS"))) if tile else None
            rows.append({"variant": variant, "kernel": x.kernel, "rows": tile or None, "keys": keys,
                         "warps": x.num_warps, "stages": x.stages, "shared": x.shared, **x.resources()})
    return rows
