"""The gradient-based unlearning methods: one typed hyper-parameter dataclass and one objective pair each.

A method splits its loss into a forget objective L_f (auxiliary) and a retain objective L_r (primary); the trainer
takes their gradients separately and a composer combines them (gamma weighs L_f, alpha weighs L_r). Adding a method
is one dataclass, one `forget_loss` function and one line in the method registry (`grom_core.methods`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grom_core.gradient import losses
from grom_core.params import Params, ParamsError


@dataclass(frozen=True)
class TrainerParams(Params):
    """The recipe, the same for every method; these defaults are the tiny from-scratch models' recipe, and a
    pretrained model gets `RECIPES[PRETRAINED]` (TOFU's: lr 1e-5, 10 epochs) under the user's values (see
    `with_recipe`). lr is AdamW's step size; the effective batch is batch_size x grad_accum examples; max_length is
    in tokens."""

    lr: float = 1e-3
    epochs: int = 10
    batch_size: int = 8
    grad_accum: int = 4
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    max_length: int = 512

    def validate(self) -> None:
        if self.lr <= 0 or self.epochs < 1 or self.batch_size < 1 or self.grad_accum < 1 or self.max_length < 2:
            raise ParamsError("TrainerParams needs lr > 0, epochs >= 1, batch_size >= 1, grad_accum >= 1 and "
                              "max_length >= 2")


FROM_SCRATCH = "from_scratch"  # a model grom trained from scratch (grom_core.finetune): its tiny models
PRETRAINED = "pretrained"  # anything else: a pretrained language model or a fine-tune of one

# The default recipe of each model kind (TrainerParams fields); a user's `trainer` values win field by field.
# A pretrained model gets TOFU's recipe for them (lr 1e-5, 10 epochs) with batches that fit forget sets of a few
# examples; at the tiny models' lr (1e-3) a pretrained model's weights are destroyed within one epoch.
RECIPES: dict[str, dict] = {
    FROM_SCRATCH: {},  # TrainerParams' own defaults
    PRETRAINED: {"lr": 1e-5, "epochs": 10, "batch_size": 4, "grad_accum": 1},
}
FROM_SCRATCH_FLAG = "grom_from_scratch"  # set in the config.json of the models grom_core.finetune builds


def model_kind(config, model_dir: str | None = None) -> str:
    """from_scratch for a model grom trained from scratch (its config says so, or, for a model saved before the
    flag, the training.json grom_core.finetune writes names a tiny configuration), else pretrained."""
    import json
    from pathlib import Path

    if getattr(config, FROM_SCRATCH_FLAG, False):
        return FROM_SCRATCH
    record = Path(model_dir) / "training.json" if model_dir else None
    if record is not None and record.is_file():
        try:
            trained = json.loads(record.read_text()).get("model", {})
        except (OSError, ValueError):
            trained = {}
        if isinstance(trained, dict) and "vocab_size" in trained:
            return FROM_SCRATCH
    return PRETRAINED


def with_recipe(values: dict, kind: str) -> dict:
    """A gradient method's parameters with the model kind's recipe under the user's own `trainer` values."""
    return {**values, "trainer": {**RECIPES[kind], **dict(values.get("trainer") or {})}}


@dataclass(frozen=True)
class MethodParams(Params):
    """Shared knobs. gamma: weight of the forget objective; alpha: weight of the retain objective (0 = none);
    retain_loss: "nll" (retain answers' NLL) or "kl" (KL to the frozen original model on retain inputs);
    compose: how the forget and retain gradients are combined (a name in COMPOSERS); trainer: the recipe."""

    gamma: float = 1.0
    alpha: float = 1.0
    retain_loss: str = "nll"
    compose: str = "sum"
    trainer: TrainerParams = TrainerParams()

    def validate(self) -> None:
        from grom_core.gradient.composition import COMPOSERS

        if self.retain_loss not in ("nll", "kl"):
            raise ParamsError(f"retain_loss must be 'nll' or 'kl', got '{self.retain_loss}'")
        if self.compose not in COMPOSERS:
            raise ParamsError(f"unknown composer '{self.compose}'; choose one of {', '.join(sorted(COMPOSERS))}")
        if self.gamma <= 0 or self.alpha < 0:
            raise ParamsError("need gamma > 0 and alpha >= 0")
        self.trainer.validate()


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


@dataclass(frozen=True)
class AltPOParams(MethodParams):
    """AltPO (Mekala et al. 2024): beta of its DPO term, alt_weight of the alternatives' NLL (its positive
    feedback)."""

    beta: float = 0.1
    alt_weight: float = 1.0


@dataclass
class ForgetBatchOutputs:
    """What a forget objective may use. (B,) sums of answer log-probs and lengths; *_ref from the frozen model;
    preferred_*: the same for the answers preferred to the forget answers (IdkDPO's "I don't know", AltPO's
    alternatives)."""

    logp: torch.Tensor
    lengths: torch.Tensor
    ref_logp: torch.Tensor | None = None
    preferred_logp: torch.Tensor | None = None
    preferred_ref_logp: torch.Tensor | None = None
    preferred_lengths: torch.Tensor | None = None


def ga_forget(out: ForgetBatchOutputs, p: GAParams) -> torch.Tensor:
    return losses.gradient_ascent(out.logp, out.lengths)


def npo_forget(out: ForgetBatchOutputs, p: NPOParams) -> torch.Tensor:
    return losses.npo(out.logp, out.ref_logp, p.beta)


def simnpo_forget(out: ForgetBatchOutputs, p: SimNPOParams) -> torch.Tensor:
    return losses.simnpo(out.logp, out.lengths, p.beta, p.delta)


def idkdpo_forget(out: ForgetBatchOutputs, p: IdkDPOParams) -> torch.Tensor:
    return losses.dpo(out.preferred_logp, out.logp, out.preferred_ref_logp, out.ref_logp, p.beta)


def altpo_forget(out: ForgetBatchOutputs, p: AltPOParams) -> torch.Tensor:
    """DPO of an alternative answer over the forget answer, plus the alternative's NLL."""
    return (losses.dpo(out.preferred_logp, out.logp, out.preferred_ref_logp, out.ref_logp, p.beta)
            + p.alt_weight * losses.nll(out.preferred_logp, out.preferred_lengths))


@dataclass(frozen=True)
class Objective:
    """A gradient method's forget objective and what it needs computed besides the model's own log-probs:
    a frozen reference model, and `preferred` answers to the forget questions ("idk": TOFU's "I don't know"
    sentences; "alternative": in-domain alternatives, see `trainer.alternative_answers`)."""

    forget_loss: Callable[[ForgetBatchOutputs, MethodParams], torch.Tensor]
    needs_reference: bool = False
    preferred: str | None = None


# each method's forget objective, named by the method registry (grom_core.methods)
GA = Objective(ga_forget)
GRADDIFF = Objective(ga_forget)  # the retain term is the trainer's, weighed by alpha
NPO = Objective(npo_forget, needs_reference=True)
SIMNPO = Objective(simnpo_forget)
IDKDPO = Objective(idkdpo_forget, needs_reference=True, preferred="idk")
ALTPO = Objective(altpo_forget, needs_reference=True, preferred="alternative")
