"""The gradient-based unlearning methods: one typed hyper-parameter dataclass and one objective pair each.

A method splits its loss into a forget objective L_f (auxiliary) and a retain objective L_r (primary); the trainer
takes their gradients separately and a composer combines them (gamma weighs L_f, alpha weighs L_r). Adding a method
is one dataclass, one `forget_loss` function and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grom_core.gradient import losses


@dataclass(frozen=True)
class MethodParams:
    """Shared knobs. gamma: weight of the forget objective; alpha: weight of the retain objective (0 = none);
    retain_loss: "nll" (retain answers' NLL) or "kl" (KL to the frozen original model on retain inputs)."""

    gamma: float = 1.0
    alpha: float = 1.0
    retain_loss: str = "nll"


@dataclass(frozen=True)
class GAParams(MethodParams):
    alpha: float = 0.0  # plain gradient ascent has no retain term


@dataclass(frozen=True)
class GradDiffParams(MethodParams):
    pass


@dataclass(frozen=True)
class NPOParams(MethodParams):
    beta: float = 0.1


@dataclass(frozen=True)
class SimNPOParams(MethodParams):
    gamma: float = 0.125  # SimNPO's published forget weight
    beta: float = 4.5
    delta: float = 0.0


@dataclass(frozen=True)
class IdkDPOParams(MethodParams):
    beta: float = 0.1


@dataclass
class ForgetBatchOutputs:
    """What a forget objective may use. (B,) sums of answer log-probs and lengths; *_ref from the frozen model;
    idk_*: the same for the "I don't know" answers to the forget questions (IdkDPO)."""

    logp: torch.Tensor
    lengths: torch.Tensor
    ref_logp: torch.Tensor | None = None
    idk_logp: torch.Tensor | None = None
    idk_ref_logp: torch.Tensor | None = None


def ga_forget(out: ForgetBatchOutputs, p: GAParams) -> torch.Tensor:
    return losses.gradient_ascent(out.logp, out.lengths)


def npo_forget(out: ForgetBatchOutputs, p: NPOParams) -> torch.Tensor:
    return losses.npo(out.logp, out.ref_logp, p.beta)


def simnpo_forget(out: ForgetBatchOutputs, p: SimNPOParams) -> torch.Tensor:
    return losses.simnpo(out.logp, out.lengths, p.beta, p.delta)


def idkdpo_forget(out: ForgetBatchOutputs, p: IdkDPOParams) -> torch.Tensor:
    return losses.dpo(out.idk_logp, out.logp, out.idk_ref_logp, out.ref_logp, p.beta)


@dataclass(frozen=True)
class Method:
    """A registry entry: its parameter class, its forget objective, and what that objective needs computed."""

    params: type[MethodParams]
    forget_loss: Callable[[ForgetBatchOutputs, MethodParams], torch.Tensor]
    needs_reference: bool = False
    needs_idk: bool = False


METHODS: dict[str, Method] = {
    "ga": Method(GAParams, ga_forget),
    "graddiff": Method(GradDiffParams, ga_forget),
    "npo": Method(NPOParams, npo_forget, needs_reference=True),
    "simnpo": Method(SimNPOParams, simnpo_forget),
    "idkdpo": Method(IdkDPOParams, idkdpo_forget, needs_reference=True, needs_idk=True),
}
