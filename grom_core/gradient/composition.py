"""Composing the forget gradient g_f and the retain gradient g_r into one update direction (to be *descended*).

Retention is the primary task and forgetting the auxiliary one (the asymmetric two-task view):
- sum: gamma g_f + alpha g_r.
- PCGrad, per parameter tensor: if <g_f, g_r> < 0, remove from g_f its component along g_r; then gamma g_f + alpha g_r.
- SAGO, element-wise: where sign(g_f) sign(g_r) < 0 use alpha g_r, elsewhere gamma g_f. Every element then has a
  non-negative product with g_r, so the composed direction never has a negative inner product with g_r: a small
  step never increases the retain loss to first order.
Each composer takes and returns per-parameter lists; None stands for "no gradient" (treated as zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Grads = Sequence[torch.Tensor | None]


def _pairs(g_f: Grads, g_r: Grads):
    for f, r in zip(g_f, g_r, strict=True):
        if f is None and r is None:
            yield None, None
        else:
            ref = f if f is not None else r
            yield (f if f is not None else torch.zeros_like(ref)), (r if r is not None else torch.zeros_like(ref))


def _per_tensor(g_f: Grads, g_r: Grads, combine) -> list[torch.Tensor | None]:
    """Apply `combine(f, r)` tensor by tensor; a parameter without any gradient stays None."""
    return [None if f is None else combine(f, r) for f, r in _pairs(g_f, g_r)]


def compose_sum(g_f: Grads, g_r: Grads, gamma: float = 1.0, alpha: float = 1.0) -> list[torch.Tensor | None]:
    return _per_tensor(g_f, g_r, lambda f, r: gamma * f + alpha * r)


def compose_pcgrad(g_f: Grads, g_r: Grads, gamma: float = 1.0, alpha: float = 1.0) -> list[torch.Tensor | None]:
    def combine(f: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        dot = (f * r).sum()
        if dot < 0:
            f = f - dot / r.pow(2).sum().clamp_min(1e-30) * r
        return gamma * f + alpha * r

    return _per_tensor(g_f, g_r, combine)


def compose_sago(g_f: Grads, g_r: Grads, gamma: float = 1.0, alpha: float = 1.0) -> list[torch.Tensor | None]:
    def combine(f: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.sign(f) * torch.sign(r) < 0, alpha * r, gamma * f)

    return _per_tensor(g_f, g_r, combine)


COMPOSERS: dict[str, Callable[..., list[torch.Tensor | None]]] = {
    "sum": compose_sum,
    "pcgrad": compose_pcgrad,
    "sago": compose_sago,
}
