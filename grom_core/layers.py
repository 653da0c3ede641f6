"""Choosing which layers to edit: logit-lens attribution of each MLP to the gold forget tokens.

    S_l = F_l (- R_l),  F_l = mean over forget positions t of a(y_t) <u_{y_t}, m_{l,t}> / scale_t

m_{l,t} is layer l's MLP output (what the down-projection adds to the residual stream), u_j the unembedding row of
token j times the final norm's gain, scale_t the final norm's divisor at t in the full model (frozen: the norm is not
linear). A layer with a high F_l writes the forget-specific answers; the edit goes to the contiguous band of late
layers with the highest mean score. R_l, the same attribution on retain positions, is optional (pass retain
batches): the specificity weights a(y) already leave out tokens the retain data uses, and the retain term of the
solve protects the retain outputs whichever layer is edited, so by default the scores cost one forward pass over
the forget data and nothing over the retain data. Only the unembedding rows of the forget-specific gold tokens are
formed, never the (vocab, hidden) matrix.
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
    """Per-layer scores, (L,) float64 each: score = forget - retain (retain None: not scored, score = forget)."""

    forget: torch.Tensor
    retain: torch.Tensor | None = None

    @property
    def score(self) -> torch.Tensor:
        return self.forget if self.retain is None else self.forget - self.retain

    def as_rows(self) -> list[dict]:
        retain = self.retain.tolist() if self.retain is not None else [None] * self.forget.numel()
        return [{"layer": i, "forget": float(f), "retain": r, "score": float(s)}
                for i, (f, r, s) in enumerate(zip(self.forget.tolist(), retain, self.score.tolist(), strict=True))]


def attribution(mlp_out: torch.Tensor, next_tokens: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor,
                unembedding: torch.Tensor) -> torch.Tensor:
    """Sum over positions of a(y_t) <u_{y_t}, m_t> / scale_t for one layer.

    Shapes: mlp_out (k, hidden), next_tokens (k,), scale (k,), weights (vocab,), unembedding (k, hidden) the rows
    u_{y_t} of the k positions. Returns a 0-d float64 tensor (a sum, so that batches add up; divide by the count
    for the mean).
    """
    dots = (unembedding * mlp_out.double().cpu()).sum(dim=1) / scale.double().cpu()
    return (weights[next_tokens.cpu()] * dots).sum()


def _mean_attribution(model: nn.Module, adapter: ModelAdapter, batches: Sequence[Batch], weights: torch.Tensor,
                      desc: str) -> torch.Tensor:
    names = adapter.down_proj_names
    totals = torch.zeros(len(names), dtype=torch.float64)
    count = 0
    for got in iter_captured(model, batches, inputs=[adapter.final_norm_name], outputs=names, desc=desc):
        count += got.size
        tokens = got.next_tokens.cpu()
        keep = (weights[tokens] > 0).nonzero().flatten()  # a(y_t) = 0 adds nothing
        if not keep.numel():
            continue
        unique, where = torch.unique(tokens[keep], return_inverse=True)
        u = adapter.unembedding(unique)[where]
        scale = adapter.norm_scale(got.inputs[adapter.final_norm_name]).cpu()[keep]
        for layer, name in enumerate(names):
            totals[layer] += attribution(got.outputs[name].cpu()[keep], tokens[keep], scale, weights, u)
    return totals / max(1, count)


def score_layers(model: nn.Module, adapter: ModelAdapter, forget_batches: Sequence[Batch], weights: torch.Tensor,
                 retain_batches: Sequence[Batch] | None = None) -> LayerScores:
    """Logit-lens attribution scores of every layer (forward passes only; see the module docstring)."""
    forget = _mean_attribution(model, adapter, forget_batches, weights, "layer scores (forget)")
    retain = None
    if retain_batches is not None:
        retain = _mean_attribution(model, adapter, retain_batches, weights, "layer scores (retain)")
    return LayerScores(forget=forget, retain=retain)


LATE_FRACTION = 0.75
"""The band is searched among the last three quarters of the layers: the first quarter's residual is too far from
the output for the logit lens to read it (its attributions are noise)."""


def choose_band(scores: torch.Tensor, width: int, late_fraction: float = LATE_FRACTION) -> list[int]:
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
