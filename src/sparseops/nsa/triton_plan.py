"""Launch planning of the NSA Triton kernels: the tuning knobs, tile sizes, pack tables and the dK/dV work list.

Everything here is torch ops on the device (no host sync) and plain integer arithmetic on the host; the launchers
in ``triton_impl.py`` turn a plan into kernel launches. docs/nsa.md (GPU section) describes the design.

- Token packs (forward and dQ): G >= 9 runs one token per program, its G heads the tile rows (padded to 16 for
  ``tl.dot``). G <= 8 packs ``P = pack_size(G)`` consecutive tokens of one sequence into one program (tile row
  ``x = j * next_pow2(G) + g`` is head g of token j); ``build_pack_table`` lists each pack's distinct selected
  blocks, each loaded and multiplied once for all rows.
- Wide packs: 64-row packs (``wide_pack_size``) run instead where their tokens share enough blocks
  (``NsaTritonSettings.wide_share``), decided per (pack, KV head) on the device by ``_q_plan``; both launches are
  gated by per-program run flags, so every (token, KV head) runs in exactly one program.
- dK/dV: ``build_inverse_index`` lists, per key block of each KV head, the query tokens that selected it, cut into
  chunks of ``NsaTritonSettings.chunk`` entries (one program each).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _checks, _triton
from .._settings import Settings
from .._varlen import device_tensor, seq_lengths, token_seq_positions


@dataclasses.dataclass(frozen=True)
class NsaTritonSettings:
    """Tuning knobs of the NSA Triton backend (``SETTINGS.get()`` reads them, ``SETTINGS.override`` swaps them)."""

    #: entries (query tokens) per dK/dV program; also sizes the deterministic workspace
    chunk: int = 256
    #: target tile rows (tokens x heads) per step of the dK/dV kernel on warpgroup-MMA GPUs (sm_90, sm_100)
    dkv_rows: int = 32
    #: the same on mma.sync GPUs (sm_8x, sm_120), where 32 rows spill at the paper's shape and 16 do not
    dkv_rows_mma_sync: int = 16
    #: key rows per dK/dV program: a wider (padded) block is split over programs (bs = 128: two of 64 rows), so
    #: that its K/V rows and fp32 accumulators fit in shared memory and registers; a power of two (other values
    #: are rounded down)
    dkv_key_rows: int = 64
    #: tile rows the forward / dQ kernels fill by packing consecutive tokens when G < 16 (mma.sync needs M >= 16)
    pack_rows: int = 16
    #: tile rows of a wide pack, tried by the forward and dQ on warpgroup-MMA GPUs (sm_90, sm_100; and under the
    #: interpreter), by the forward alone on mma.sync GPUs (the wide dQ spills there): at 64 rows the products
    #: compile to wgmma / tcgen05, and a block that the pack's tokens share is loaded once for all of them. 0: off
    wide_rows: int = 64
    #: a (wide pack, KV head) runs as one wide program when its distinct blocks are at most this share of the block
    #: steps its tokens take in ordinary programs (their packs' distinct blocks; K per token when G >= 9), else as
    #: those ordinary programs: a 64-row step costs about twice a 16-row one (4x the FLOPs on ~2x faster MMA, the
    #: same K/V bytes). Untuned (``benchmarks/gpu_nsa.py --tune``)
    wide_share: float = 0.5
    #: the same on mma.sync GPUs, where a 64-row step costs about 4x a 16-row one: wide packs never do more MMA work
    #: than the ordinary programs they replace, and load fewer blocks. Untuned
    wide_share_mma_sync: float = 0.25
    #: fp32 inputs take wide packs too (off: their exact ``ieee`` dots use no tensor cores, so 64 rows gain
    #: nothing; the kernel tests turn it on so that a GPU run checks wide packs in fp32, as the interpreter does)
    wide_fp32: bool = False
    #: wide packs only where a key block holds at most this many values (padded ``bs * (Dqk + Dv)``): larger
    #: blocks spill in the wide dQ kernel on sm_90
    wide_max_block_values: int = 40960
    #: key rows per step of the dQ kernel: a wider (padded) block is taken in steps of this many; a dQ launch that
    #: does not fit the device's shared memory is retried with half as many, down to 16; a power of two (other
    #: values are rounded down)
    dq_key_rows: int = 128
    #: the same for the forward kernel
    fwd_key_rows: int = 128
    #: default (non-deterministic) backward: compute dQ inside the dK/dV kernel with fp32 atomics instead of the
    #: query-major dQ kernel (saves re-gathering every selected K/V block; costs a ``[T1, N1, Dqk]`` fp32 buffer).
    #: Off by default (``benchmarks/gpu_nsa.py --tune`` times both on a GPU); the deterministic path never
    #: uses it
    dq_atomic: bool = False
    #: pipeline stages of the forward and dQ kernels (fewer where shared memory runs short: ``_triton.launch``)
    fwd_stages: int = 2
    #: warps and pipeline stages of the dK/dV kernel
    dkv_warps: int = 8
    dkv_stages: int = 2


SETTINGS = Settings(NsaTritonSettings())


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _key_rows(knob: int) -> int:
    """A key-rows knob as the kernels can take it: a power of two (rounded down), at least 16. A step count
    of ``padded block // rows`` must cover the block exactly: 48 would skip rows."""
    return max(16, 1 << (max(1, int(knob)).bit_length() - 1))


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
    """Key rows per dK/dV program: the padded block, at most ``dkv_key_rows``."""
    return min(_next_pow2(bs), _key_rows(SETTINGS.get().dkv_key_rows))


