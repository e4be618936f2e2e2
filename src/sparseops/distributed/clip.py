"""``clip_grad_norm_`` over gradients that live on different device meshes (or none): the experts' DTensors on
the expert mesh, the dense ones on the dense mesh, plain tensors (docs/training.md, "Traps found on the way":
torch's own clip fails on gradients of two meshes)."""

from __future__ import annotations

import torch


def _check_clip_args(parameters, max_norm, norm_type) -> tuple[list[torch.Tensor], float, float]:
    """What torch's clip takes, but a ``max_norm`` < 0 or NaN (it flips or poisons every gradient) and a
    ``norm_type`` <= 0 or NaN (no p-norm: the norm of the meshes' norms is not the norm of all gradients)."""
    if not isinstance(parameters, torch.Tensor) and not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters: expected a Tensor or an iterable of Tensors, got {type(parameters).__name__}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters[{i}]: expected a torch.Tensor, got {type(p).__name__}")
    norm_type = float("inf") if isinstance(norm_type, str) and norm_type == "inf" else norm_type
    for name, v, want in (("max_norm", max_norm, "a float >= 0"), ("norm_type", norm_type, "a float > 0 or 'inf'")):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected {want}, got {type(v).__name__} ({v!r})")
        if not (v >= 0 if name == "max_norm" else v > 0):
            raise ValueError(f"{name}: expected {want}, got {v}")
    return params, float(max_norm), float(norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters that live on different meshes (or none).

    The norm of each mesh's gradients is reduced over that mesh (``torch.nn.utils.get_total_norm`` of the
    DTensors, then ``full_tensor``), the plain tensors' norm is taken locally, and every gradient is scaled by
    ``min(1, max_norm / (total + 1e-6))``, as torch's clip does in one process. Returns the total norm (a plain
    0-dim tensor, the same on every rank). ``norm_type``: a float > 0, inf or ``'inf'``; ``max_norm`` >= 0.

    Raises:
        TypeError, ValueError: a bad argument, named, before any collective and any gradient is touched.
    """
    from torch.distributed.tensor import DTensor

    params, max_norm, norm_type = _check_clip_args(parameters, max_norm, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
    return total
