"""Step 4 of GROM: the solved update P is applied as alpha * P, alpha the largest scale the retain budget allows
and, with a forget target, the smallest on the budget's grid that reaches it.

Both are bisections on readings of a fixed sample (grom_core.readout): `steps` halvings of [0, upper], so alpha is
on the grid upper * k / 2**steps. The model is read, never changed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.data import Batch
from grom_core.edit import ModuleDelta
from grom_core.readout import NllProbe

log = logging.getLogger(__name__)

STEPS = 5  # halvings of each bisection: alpha to 1/32 of its range


@dataclass(frozen=True)
class BudgetFit:
    """The scale alpha of every module's update, and the retain damage (mean rise of the sampled retain answers'
    token NLL, nats) at alpha = 1 and at the chosen alpha."""

    scale: float
    damage_unscaled: float
    damage: float


@dataclass(frozen=True)
class ForgetFit:
    """The scale alpha of every module's update for a forget target, the forget answers' probability there and at
    the scale it started from, and whether the target was reached (no: the starting scale is kept)."""

    scale: float
    probability: float
    probability_unscaled: float
    reached: bool


@dataclass(frozen=True)
class Scaling:
    """The scale the edit was given and the fits that chose it (None where that scaling does not apply)."""

    scale: float
    budget: BudgetFit | None = None
    forget_target: ForgetFit | None = None


def scale_edit(model: nn.Module, deltas: Mapping[str, ModuleDelta], head: str, retain_probe: NllProbe | None,
               retain_budget: float | None, forget_sample: Sequence[Batch] | None,
               forget_target: float | None) -> Scaling:
    """The scale of `deltas`: fitted to the retain budget (where a probe of the retain sample and a budget are
    given), then to the forget target (where given) below it."""
    budget = fit_to_budget(retain_probe, deltas, retain_budget) \
        if retain_probe is not None and retain_budget is not None else None
    upper = budget.scale if budget else 1.0
    enough = fit_to_forget_target(NllProbe(model, forget_sample, head), deltas, forget_target, upper) \
        if forget_sample is not None and forget_target is not None else None
    return Scaling(scale=enough.scale if enough else upper, budget=budget, forget_target=enough)


def fit_to_budget(probe: NllProbe, deltas: Mapping[str, ModuleDelta], budget: float, steps: int = STEPS,
                  full: float | None = None) -> BudgetFit:
    """The largest alpha in [0, 1] whose update alpha * P raises the mean token NLL of the retain sample `probe`
    reads by at most `budget` nats. `full` (the damage at alpha = 1), where already measured, saves its reading."""
    full = probe.rise(deltas) if full is None else full
    if full <= budget:
        return BudgetFit(scale=1.0, damage_unscaled=full, damage=full)
    low, high, at_low = 0.0, 1.0, 0.0
    for _ in range(steps):
        mid = (low + high) / 2
        got = probe.rise(deltas, mid)
        low, high, at_low = (mid, high, got) if got <= budget else (low, mid, at_low)
    if low == 0.0:
        log.warning("the retain budget (%.3g nats) allows no edit at all: the forget and retain facts are too "
                    "entangled for this gain; raise retain_budget or lower gain", budget)
    log.info("retain budget %.3g: update scaled by %.3f (retain damage %.4f, %.4f unscaled)", budget, low, at_low,
             full)
    return BudgetFit(scale=low, damage_unscaled=full, damage=at_low)


def fit_to_forget_target(probe: NllProbe, deltas: Mapping[str, ModuleDelta], target: float, upper: float = 1.0,
                         steps: int = STEPS) -> ForgetFit:
    """The smallest alpha on the grid upper * k / 2**steps whose update alpha * P leaves the forget answers'
    probability (mean over rows of exp(-mean token NLL), read by `probe` on the forget rows) at most `target`.
    Where even alpha = upper does not reach it, alpha = upper."""

    def probability(alpha: float) -> float:
        return float(torch.exp(-probe.nll(deltas, alpha)).mean())

    at_upper = probability(upper)
    if at_upper > target:
        log.warning("forget target %.3g not reached: the forget answers' probability is %.3g at scale %.3f, the "
                    "most the edit (and the retain budget) allows", target, at_upper, upper)
        return ForgetFit(scale=upper, probability=at_upper, probability_unscaled=at_upper, reached=False)
    low, high, at_high = 0.0, upper, at_upper
    for _ in range(steps):
        mid = (low + high) / 2
        got = probability(mid)
        low, high, at_high = (low, mid, got) if got <= target else (mid, high, at_high)
    log.info("forget target %.3g: update scaled by %.3f (forget probability %.4f, %.4f at %.3f)", target, high,
             at_high, at_upper, upper)
    return ForgetFit(scale=high, probability=at_high, probability_unscaled=at_upper, reached=True)
