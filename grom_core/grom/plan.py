"""Step 1 of GROM: every automatic choice, made once, into a typed `Plan`, and the inputs every later step reads.

    plan, inputs = make_plan(model, tokenizer, forget, retain, params)

The plan answers, for this model and these data: where the forget keys are (`keys`), how much each is asked to drop
(`drops`, and `beta` for specificity drops), which layers are edited (`layers`, with their attribution scores),
which modules in which order (`modules`), how the band and the LM head share the work (`placement`), and which
scalings apply (`budget`, `forget_target`). It is logged and stored in the edit's manifest; no later step decides
anything the plan does not say.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.data import (
    Batch,
    Example,
    PromptFormat,
    as_examples,
    iter_answer_tokens,
    make_batches,
    mark_subjects,
    prompt_format,
)
from grom_core.errors import DataError, UnsupportedArchitectureError
from grom_core.fingerprint import data_digest, weights_fingerprint
from grom_core.grom.drops import measured_drops, specificity_beta, subject_groups
from grom_core.grom.params import GromParams
from grom_core.layers import choose_band, score_layers
from grom_core.targets import specificity_weights, word_start_mask

log = logging.getLogger(__name__)

BUDGET_TOKENS = 128  # tokens of each sampled retain row the budget reads: a sample's mean, prose need not be whole


@dataclass(frozen=True)
class Plan:
    """Every automatic choice of one edit.

    Attributes:
        keys: "answer", "subject" or "subject+answer".
        drops: "specificity", "counterfactual" or "sentence".
        beta: specificity drops: the drop at specificity 1 (nats); None for the other kinds.
        mean_margin: where beta was read on the model: the forget answers' mean margin (nats).
        layers: the edited layers, lowest first; () for the LM head alone.
        layer_scores: the attribution score of every layer where the band was chosen by it, else ().
        modules: the edited modules in solve order (down-projections lowest first, then the LM head).
        placement: "joint" (every module solved in order, scaled together) or "body_first" (the band solved and
            scaled to the retain budget alone, then the LM head for what the band left, grom_core.grom.solve).
        budget: whether the edit is scaled to the retain budget.
        forget_target: whether it is scaled to the forget target.
        bags: whether each position asks its subject's whole bag of tokens (counterfactual scope "subject").
    """

    keys: str
    drops: str
    beta: float | None
    mean_margin: float | None
    layers: tuple[int, ...]
    layer_scores: tuple[float, ...]
    modules: tuple[str, ...]
    placement: str
    budget: bool
    forget_target: bool
    bags: bool

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def describe(self) -> str:
        layers = ", ".join(map(str, self.layers)) or "none (the LM head alone)"
        beta = f", beta {self.beta:.3g}" if self.beta is not None else ""
        return (f"keys at {self.keys}, {self.drops} drops{beta}, layers {layers}, {len(self.modules)} modules, "
                f"{self.placement.replace('_', ' ')}{', retain budget' if self.budget else ''}"
                f"{', forget target' if self.forget_target else ''}")


@dataclass
class Inputs:
    """What every step after the plan reads: the examples, their batches and the measured drops.

    Attributes:
        forget_batches: the forget rows as keyed (cut to the measured positions, with extra contexts).
        weights: (vocab,) the specificity a(j) of every token.
        drops: (s,) the measured drop at every forget position; None: specificity drops, beta * weights.
        groups: (forget examples,) the subject of each example, whose drops are pooled (bags); else None.
        retain_sample: the rows the retain budget is read on (None without a budget).
        forget_sample: the forget rows with every answer token scored (None without a forget target).
        retain_tokens: (k,) the distinct retain answer tokens (candidates for `protect`).
        stats_digest: what the retain statistics depend on: retain data, max_length and prompt format.
    """

    adapter: ModelAdapter
    forget: list[Example]
    retain: list[Example]
    forget_batches: list[Batch]
    retain_batches: list[Batch]
    weights: torch.Tensor
    fingerprint: str
    forget_digest: str
    retain_digest: str
    stats_digest: str
    retain_tokens: torch.Tensor
    drops: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    retain_sample: list[Batch] | None = None
    forget_sample: list[Batch] | None = None


@dataclass(frozen=True)
class RetainRows:
    """The retain rows as the retain statistics read them (statistics.RetainSource): batches, the model's weights
    fingerprint, and the digests of the retain data and of everything the statistics depend on."""

    retain_batches: list[Batch]
    fingerprint: str
    retain_digest: str
    stats_digest: str


def retain_rows(model: nn.Module, tokenizer, retain: list[Example], first_id: int, params: GromParams,
                fmt: PromptFormat, fingerprint: str | None = None) -> RetainRows:
    """The retain examples batched (ids from `first_id`) and digested; `fingerprint` saves hashing the weights."""
    batches = make_batches(tokenizer, retain, params.batch_size, params.max_length, first_id=first_id, fmt=fmt,
                           by_length=True)  # only summed: any order
    digest = data_digest(ex.record() for ex in retain)
    return RetainRows(retain_batches=batches, fingerprint=fingerprint or weights_fingerprint(model),
                      retain_digest=digest,
                      stats_digest=data_digest([{"retain": digest, "max_length": params.max_length,
                                                 "prompt_format": fmt.name}]))


def make_plan(model: nn.Module, tokenizer, forget, retain, params: GromParams | None = None,
              adapter: ModelAdapter | None = None, fmt: str | PromptFormat = "qa",
              fingerprint: str | None = None) -> tuple[Plan, Inputs]:
    """The plan and the inputs of an edit of `model` for `forget` keeping `retain` (QA pairs or texts in prompt
    format `fmt`); the model is read, never changed."""
    fmt = prompt_format(fmt)
    params = params or GromParams()
    params.validate()
    forget_ex, retain_ex = as_examples(forget), as_examples(retain)
    adapter = adapter or ModelAdapter.for_model(model)
    if params.suppresses_with_head and adapter.lm_head_is_tied():
        raise UnsupportedArchitectureError(
            f"'{adapter.lm_head_name}' is tied to the input embedding: call adapter.untie_lm_head() first "
            f"(numerically a no-op), or set edit_lm_head=False")
    keys, drops_kind = resolve_keys_and_drops(params, forget_ex)
    forget_batches = make_batches(tokenizer, forget_ex, params.batch_size, params.max_length, fmt=fmt)
    if keys != "answer":
        forget_batches = mark_subjects(tokenizer, forget_ex, forget_batches, fmt, answers=keys != "subject")
    rows = retain_rows(model, tokenizer, retain_ex, len(forget_ex), params, fmt, fingerprint)
    vocab = weight_out_in(adapter.lm_head).shape[0]
    spec = params.specificity
    weights = specificity_weights(iter_answer_tokens(forget_batches), iter_answer_tokens(rows.retain_batches), vocab)
    if spec.word_starts_only:
        weights = weights * word_start_mask(tokenizer, vocab)
    inputs = Inputs(adapter=adapter, forget=forget_ex, retain=retain_ex, forget_batches=forget_batches,
                    retain_batches=rows.retain_batches, weights=weights, fingerprint=rows.fingerprint,
                    forget_digest=data_digest(ex.record() for ex in forget_ex), retain_digest=rows.retain_digest,
                    stats_digest=rows.stats_digest,
                    retain_tokens=torch.tensor(sorted(set(iter_answer_tokens(rows.retain_batches))),
                                               dtype=torch.long))
    if drops_kind in ("counterfactual", "sentence"):
        inputs.forget_batches, inputs.drops = measured_drops(model, tokenizer, forget_ex, retain_ex, forget_batches,
                                                             fmt, params, drops_kind)
        if drops_kind == "counterfactual" and params.counterfactual.scope == "subject":
            inputs.groups = subject_groups(forget_ex)
    budget = params.retain_budget is not None and params.target == "suppress" and keys == "answer" and bool(retain_ex)
    if budget:
        rows = random.Random(params.seed).sample(retain_ex, min(params.budget_examples, len(retain_ex)))
        inputs.retain_sample = make_batches(tokenizer, rows, params.batch_size, min(params.max_length, BUDGET_TOKENS),
                                            fmt=fmt, by_length=True)  # a mean over rows: any order, less padding
    if params.forget_target is not None:
        inputs.forget_sample = make_batches(tokenizer, forget_ex, params.batch_size, params.max_length, fmt=fmt)
    beta = None
    if drops_kind == "specificity" and params.target == "suppress":
        answers = inputs.forget_sample or make_batches(tokenizer, forget_ex, params.batch_size, params.max_length,
                                                       fmt=fmt)
        beta = specificity_beta(model, answers, weights, params, keys)
    layers, scores = choose_layers(model, inputs, params, drops_kind)
    modules = edited_modules(adapter, layers, params)
    body_first = (params.layers is None and bool(layers) and drops_kind == "specificity"
                  and params.suppresses_with_head and budget)
    plan = Plan(keys=keys, drops=drops_kind, beta=beta.beta if beta else None,
                mean_margin=beta.mean_margin if beta else None, layers=tuple(layers), layer_scores=scores,
                modules=tuple(modules), placement="body_first" if body_first else "joint", budget=budget,
                forget_target=params.forget_target is not None, bags=inputs.groups is not None)
    log.info("plan: %s", plan.describe())
    return plan, inputs


def resolve_keys_and_drops(params: GromParams, forget: Sequence[Example]) -> tuple[str, str]:
    """(keys, drops) with "auto" resolved for the forget examples: do they name their subjects, do most answers
    repeat them (a QA sentence), not just a few that contain them ("Mexico City"), and are there texts?"""
    subjects = [ex for ex in forget if ex.subject is not None]
    named = bool(subjects)
    restated = sum(ex.subject in ex.answer for ex in subjects) > len(subjects) / 2
    keys = ("subject" if named and not restated else "answer") if params.keys == "auto" else params.keys
    if keys != "answer" and not named:
        raise DataError(f"keys='{keys}' needs forget examples that name their subject (a 'subject' column)")
    measurable = keys == "answer" and params.target == "suppress"
    fits = named and measurable
    texts = any(ex.text is not None for ex in forget)
    if params.drops == "auto":
        drops = "counterfactual" if fits else "sentence" if texts and measurable else "specificity"
    else:
        drops = params.drops
    if drops == "counterfactual" and not fits:
        raise DataError("drops='counterfactual' needs forget examples that name their subject, keys='answer' and "
                        "target='suppress'")
    if drops == "sentence" and not measurable:
        raise DataError("drops='sentence' needs keys='answer' and target='suppress'")
    return keys, drops


def choose_layers(model: nn.Module, inputs: Inputs, params: GromParams, drops: str
                  ) -> tuple[list[int], tuple[float, ...]]:
    """The layers named in `params`, or every layer for sentence drops (what a model memorised word for word is not
    held in one band), or the best band by logit-lens attribution on the forget data (with every layer's score)."""
    adapter = inputs.adapter
    if params.layers is not None:
        layers = sorted(set(params.layers))
        bad = [layer for layer in layers if not 0 <= layer < adapter.num_layers]
        if bad:
            raise DataError(f"layers {bad} do not exist; the model has layers 0..{adapter.num_layers - 1}")
        return layers, ()
    if drops == "sentence":
        return list(range(adapter.num_layers)), ()
    scores = score_layers(model, adapter, inputs.forget_batches, inputs.weights).score
    layers = choose_band(scores, min(params.band_width, adapter.num_layers))
    log.debug("layer scores %s -> editing layers %s", ", ".join(f"{v:.3f}" for v in scores.tolist()), layers)
    return layers, tuple(float(v) for v in scores.tolist())


def edited_modules(adapter: ModelAdapter, layers: Sequence[int], params: GromParams) -> list[str]:
    """Module names in solve order: the layers' down-projections, lowest first, then the LM head if edited."""
    modules = [adapter.down_proj_names[layer] for layer in sorted(layers)]
    if params.suppresses_with_head:
        modules.append(adapter.lm_head_name)
    return modules
