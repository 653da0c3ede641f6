"""Choosing which layers to edit: logit-lens attribution of each MLP to the gold forget tokens.

    S_l = F_l - R_l,  F_l = mean over forget positions t of a(y_t) <u_{y_t}, m_{l,t}> / scale_t

m_{l,t} is layer l's MLP output (what the down-projection adds to the residual stream), u_j the unembedding row of
token j times the final norm's gain, scale_t the final norm's divisor at t in the full model (frozen: the norm is not
linear). R_l is the same on retain positions. A layer with a high S_l writes the forget answers more than the retain
answers; the edit goes to the contiguous band of late layers with the highest mean score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import ModelAdapter
from grom_core.capture import iter_captured
from grom_core.data import Batch


@dataclass
class LayerScores:
    """Per-layer scores, (L,) float64 each: score = forget - retain."""

    forget: torch.Tensor
    retain: torch.Tensor

    @property
    def score(self) -> torch.Tensor:
        return self.forget - self.retain

    def as_rows(self) -> list[dict]:
        return [{"layer": i, "forget": float(f), "retain": float(r), "score": float(f - r)}
                for i, (f, r) in enumerate(zip(self.forget.tolist(), self.retain.tolist(), strict=True))]


def attribution(mlp_out: torch.Tensor, next_tokens: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor,
                unembedding: torch.Tensor) -> torch.Tensor:
    """Sum over positions of a(y_t) <u_{y_t}, m_t> / scale_t for one layer.

    Shapes: mlp_out (k, hidden), next_tokens (k,), scale (k,), weights (vocab,), unembedding (vocab, hidden).
    Returns a 0-d float64 tensor (a sum, so that batches add up; divide by the count for the mean).
    """
    tokens = next_tokens.cpu()
    u = unembedding[tokens]
    dots = (u * mlp_out.double().cpu()).sum(dim=1) / scale.double().cpu()
    return (weights[tokens] * dots).sum()


def _mean_attribution(model: nn.Module, adapter: ModelAdapter, batches: Sequence[Batch], weights: torch.Tensor,
                      unembedding: torch.Tensor, desc: str) -> torch.Tensor:
    names = adapter.down_proj_names
    totals = torch.zeros(len(names), dtype=torch.float64)
    count = 0
    for got in iter_captured(model, batches, inputs=[adapter.final_norm_name], outputs=names, desc=desc):
        scale = adapter.norm_scale(got.inputs[adapter.final_norm_name])
        for layer, name in enumerate(names):
            totals[layer] += attribution(got.outputs[name], got.next_tokens, scale, weights, unembedding)
        count += got.size
    return totals / max(1, count)


def score_layers(model: nn.Module, adapter: ModelAdapter, forget_batches: Sequence[Batch],
                 retain_batches: Sequence[Batch], weights: torch.Tensor) -> LayerScores:
    """Logit-lens attribution scores of every layer (forward passes only)."""
    unembedding = adapter.unembedding()
    forget = _mean_attribution(model, adapter, forget_batches, weights, unembedding, "layer scores (forget)")
    retain = _mean_attribution(model, adapter, retain_batches, weights, unembedding, "layer scores (retain)")
    return LayerScores(forget=forget, retain=retain)


def choose_band(scores: torch.Tensor, width: int, late_fraction: float = 0.75) -> list[int]:
    """The contiguous band of `width` layers with the highest mean score among the last `late_fraction` of layers.

    Ties go to the later band (later layers are closer to the output, where the logit lens is most faithful).
    """
    n = int(scores.numel())
    if not 1 <= width <= n:
        raise ValueError(f"band width must be between 1 and the number of layers ({n}), got {width}")
    first = min(n - width, max(0, n - max(width, round(late_fraction * n))))
    best_start, best = first, -float("inf")
    for start in range(first, n - width + 1):
        mean = float(scores[start:start + width].mean())
        if mean >= best:
            best_start, best = start, mean
    return list(range(best_start, best_start + width))
