"""The MoE layer: router, grouped experts (the local ones under expert parallelism), shared expert.

The math, the expert-parallel gradient semantics and the dispatchers' traffic are in docs/moe-layer.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._checks import BACKENDS, check_float, check_int, check_param_dtype
from .._numerics import autocast_cast
from ..distributed.collectives import even_sizes, gather_rows, split_rows
from ..distributed.dispatchers import DISPATCH, DISPATCHERS, Plan
from ..distributed.expert_parallel import ExpertParallelModule, inside_ddp
from .capacity import DROP_POLICIES, capacity, drop_to_sink
from .experts import ACTIVATIONS, GroupedExperts, _act_fwd, check_rows_dtype
from .router import TopKRouter
from .stats import gather_stats

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class MoEAux(NamedTuple):
    """The side outputs of :class:`MoELayer`."""

    loss: torch.Tensor  #: 0-dim, router dtype: load-balance + z-loss of the group's batch
    tokens_per_expert: torch.Tensor  #: `[E]` int64, the slots kept after any capacity drop, summed over the group
    dropped: int  #: the slots dropped by the capacity, over the group


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through: ``(silu(x w1^T) * (x w3^T)) w2^T``.

    Parameters: ``w1 [Fs, H]``, ``w3 [Fs, H]``, ``w2 [H, Fs]``."""

    def __init__(self, hidden_size: int, ffn_size: int, *, device=None, dtype=None):
        super().__init__()
        hidden_size = check_int("hidden_size", hidden_size, lo=1)
        ffn_size = check_int("ffn_size", ffn_size, lo=1)
        check_param_dtype(dtype)
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(ffn_size, hidden_size, **kw))
        self.w3 = nn.Parameter(torch.empty(ffn_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(hidden_size, ffn_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.w1.shape[1] ** -0.5)
        nn.init.normal_(self.w3, std=self.w3.shape[1] ** -0.5)
        nn.init.normal_(self.w2, std=self.w2.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` in the weights' dtype (or an enclosing autocast's) -> ``[..., H]``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        H = self.w1.shape[1]
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected shape [..., H={H}], got {list(x.shape)}")
        check_rows_dtype(x, self.w1)
        return F.linear(_act_fwd(F.linear(x, self.w1), F.linear(x, self.w3)), self.w2)


class MoELayer(ExpertParallelModule):
    """A mixture-of-experts FFN layer, optionally expert-parallel over ``ep_group``.

    Per token: ``y_t = sum_{k kept} probs[t, k] * expert_{indices[t, k]}(x_t) + shared(x_t)``, the k sum in fp32
    in k order, rounded once to x's dtype. Submodules: ``router`` (:class:`TopKRouter`, replicated on every
    rank), ``experts`` (:class:`GroupedExperts` holding this rank's ``E_l = E / ep`` experts, global ids
    ``[rank * E_l, (rank + 1) * E_l)``), ``shared`` (:class:`SharedExpert` or None).

    Expert parallelism: every rank of ``ep_group`` calls ``forward`` on its own tokens (T may differ, and may
    be 0) and ``backward`` on its own loss. Rank r's ``y`` and ``x.grad`` equal what one process holding all E
    experts computes on rank r's tokens. Gradients:

    - local experts (``experts.w1/w3/w2``): the one-process gradient of those experts for the group's whole
      batch (the sum of all ranks' losses): no factor ep, no averaging. Do not all-reduce them over the EP
      group (only over data-parallel replicas of the same experts, if any);
    - router and shared expert (replicated): this rank's partial sums; their sum over the group is the
      one-process gradient: reduce them with the data-parallel gradient sync, as any replicated parameter;
    - every parameter gets a gradient tensor on every rank (zeros where no token reached it, also at T = 0).

    ``sparseops.distributed.parallelize`` is the way to train it on many processes (docs/training.md): built
    without ``ep_group``, the model's layers get their ``ep`` group there, the experts become DTensors of the
    global shape and the losses and counts cover the global batch. ``forward`` calls ``router``, ``experts`` and
    ``shared`` through ``__call__``, so hooks on them (FSDP2, forward hooks, checkpointing) run. With a raw
    ``ep_group``, ``state_dict()`` holds the local experts as DTensors of the global shape ``[E, ...]`` (a DCP
    save writes all E experts), and DistributedDataParallel around a model holding the layer raises at its
    construction, before it broadcasts anything (docs/training.md, "The raw ep_group API").

    With ``replicated_tokens=True`` every rank passes the same tokens instead (expert parallelism without
    data parallelism: the layers around run the whole batch on every rank). Every rank routes all of them
    alike, rank r sends the r-th of ``ep`` consecutive token blocks to the experts, and the outputs are
    gathered back, so every rank returns ``y`` for all tokens. Every number — ``y``, ``x.grad``, the loss and
    every gradient, the replicated ones included — is bitwise what one process computes on those tokens
    with the same dispatch arithmetic (docs/moe-layer.md, "Replicated tokens"); nothing is all-reduced. The
    capacity applies to the whole batch. Ranks that pass different token counts or routings fail together.

    Args:
        hidden_size: H. ffn_size: F of each routed expert. num_experts: E (global). top_k: K.
        ep_group: the expert-parallel process group (None: one process holds every expert).
        dispatcher: ``"allgather"`` or ``"alltoall"`` (same results; traffic in docs/moe-layer.md).
        capacity_factor: None (no drop) or ``> 0``: each expert keeps ``ceil(cf * T * K / E)`` slots of each
            rank's own tokens. drop_policy: ``"probs"`` (keep the largest) or ``"position"`` (the first).
        replicated_tokens: every rank of ``ep_group`` passes the same tokens (see above); False: its own.
        shared_ffn_size: Fs of the shared expert (0: none). activation: ``"swiglu"`` or ``"gelu"`` (routed).
        backend: passed to the MoE ops (``"auto"``: Triton on CUDA).
        router_kwargs: :class:`TopKRouter` keywords (``score_func``, ``num_groups``, ``aux_loss_coeff`` ...);
            ``device`` and ``dtype`` apply to every parameter.

    Forward: ``x [T, H]`` or ``[..., H]`` -> ``(y, MoEAux(loss, tokens_per_expert [E], dropped))``; y has x's
    shape and dtype (x's dtype must be the experts' weight dtype). Under ``torch.autocast`` (fp32 weights) the
    router still computes in fp32, the rows are dispatched and the experts' GEMMs run in autocast's dtype, and
    y comes in it (x may also come in it); gradients reach the weights in their own dtype.
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
                 ep_group: dist.ProcessGroup | None = None, dispatcher: str = "allgather",
                 capacity_factor: float | None = None, drop_policy: str = "probs", replicated_tokens: bool = False,
                 shared_ffn_size: int = 0, activation: str = "swiglu", backend: str = "auto", **router_kwargs):
        super().__init__()
        device, dtype = router_kwargs.pop("device", None), router_kwargs.pop("dtype", None)
        H = check_int("hidden_size", hidden_size, lo=1)
        E = check_int("num_experts", num_experts, lo=1)
        check_int("ffn_size", ffn_size, lo=1)
        check_int("top_k", top_k, lo=1)
        Fs = check_int("shared_ffn_size", shared_ffn_size, lo=0)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher: expected one of {DISPATCHERS}, got {dispatcher!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        if capacity_factor is not None and not check_float("capacity_factor", capacity_factor) > 0:
            raise ValueError(f"capacity_factor: expected None or a number > 0, got {capacity_factor!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        if backend not in BACKENDS:  # its device is known at the first forward (the layer may move)
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        check_param_dtype(dtype)
        if not isinstance(replicated_tokens, bool):
            raise TypeError(f"replicated_tokens: expected a bool, got {type(replicated_tokens).__name__}")
        self._init_expert_parallel(E, ep_group)
        self.hidden_size, self.ffn_size, self.top_k = H, ffn_size, top_k
        self.dispatcher, self.drop_policy, self.backend = dispatcher, drop_policy, backend
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.replicated_tokens = replicated_tokens
        kw = {"device": device, "dtype": dtype}
        self.router = TopKRouter(H, E, top_k, **router_kwargs, **kw)
        self.experts = GroupedExperts(E // self.ep_size, H, ffn_size, activation, **kw)
        self.shared = SharedExpert(H, Fs, **kw) if Fs else None

    def extra_repr(self) -> str:
        return (f"ep={self.ep_size}, dispatcher={self.dispatcher!r}, capacity_factor={self.capacity_factor}, "
                f"drop_policy={self.drop_policy!r}, replicated_tokens={self.replicated_tokens}")

    def _check_group(self, device) -> None:
        """One small all-gather at the first forward: ranks that disagree on the layer's shape fail together."""
        act = ACTIVATIONS.index(self.experts.activation)
        dtype = self.experts.w1.dtype  # the rows sent between ranks: another dtype would abort gloo, not raise
        codes = {"dispatcher": DISPATCHERS, "activation": ACTIVATIONS, "dtype": DTYPES}
        mine = [self.num_experts, self.top_k, self.hidden_size, self.ffn_size, DISPATCHERS.index(self.dispatcher),
                act, -1 if self.shared is None else self.shared.w1.shape[0], int(self.replicated_tokens),
                DTYPES.index(dtype) if dtype in DTYPES else -1]
        names = ("num_experts", "top_k", "hidden_size", "ffn_size", "dispatcher", "activation", "shared_ffn_size",
                 "replicated_tokens", "dtype")
        t = torch.tensor(mine, dtype=torch.int64, device=device)
        rows = [torch.empty_like(t) for _ in range(self.ep_size)]
        dist.all_gather(rows, t, group=self.ep_group)
        for q, row in enumerate(rows):
            for name, a, b in zip(names, mine, row.tolist()):
                if a != b:
                    if name in codes:
                        a, b = (codes[name][i] if i >= 0 else "another" for i in (a, b))
                    raise ValueError(f"{name}: expected the same value on every rank of ep_group, got {a} on rank "
                                     f"{self.ep_rank} and {b} on rank {q}")
        self._group_checked = True

    # eager inside torch.compile (one graph break per call): traced, the frames after the host sync specialise on
    # the per-expert counts (a recompile per step) and, under expert parallelism, dynamo fails on the dispatch
    # sizes (docs/training.md, "Activation checkpointing and torch.compile")
    @torch._disable_dynamo
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """Route, dispatch, combine. ``x [T, H]`` or ``[..., H]`` -> ``(y like x, MoEAux)``; see the class."""
        x2 = self.router.check_input(x)
        if x.dtype not in DTYPES:
            raise TypeError(f"x: expected one of {DTYPES}, got {x.dtype}")
        w = next(self.experts.parameters())
        check_rows_dtype(x, w)
        if self.ep_size > 1 and self.batch_group is None and inside_ddp():
            raise ValueError(
                "model: expected no torch.nn.parallel.DistributedDataParallel around a MoELayer built with "
                "ep_group, got one: DDP broadcasts rank 0's experts over the other ranks' and averages the "
                "gradients of different experts. Build the model without ep_group and call "
                "sparseops.distributed.parallelize(model, ParallelDims(ep=...), data_parallel='ddp') instead")
        if not self._group_checked:
            self._check_group(x.device)
        E, K, T = self.num_experts, self.top_k, x2.shape[0]
        # submodules through __call__, so their hooks (FSDP2, forward hooks, checkpointing) run
        route = self.router(x2, aux=False)
        logits, scores, probs, routed = route.logits, route.scores, route.probs, route.tokens_per_expert
        indices = route.indices.long()
        psum, zsum = self.router.loss_terms(logits, scores)
        if self.capacity_factor is not None:
            indices = drop_to_sink(indices, probs, E, capacity(self.capacity_factor, T, K, E), self.drop_policy)
        dispatch = self._dispatch_replicated if self.replicated_tokens and self.ep_size > 1 else self._dispatch
        # under autocast the rows travel and meet the experts in its dtype (the router above stays in fp32)
        xd, = autocast_cast(w, x2)
        y, loss, routed_slots, kept_g = dispatch(xd, indices, probs, routed, psum, zsum)
        if self.shared is not None:
            y = y + self.shared(xd)  # its F.linear would cast x2 again
        dropped = int(round(routed_slots)) - int(sum(kept_g))
        y = y if y.shape == x.shape else y.view(x.shape)  # no view of [T, H] (FSDP2 warns about returned views)
        return y, MoEAux(loss, torch.tensor(kept_g, dtype=torch.int64, device=x.device), dropped)

    def _dispatch(self, x2, indices, probs, routed, psum, zsum):
        """Each rank's own tokens: ``(y, loss, the batch's routed slots, its kept slots per expert)``.

        The statistics are gathered over ``batch_group`` (the EP group unless :func:`parallelize` set the
        data-parallel world): the losses and counts over all of its ranks, the dispatch plan from the rows
        of the EP group's ranks."""
        E, T = self.num_experts, x2.shape[0]
        kept = torch.bincount(indices.reshape(-1), minlength=E + 1)[:E]
        group = self.ep_group if self.batch_group is None else self.batch_group
        st = gather_stats(group, [T], routed, kept, psum.detach(), zsum.detach())  # the one host sync
        loss = self.router.losses(psum, zsum, int(st.total(0)), st.sum_tensor(1, x2.device),
                                  st.sum_tensor(3, x2.device), st.total(4), self.grad_scale)
        ep_st = st if self._batch_rows is None else st.select(self._batch_rows)
        plan = Plan(tokens=[int(p[0]) for p in ep_st.piece(0)], kept=ep_st.ints(2), rank=self.ep_rank,
                    world_size=self.ep_size)
        name = "local" if self.ep_size == 1 else self.dispatcher
        y = DISPATCH[name](x2, indices, probs, plan, self.experts, self.ep_group, self.backend)
        return y, loss, sum(sum(p) for p in st.piece(1)), [sum(col) for col in zip(*st.ints(2))]

    def _dispatch_replicated(self, x2, indices, probs, routed, psum, zsum):
        """``replicated_tokens``: dispatch this rank's block of the (same) tokens, gather the outputs back."""
        E, K, T, ws, r = self.num_experts, self.top_k, x2.shape[0], self.ep_size, self.ep_rank
        dev = x2.device
        sizes = even_sizes(T, ws)
        block = torch.repeat_interleave(torch.arange(ws, device=dev), torch.tensor(sizes, device=dev), output_size=T)
        kept = torch.bincount((block[:, None] * (E + 1) + indices).reshape(-1), minlength=ws * (E + 1))
        kept = kept.view(ws, E + 1)[:, :E]
        weights = torch.arange(1, T * K + 1, dtype=torch.float64, device=dev).view(T, K)
        checksum = (indices.to(torch.float64) * weights).sum().reshape(1)  # the same on every rank, or a bug
        st = gather_stats(self.ep_group, [T], routed, kept, psum.detach(), zsum.detach(), checksum)
        for q in range(ws):  # one host sync, as in the per-rank mode; every rank sees the same rows
            for i, name in ((0, "token count"), (2, "routing"), (5, "routing")):
                if st.piece(i)[q] != st.piece(i)[r]:
                    raise ValueError(f"x: expected the same tokens on every rank of ep_group (replicated_tokens="
                                     f"True), got a different {name} on rank {q} than on rank {r}")
        own = st.row(r)
        loss = self.router.losses(psum, zsum, T, own.sum_tensor(1, dev), own.sum_tensor(3, dev), own.total(4))
        kept_rows = own.ints(2)[0]
        plan = Plan(tokens=sizes, kept=[kept_rows[q * E:(q + 1) * E] for q in range(ws)], rank=r, world_size=ws)
        lo = sum(sizes[:r])
        y = DISPATCH[self.dispatcher](split_rows(x2, self.ep_group, sizes), indices[lo:lo + sizes[r]],
                                      split_rows(probs, self.ep_group, sizes), plan, self.experts,
                                      self.ep_group, self.backend)
        return gather_rows(y, self.ep_group, sizes), loss, sum(own.piece(1)[0]), plan.group_counts()

