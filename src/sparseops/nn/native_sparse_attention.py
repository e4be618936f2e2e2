"""Native Sparse Attention (Yuan et al. 2025, arXiv 2502.11089 §3) as a ``torch.nn.Module`` (docs/nsa-module.md)."""

from __future__ import annotations

import torch
from torch import nn

from .. import _checks
from .._varlen import token_seq_positions
from ..nsa.api import nsa_selected_attention
from ..nsa_branches import compress_kv, compressed_attention, select_blocks, sliding_window_attention
from ..nsa_branches.checks import DTYPES, cmp_cu_seqlens, cu_seqlens_list
from ..nsa_branches.gating import gated_sum
from .rope import apply_rope

BRANCHES = ("cmp", "slc", "win")


class BlockCompressor(nn.Module):
    """phi: a block of ``l`` rows -> one row, ``MLP(flatten(block + pos_emb))`` shared by the KV heads."""

    def __init__(self, block_size: int, dim: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.pos_emb = nn.Parameter(torch.zeros(block_size, dim, **kw))
        self.fc1 = nn.Linear(block_size * dim, dim, **kw)
        self.fc2 = nn.Linear(dim, dim, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``pos_emb`` from N(0, 0.02^2); ``fc1`` and ``fc2`` reset themselves (nn.Linear), so that
        ``reset_parameters()`` on every module after ``to_empty`` initialises each parameter once."""
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks [M, l, N2, D]`` -> ``[M, N2, D]``."""
        M, l, n2, D = blocks.shape
        x = (blocks + self.pos_emb[None, :, None, :]).permute(0, 2, 1, 3).reshape(M, n2, l * D)
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class NativeSparseAttention(nn.Module):
    """NSA attention layer on packed sequences: compressed, selected and sliding-window branches, gated per head.

    ``y = o_proj(sum_c g_c * o_c)`` with ``g = sigmoid(gate_proj(x))`` one gate per branch and query head; the
    branches (docs/nsa-module.md):

    - ``cmp``: keys/values compressed per block ``[j*d, j*d + l)`` by phi (``"mlp"``: a learned intra-block
      position embedding and a 2-layer MLP; ``"mean"``: mean pooling), attended causally (complete blocks only);
    - ``slc``: the ``select_count`` blocks of ``select_block_size`` keys with the highest Eq. 9 importance
      (the initial ``init_blocks`` and the ``local_blocks`` local blocks forced), via
      :func:`sparseops.nsa_selected_attention`;
    - ``win``: the last ``window_size`` keys.

    Each branch has its own key and value projection (the paper's independent keys and values): ``kv_proj``
    produces, in this order, ``k_cmp, v_cmp, k_slc, v_slc, k_win, v_win`` (``N2 * Dqk`` or ``N2 * Dv`` columns
    each). With ``rope_theta`` set, RoPE rotates the queries and the keys of every branch at their positions inside
    the sequence; a compressed key takes the position of its block's first token (``j*d``).

    ``branches`` lists the branches computed; the others get gate 0 and are not computed (``("win",)`` is a
    sliding-window-only model with the same parameters; ``"slc"`` computes the compressed scores it selects from).

    Args:
        hidden_size: model width. num_heads, num_kv_heads: ``N1``, ``N2`` with ``G = N1 / N2`` in ``[1, 32]``.
        head_dim, v_head_dim: ``Dqk`` and ``Dv <= Dqk`` (default ``Dqk``).
        compress_block_size, compress_stride: ``l`` and ``d`` with ``d | l``. select_block_size: ``l'``, a multiple
            of 16 in ``[16, 128]`` and of ``d``. select_count: ``n <= 128``, ``n * l' <= 8192``, at least
            ``init_blocks + local_blocks``. window_size: ``w``.
        compressor: ``"mlp"`` or ``"mean"``. rope_theta: None (no RoPE) or the RoPE base (``Dqk`` even).
        branches: a non-empty subset of ``("cmp", "slc", "win")``.
        backend: of the selected-attention op (``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int = 64,
                 v_head_dim: int | None = None, *, compress_block_size: int = 32, compress_stride: int = 16,
                 select_block_size: int = 64, select_count: int = 16, init_blocks: int = 1, local_blocks: int = 2,
                 window_size: int = 512, compressor: str = "mlp", rope_theta: float | None = None,
                 branches=BRANCHES, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        H = _checks.check_int("hidden_size", hidden_size, lo=1)
        N1 = _checks.check_int("num_heads", num_heads, lo=1)
        N2 = _checks.check_int("num_kv_heads", num_kv_heads, lo=1)
        if N1 % N2:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {N1}, got {N2}")
        if N1 // N2 > 32:
            raise ValueError(f"num_kv_heads: expected G = num_heads / num_kv_heads <= 32, got {N1} / {N2} = {N1 // N2}")
        Dqk = _checks.check_int("head_dim", head_dim, lo=1, hi=256)
        Dv = Dqk if v_head_dim is None else _checks.check_int("v_head_dim", v_head_dim, lo=1)
        if Dv > Dqk:
            raise ValueError(f"v_head_dim: expected <= head_dim = {Dqk} (the selected-attention op), got {Dv}")
        l = _checks.check_int("compress_block_size", compress_block_size, lo=1)
        d = _checks.check_int("compress_stride", compress_stride, lo=1)
        lb = _checks.check_int("select_block_size", select_block_size, lo=16, hi=128, multiple_of=16)
        if l % d:
            raise ValueError(f"compress_stride: expected a divisor of compress_block_size = {l}, got {d}")
        if lb % d:
            raise ValueError(f"compress_stride: expected a divisor of select_block_size = {lb}, got {d}")
        n = _checks.check_int("select_count", select_count, lo=1, hi=128)
        init = _checks.check_int("init_blocks", init_blocks, lo=0)
        local = _checks.check_int("local_blocks", local_blocks, lo=0)
        if n < init + local:
            raise ValueError(f"select_count: expected >= init_blocks + local_blocks = {init + local}, got {n}")
        if n * lb > 8192:
            raise ValueError(f"select_count: expected select_count * select_block_size <= 8192, got {n} * {lb}")
        w = _checks.check_int("window_size", window_size, lo=1)
        if compressor not in ("mlp", "mean"):
            raise ValueError(f"compressor: expected 'mlp' or 'mean', got {compressor!r}")
        if rope_theta is not None:
            rope_theta = _checks.check_float("rope_theta", rope_theta)
            if rope_theta <= 0:
                raise ValueError(f"rope_theta: expected > 0, got {rope_theta}")
            if Dqk % 2:
                raise ValueError(f"head_dim: expected an even size with rope_theta set, got {Dqk}")
        if not isinstance(branches, str) and hasattr(branches, "__iter__"):
            branches = tuple(branches)
        if not isinstance(branches, tuple) or not all(isinstance(b, str) and b in BRANCHES for b in branches) \
                or not branches or len(set(branches)) != len(branches):
            raise ValueError(f"branches: expected a non-empty subset of {BRANCHES}, got {branches!r}")
        _checks.resolve_backend(backend, torch.device("cpu") if device is None else torch.device(device))
        _checks.check_param_dtype(dtype, DTYPES)
        self.hidden_size, self.num_heads, self.num_kv_heads = H, N1, N2
        self.head_dim, self.v_head_dim = Dqk, Dv
        self.compress_block_size, self.compress_stride = l, d
        self.select_block_size, self.select_count = lb, n
        self.init_blocks, self.local_blocks, self.window_size = init, local, w
        self.compressor, self.rope_theta = compressor, rope_theta
        self.branches = tuple(b for b in BRANCHES if b in branches)
        self.backend = backend
        self.scale = Dqk ** -0.5
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(H, N1 * Dqk, bias=False, **kw)
        self.kv_proj = nn.Linear(H, 3 * N2 * (Dqk + Dv), bias=False, **kw)
        self.gate_proj = nn.Linear(H, 3 * N1, **kw)
        self.o_proj = nn.Linear(N1 * Dv, H, bias=False, **kw)
        if compressor == "mlp":
            self.k_compressor = BlockCompressor(l, Dqk, **kw)
            self.v_compressor = BlockCompressor(l, Dv, **kw)
        self.register_buffer("gate_mask", torch.tensor([b in self.branches for b in BRANCHES], **kw),
                             persistent=False)

    def reset_buffers(self) -> None:
        """Re-initialise the non-persistent buffer (``gate_mask``: 1 for each enabled branch), e.g. after
        ``to_empty``."""
        with torch.no_grad():
            self.gate_mask.copy_(torch.tensor([b in self.branches for b in BRANCHES]))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, blocks=(l={self.compress_block_size}, "
                f"d={self.compress_stride}, l'={self.select_block_size}, n={self.select_count}), "
                f"window_size={self.window_size}, compressor={self.compressor!r}, rope_theta={self.rope_theta}, "
                f"branches={self.branches}")

    def forward(self, x: torch.Tensor, cu_seqlens=None, return_info: bool = False):
        """``x [T, hidden_size]`` (packed sequences, the dtype of the parameters) -> ``y [T, hidden_size]``.

        Args:
            x: ``[T, hidden_size]`` float16, bfloat16, float32 or float64.
            cu_seqlens: flash-attention cumulative lengths with the leading 0 (int tensor ``[B+1]`` or list of
                ints), or None for one sequence. Under ``torch.compile`` a tensor for packings that change, a list
                for a fixed one (docs/nsa-module.md, "`torch.compile`").
            return_info: also return a dict with ``topk_indices [T, N2, n]`` int32, ``gates [T, N1, 3]`` (cmp,
                slc, win; 0 for a branch not computed), and the branch outputs ``o_cmp``, ``o_slc``, ``o_win``
                ``[T, N1, Dv]`` (zeros for a branch not computed).

        Returns:
            ``y`` or ``(y, info)``.
        """
        x = _checks.check_hidden_states(x, self.hidden_size, self.q_proj.weight.dtype, DTYPES, self.q_proj.weight.device)
        return_info = _checks.check_bool("return_info", return_info)
        T = x.shape[0]
        # a tensor under torch.compile: its lengths are read in an eager region, so no graph depends on the packing
        eager_region = isinstance(cu_seqlens, torch.Tensor) and torch.compiler.is_compiling()
        cu = cu_seqlens if eager_region else cu_seqlens_list("cu_seqlens", cu_seqlens, T)
        N1, N2, Dqk, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        q = self.q_proj(x).view(T, N1, Dqk)
        kv = (t.view(T, N2, D) for t, D in zip(self.kv_proj(x).split([N2 * Dqk, N2 * Dv] * 3, dim=-1), [Dqk, Dv] * 3))
        gates = torch.sigmoid(self.gate_proj(x)).view(T, N1, 3) * self.gate_mask
        if eager_region:
            o_cmp, o_slc, o_win, topk = _branches_eager(self, cu, q, *kv)
        else:
            o_cmp, o_slc, o_win, topk = self._branches(cu, q, *kv)
        outs = (o_cmp, o_slc, o_win)
        on = [c for c, oc in enumerate(outs) if oc is not None]
        g = gates if len(on) == 3 else gates[..., on]  # the other gates are 0
        # under autocast the branches come out in its dtype, the gates (times the fp32 mask) in fp32
        o = gated_sum(g.to(outs[on[0]].dtype), *(outs[c] for c in on))
        y = self.o_proj(o.flatten(1))  # not T: after the eager region an int would specialise the graph
        if not return_info:
            return y
        zeros = q.new_zeros((q.shape[0], N1, Dv))
        o_cmp, o_slc, o_win = (zeros if oc is None else oc for oc in outs)
        return y, {"topk_indices": topk, "gates": gates, "o_cmp": o_cmp, "o_slc": o_slc, "o_win": o_win}

    def _branches(self, cu: list[int], q, k_c, v_c, k_s, v_s, k_w, v_w):
        """The branches on the packed layout ``cu``: ``(o_cmp, o_slc, o_win, topk_indices)``, None for a branch
        not computed; RoPE first where set. Everything that reads the lengths runs here."""
        T, N1, _ = q.shape
        N2 = k_c.shape[1]
        l, d, lb = self.compress_block_size, self.compress_stride, self.select_block_size
        if self.rope_theta is not None:
            pos = token_seq_positions(cu, device=q.device)[1]
            q, k_s, k_w = (apply_rope(t, pos, self.rope_theta) for t in (q, k_s, k_w))
        o_cmp = o_slc = o_win = None  # a branch not computed
        topk = q.new_full((T, N2, self.select_count), -1, dtype=torch.int32)
        if "cmp" in self.branches or "slc" in self.branches:
            phi = None if self.compressor == "mean" else (self.k_compressor, self.v_compressor)
            kc, vc, _ = compress_kv(k_c, v_c, cu, l, d, compressor=phi)
            cu_cmp = cmp_cu_seqlens(cu, l, d)
            if self.rope_theta is not None:
                kc = apply_rope(kc, token_seq_positions(cu_cmp, device=q.device)[1] * d, self.rope_theta)
            o_cmp, lse = compressed_attention(q, kc, vc, cu, cu_cmp, l, d, self.scale)
            if "slc" in self.branches:
                topk = select_blocks(q, kc, lse, cu, cu_cmp, l, d, lb, self.select_count, self.init_blocks,
                                     self.local_blocks, self.scale)
                o_slc = nsa_selected_attention(
                    q, k_s, v_s, topk, self.scale, N1, lb, self.select_count, actual_seq_qlen=cu[1:],
                    actual_seq_kvlen=cu[1:], sparse_mode=2, backend=self.backend, validate=False)[0]
            if "cmp" not in self.branches:
                o_cmp = None
        if "win" in self.branches:
            o_win = sliding_window_attention(q, k_w, v_w, cu, self.window_size, self.scale)
        return o_cmp, o_slc, o_win, topk


@torch._disable_dynamo  # torch.compiler.disable, which imports torch._dynamo at the first call, not at import
def _branches_eager(layer: NativeSparseAttention, cu_seqlens: torch.Tensor, *qkv):
    """``layer._branches`` eager also inside ``torch.compile``, on the lengths of the tensor ``cu_seqlens`` read here:
    traced, each layout would be a new graph (the lengths size the compressed keys and the chunk plans), a
    recompile per new packing (docs/nsa-module.md, "`torch.compile`")."""
    return layer._branches(cu_seqlens_list("cu_seqlens", cu_seqlens, qkv[0].shape[0]), *qkv)