def _dkv_warps(bs: int, heads: dict) -> int:
    """``dkv_warps``; 16 when the fp32 dK/dV accumulators of one program pass 32K values (only with
    ``dkv_key_rows`` above 64 and wide heads)."""
    return 16 if _block_values(_dkv_key_rows(bs), heads) > 32768 else SETTINGS.get().dkv_warps


def _dq_atomic_fits(bs: int, heads: dict) -> bool:
    """Whether the dK/dV kernel may also compute dQ: its extra ``[rows, Dqk]`` product needs more shared memory,
    too much once a program's ``key rows·(Dqk + Dv)`` (padded) reaches 32K values (Dqk = Dv = 256 with 64 key
    rows); those shapes keep the query-major dQ kernel."""
    return _block_values(_dkv_key_rows(bs), heads) < 32768


def _dkv_tile(G: int, device) -> dict:
    """Tile constexprs of the dK/dV kernel: a step's rows are ``BLOCK_E`` tokens x all their heads, or one group of
    ``BLOCK_G`` of a token's ``HG * BLOCK_G`` heads (where a token's heads are more rows than a step takes)."""
    st = SETTINGS.get()
    rows = st.dkv_rows_mma_sync if _triton.mma_sync_only(_triton.arch(device)) else st.dkv_rows
    gk = min(_next_pow2(G), max(16, rows))
    return {"BLOCK_G": gk, "HG": _next_pow2(G) // gk, "BLOCK_E": max(1, rows // gk)}


def _token_meta(cu_q, cu_kv, device):
    """Per query token: sequence id, position in its sequence (int32), first key row of its sequence (int64),
    S2 (int32)."""
    seq_id, pos = token_seq_positions(cu_q, device=device)
    kv0 = device_tensor(cu_kv[:-1], torch.int64, device)[seq_id]
    s2 = device_tensor(seq_lengths(cu_kv), torch.int32, device)[seq_id]
    return seq_id, pos.to(torch.int32), kv0, s2


def _key_blocks(s2, bs: int):
    """Key blocks of each query token's sequence, ``ceil(S2 / bs)`` (``s2 [T1]`` from ``_token_meta``)."""
    return torch.div(s2.to(torch.int64) + (bs - 1), bs, rounding_mode="floor")


def pack_size(G: int) -> int:
    """Query tokens per forward / dQ program: ``pack_rows // next_pow2(G)`` for G < 16 (G = 1: 16, G = 2: 8,
    G = 3 or 4: 4, G = 5..8: 2), else 1."""
    return max(1, SETTINGS.get().pack_rows // _next_pow2(G))


def wide_pack_size(G: int) -> int:
    """Query tokens per wide program: ``wide_rows // next_pow2(G)`` (G = 16: 4, G = 32: 2, G = 1: 64)."""
    return max(1, SETTINGS.get().wide_rows // _next_pow2(G))


def _wide_on(q, G: int, bs: int, heads: dict, dq: bool = False) -> bool:
    """Whether the forward (dQ: ``dq``) launches try wide packs: half-precision inputs (fp32 dots are exact ``ieee``
    ones, no tensor cores to gain; the interpreter takes them for every dtype), the dQ only on warpgroup-MMA GPUs,
    when a wide pack holds more tokens than an ordinary one and a key block is at most ``wide_max_block_values``."""
    st = SETTINGS.get()
    return (st.wide_rows > 0 and not (dq and _triton.mma_sync_only(_triton.arch(q.device)))
            and (q.dtype != torch.float32 or st.wide_fp32 or _checks.triton_interpret())
            and wide_pack_size(G) > pack_size(G) and _block_values(bs, heads) <= st.wide_max_block_values)


def _wide_share(q) -> float:
    st = SETTINGS.get()
    return st.wide_share_mma_sync if _triton.mma_sync_only(_triton.arch(q.device)) else st.wide_share


def _q_tile(G: int, K: int, bs: int, heads: dict, dq: bool = False, P: int | None = None) -> tuple[dict, int]:
    """Tile constexprs of the query-major kernels (rows = P tokens x BLOCK_G heads; ``P = pack_size(G)`` unless
    given) and their warp count: 4 for 16 rows, 8 for more. The packed dQ also takes 8 when a key block holds
    >= 32K values (padded ``bs * (Dqk + Dv)``, e.g. bs = 64 with Dqk = Dv = 256): with 4 it spills there."""
    st = SETTINGS.get()
    P = pack_size(G) if P is None else P
    block_g = _next_pow2(G) if P > 1 else max(16, _next_pow2(G))
    wide = dq and P > 1 and _block_values(bs, heads) >= 32768
    tile = {"BLOCK_G": block_g, "PACK": P, "BLOCK_K": _next_pow2(K),
            "BLOCK_KC": min(_next_pow2(bs), _key_rows(st.dq_key_rows if dq else st.fwd_key_rows))}
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
    """Grid size, pack table ``(pk_t0, pk_n, pk_ids, pk_nu)``, constexprs and warps of the ordinary forward / dQ
    launch."""
    tile, warps = _q_tile(G, K, bs, heads, dq)
    if tile["PACK"] == 1:
        # the kernels never read the pack table: any int tensor stands in
        return topk.shape[0], (pos, pos, pos, pos), tile, warps
    pk = build_pack_table(topk, cu_q, tile["PACK"], blocks)
    return pk["n_packs"], (pk["pk_t0"], pk["pk_n"], pk["pk_ids"], pk["pk_nu"]), tile, warps


def _q_plan(q, topk, cu_q, blocks, G, K, bs, heads, pos, dq=False) -> list[tuple]:
    """The forward / dQ launches, ``[(n_programs, pack table, run, tile, warps)]``.

    Without wide packs (``_wide_on``): the ordinary launch, ``run = None`` (every program runs). With them: the
    wide launch, then the ordinary one, each with ``run [n_programs, N2]`` int8 flags that give every (token,
    KV head) to exactly one of them: a wide pack runs where its distinct blocks ``U`` are at most ``wide_share``
    (``wide_share_mma_sync`` on mma.sync GPUs) of the block steps of the ordinary programs that cover its tokens,
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
    """What the forward's launches will do for these inputs (same plan as ``triton_impl.forward``; a host sync,
    for benchmarks and docs): running ``wide_programs`` / ``ordinary_programs`` (per KV head) and their block steps
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
