"""The top-k router: scores, (group-limited) expert choice, probs, load-balance and z losses.

The math, tie rules and loss definitions are in docs/moe-layer.md ("Router"). The router never computes in a
16-bit type: fp32, or float64 for float64 inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_bool, check_float, check_has_data, check_int, check_param_dtype, check_tensor
from .._numerics import acc_dtype, autocast_off
from .._topk import stable_topk
from .stats import gather_stats

SCORE_FUNCS = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    """What :class:`TopKRouter` returns; shapes for ``T`` tokens, ``E`` experts, ``K`` picks."""

    probs: torch.Tensor  #: `[T, K]` router dtype, the weights of the chosen experts
    indices: torch.Tensor  #: `[T, K]` int32, the chosen experts, each row in descending selection key
    scores: torch.Tensor  #: `[T, E]` router dtype, softmax or sigmoid of the logits
    logits: torch.Tensor  #: `[T, E]` router dtype
    aux_loss: torch.Tensor | None  #: 0-dim router dtype, load-balance + z-loss over the group's batch (None: aux=False)
    tokens_per_expert: torch.Tensor  #: `[E]` int64, this rank's routed slots (before any capacity drop)


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (torch's private graph-task id; False where a torch
    lacks it, where the recompute then counts again)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@torch._disable_dynamo  # an eager island where torch.compile breaks anyway (bincount's shape depends on the data)
def routed_counts(indices: torch.Tensor, num_experts: int, into: torch.Tensor | None) -> torch.Tensor:
    """``[E]`` int64 routed slots of ``indices``, also added to ``into`` (None: nowhere) unless this forward runs
    inside a backward: activation checkpointing's recompute (``torch.utils.checkpoint`` either mode,
    ``checkpoint_wrapper``, the composable ``checkpoint``, around an eager or a compiled module) routes the same
    tokens again, which the first forward already counted. Eager also under ``torch.compile``, so a compiled
    forward replayed by that recompute takes the same test instead of a buffer update baked into its graph."""
    counts = torch.bincount(indices.flatten(), minlength=num_experts)
    if into is not None and not _in_backward():
        with torch.no_grad():
            into += counts
    return counts


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """The router's compute dtype for inputs of ``dtype``: float64 stays float64, everything else runs in fp32."""
    return acc_dtype(dtype)


class TopKRouter(nn.Module):
    """Route each token to ``top_k`` of ``num_experts`` experts (DeepSeek-V3 / Qwen-MoE style).

    ``logits = x @ weight.T``, ``scores = softmax(logits)`` or ``sigmoid(logits)``, selection key
    ``s = scores + expert_bias``; with ``num_groups``, only the ``group_topk`` groups with the largest sum of
    their two best keys stay eligible. ``indices`` are the K eligible experts with the largest key (ties: the
    lower id); ``probs = scores[indices]``, divided by their row sum when ``norm_topk_prob``, times
    ``scaling_factor``. Losses over the whole group's batch (``T_g`` tokens, ``c_e`` routed slots):
    ``aux_loss_coeff * E * sum_e f_e P_e`` with ``f_e = c_e / (T_g K)``, ``P_e = mean_t scores_e / sum scores``,
    plus ``z_loss_coeff * mean_t logsumexp(logits_t)^2``. See docs/moe-layer.md.

    Args:
        hidden_size: H. num_experts: E. top_k: K (``1 <= K <= E``, and at most the eligible experts).
        score_func: ``"softmax"`` or ``"sigmoid"``.
        norm_topk_prob: divide the K probs by their sum. scaling_factor: multiply them afterwards.
        num_groups: consecutive expert groups for group-limited routing (must divide E); None: off.
        group_topk: groups kept per token (``1 <= group_topk <= num_groups``), required with ``num_groups``.
        aux_loss_coeff, z_loss_coeff: loss weights (``>= 0``).
        expert_bias: keep a buffer ``expert_bias [E]`` fp32 that steers the choice (aux-loss-free balancing,
            updated by :func:`sparseops.nn.update_expert_bias`).

    Parameters: ``weight [E, H]``. Buffers: ``expert_bias [E]`` fp32 when ``expert_bias=True``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, scaling_factor: float = 1.0, num_groups: int | None = None,
                 group_topk: int | None = None, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 expert_bias: bool = False, device=None, dtype=None):
        super().__init__()
        H = check_int("hidden_size", hidden_size, lo=1)
        E = check_int("num_experts", num_experts, lo=1)
        K = check_int("top_k", top_k, lo=1)
        check_param_dtype(dtype)
        if K > E:
            raise ValueError(f"top_k: expected at most num_experts = {E}, got {K}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob: expected a bool, got {type(norm_topk_prob).__name__}")
        self.scaling_factor = check_float("scaling_factor", scaling_factor)
        if self.scaling_factor <= 0:  # 0 zeroes the routed output and its gradients, < 0 flips them
            raise ValueError(f"scaling_factor: expected a float > 0, got {scaling_factor!r}")
        if num_groups is not None:
            G = check_int("num_groups", num_groups, lo=1)
            if E % G:
                raise ValueError(f"num_groups: expected a divisor of num_experts = {E}, got {G}")
            if group_topk is None:
                raise ValueError("group_topk: expected an int in [1, num_groups] when num_groups is set, got None")
            check_int("group_topk", group_topk, lo=1, hi=G)
            if K > group_topk * (E // G):
                raise ValueError(f"top_k: expected at most the {group_topk * (E // G)} eligible experts "
                                 f"(group_topk = {group_topk} groups of {E // G}), got {K}")
        elif group_topk is not None:
            raise ValueError(f"group_topk: expected None when num_groups is None, got {group_topk!r}")
        for name, v in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if not check_float(name, v) >= 0:
                raise ValueError(f"{name}: expected a number >= 0, got {v!r}")
        if not isinstance(expert_bias, bool):
            raise TypeError(f"expert_bias: expected a bool, got {type(expert_bias).__name__}")
        self.hidden_size, self.num_experts, self.top_k = H, E, K
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.num_groups, self.group_topk = num_groups, group_topk
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.weight = nn.Parameter(torch.empty(E, H, device=device, dtype=dtype))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32))
            # routed slots since the last update_expert_bias (training-mode forwards only)
            self.register_buffer("local_tokens_per_expert", torch.zeros(E, device=device, dtype=torch.int64),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``weight`` from N(0, 1/hidden_size) and zero ``expert_bias`` (a persistent buffer: the fresh
        router's state, as BatchNorm's reset_parameters resets its running stats), e.g. after ``to_empty``."""
        nn.init.normal_(self.weight, std=self.hidden_size ** -0.5)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def reset_buffers(self) -> None:
        """Re-initialise the non-persistent buffer (the routed-slot counts: zeros), e.g. after ``to_empty``."""
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score_func={self.score_func!r}, num_groups={self.num_groups}, group_topk={self.group_topk}")

    # -- local routing ---------------------------------------------------------------------------------------

    def check_input(self, x) -> torch.Tensor:
        """``x`` flattened to `[T, H]`; raises ``TypeError``/``ValueError`` naming ``x``."""
        check_tensor("x", x)
        if not x.dtype.is_floating_point:
            raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape [..., H={self.hidden_size}], got {list(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"x: expected device {self.weight.device} (the router weight's), got {x.device}")
        check_has_data("x", x, module=True)  # the expert choice and its counts read the scores
        return x.reshape(-1, self.hidden_size)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """`[T, K]` int64 expert ids from `[T, E]` scores: bias-steered, group-limited, ties to the lower id.

        Bitwise the first K of a stable descending sort of the key (NaN first, as the sort puts it), found in
        O(T E) by :func:`sparseops._topk.stable_topk` without a host synchronisation."""
        key = scores.detach()
        if self.expert_bias is not None:
            key = key + self.expert_bias.to(key.dtype)
        T, E = key.shape
        if self.num_groups is not None and self.group_topk < self.num_groups:
            G = self.num_groups
            per = key.view(T, G, E // G)
            gkey = per.topk(min(2, E // G), dim=-1).values.sum(-1)  # [T, G]; sums are order-free here
            gbest = stable_topk(gkey, self.group_topk)
            eligible = torch.zeros(T, G, dtype=torch.bool, device=key.device).scatter_(1, gbest, True)
            key = per.masked_fill(~eligible.unsqueeze(-1), -math.inf).view(T, E)
        return stable_topk(key, self.top_k)

    def route(self, x2: torch.Tensor):
        """Local routing of `[T, H]` tokens: ``(logits, scores, indices int64, probs, tokens_per_expert)``."""
        rdt = router_dtype(x2.dtype)
        with autocast_off(x2.device.type):  # routing in fp32 also under autocast (docs/moe-layer.md)
            logits = x2.to(rdt) @ self.weight.to(rdt).T
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        indices = self.select(scores)
        probs = scores.gather(1, indices)
        if self.norm_topk_prob:
            probs = probs / probs.sum(-1, keepdim=True)
        if self.scaling_factor != 1.0:
            probs = probs * self.scaling_factor
        counts = routed_counts(indices, self.num_experts, self.local_tokens_per_expert if self.training else None)
        return logits, scores, indices, probs, counts

    # -- losses over the group ----------------------------------------------------------------------------------

    def loss_terms(self, logits: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's differentiable sums: ``sum_t s_hat[t, :]`` `[E]` and ``sum_t logsumexp(logits_t)^2``."""
        s_hat = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return s_hat.sum(0), torch.logsumexp(logits, dim=-1).pow(2).sum()

    def losses(self, psum: torch.Tensor, zsum: torch.Tensor, T_g: int, counts_g: torch.Tensor,
               psum_g: torch.Tensor, zsum_g: float, grad_scale: float = 1.0) -> torch.Tensor:
        """The group's loss value with gradients into this rank's terms only (docs/moe-layer.md, "Losses").

        ``psum``, ``zsum``: this rank's :meth:`loss_terms`; ``T_g``, ``counts_g [E]``, ``psum_g [E]``,
        ``zsum_g``: the group's totals (no gradient). ``grad_scale`` multiplies the gradient of this rank's
        part, not the value: ``W`` when a data-parallel sync averages the gradients over the ``W`` ranks of
        the group (docs/training.md, "Gradients")."""
        rdt = psum.dtype
        zero = psum.new_zeros(())
        if T_g == 0 or (self.aux_loss_coeff == 0 and self.z_loss_coeff == 0):
            return zero
        E, K = self.num_experts, self.top_k
        local = zero
        full = 0.0
        if self.aux_loss_coeff:
            f = counts_g.to(rdt) / (T_g * K)
            w = self.aux_loss_coeff * E / T_g
            local = local + w * (f * psum).sum()
            full += w * float((f.double() * psum_g.double()).sum())
        if self.z_loss_coeff:
            local = local + self.z_loss_coeff / T_g * zsum
            full += self.z_loss_coeff / T_g * zsum_g
        if grad_scale != 1.0:
            local = local * grad_scale
        return local - local.detach() + full

    def forward(self, x: torch.Tensor, group: dist.ProcessGroup | None = None, *, aux: bool = True) -> RouterOutput:
        """Route ``x [T, H]`` (or ``[..., H]``, flattened); losses over ``group``'s batch (None: this process).

        ``aux=False`` skips the losses and their collective (``aux_loss`` is None): :class:`MoELayer` gathers
        the group's statistics itself, once per forward, and computes the losses from the returned
        ``logits`` and ``scores`` with :meth:`loss_terms` and :meth:`losses`.

        Returns:
            :class:`RouterOutput` ``(probs [T, K], indices [T, K] int32, scores [T, E], logits [T, E],
            aux_loss [], tokens_per_expert [E] int64)``; floats in fp32 (float64 for float64 x).
        """
        x2 = self.check_input(x)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")
        aux = check_bool("aux", aux)
        logits, scores, indices, probs, counts = self.route(x2)
        if not aux:
            return RouterOutput(probs, indices.to(torch.int32), scores, logits, None, counts)
        psum, zsum = self.loss_terms(logits, scores)
        T = x2.shape[0]
        st = gather_stats(group, [T], counts, psum.detach(), zsum.detach())
        aux = self.losses(psum, zsum, int(st.total(0)), st.sum_tensor(1, counts.device),
                          st.sum_tensor(2, psum.device), st.total(3))
        return RouterOutput(probs, indices.to(torch.int32), scores, logits, aux, counts)
