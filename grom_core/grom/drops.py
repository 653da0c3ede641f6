"""How much each forget position is asked to drop, where the drops are measured on the model (counterfactual and
sentence drops), and the beta of specificity drops where it is read from the forget answers' margins."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import nn

from grom_core.counterfactual import counterfactual_drops, other_questions
from grom_core.data import Batch, Example, PromptFormat, make_batches
from grom_core.grom.params import GromParams
from grom_core.scoring import gold_margins
from grom_core.sentence_drops import sentence_drops
from grom_core.targets import margin_beta

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Beta:
    """The drop asked at specificity 1 (nats of log-odds) and, where it was read on the model, the forget answers'
    mean margin it is a multiple of."""

    beta: float
    mean_margin: float | None = None


def measured_drops(model: nn.Module, tokenizer, forget: list[Example], retain: list[Example],
                   forget_batches: list[Batch], fmt: PromptFormat, params: GromParams, kind: str
                   ) -> tuple[list[Batch], torch.Tensor]:
    """The forget batches cut to the positions that carry what the model knows (`kind` "counterfactual" or
    "sentence") and their drops (s,)."""
    if kind == "sentence":
        questions = [ex.question for ex in retain if ex.question is not None]
        found = sentence_drops(model, tokenizer, forget, forget_batches, fmt, gain=params.gain,
                               min_gap=params.min_gap, batch_size=params.batch_size, questions=questions,
                               swaps=params.sentence.swaps, max_length=params.max_length)
    else:
        cf = params.counterfactual
        everything = [*forget, *retain]
        text = " ".join(str(v) for ex in everything for v in ex.record().values())
        pool = [ex.subject.split(" ", 1)[0] for ex in everything if ex.subject and " " in ex.subject]
        extra, sources = other_questions(forget, cf.contexts)
        if extra:
            forget_batches = [*forget_batches, *make_batches(tokenizer, extra, params.batch_size, params.max_length,
                                                             first_id=len(forget), fmt=fmt)]
            log.debug("counterfactual drops: %d answers also read after %d other question(s) of their subject",
                      len(extra), cf.contexts)
        found = counterfactual_drops(model, tokenizer, [*forget, *extra], forget_batches, fmt, k=cf.strangers,
                                     gain=params.gain, min_gap=params.min_gap, seed=params.seed,
                                     batch_size=params.batch_size, max_length=params.max_length, avoid=text,
                                     pool=pool, rename=cf.rename)
        # an answer read after another question is its own example's key: its subject's bag, its influence
        owner = torch.tensor([*range(len(forget)), *sources], dtype=torch.long)
        found.batches = [dataclasses.replace(b, example_ids=owner[b.example_ids]) for b in found.batches]
    log.info("%s drops: %d of %d forget positions with a gap >= %.2f (mean drop %.2f), %d rewritten rows", kind,
             found.drops.numel(), found.positions_before, params.min_gap, float(found.drops.mean()), found.rewrites)
    return found.batches, found.drops


def specificity_beta(model: nn.Module, answers: Sequence[Batch], weights: torch.Tensor, params: GromParams,
                     keys: str) -> Beta:
    """beta as given, or `subject_beta` at subject keys, or `margins` times the forget answers' mean margin."""
    spec = params.specificity
    if spec.beta is not None:
        return Beta(spec.beta)
    if keys != "answer":
        return Beta(spec.subject_beta)
    beta, margin = margin_beta(*gold_margins(model, answers), weights, spec.margins)
    log.info("specificity drops: beta %.2f = %.3g x the forget answers' mean margin %.3f nats", beta, spec.margins,
             margin)
    if beta == 0.0:
        log.warning("the model prefers none of the forget answers' specific tokens over the others (mean margin "
                    "0): there is nothing to lower, and the edit is zero; set specificity.beta to lower them anyway")
    return Beta(beta, margin)


def subject_groups(examples: Sequence[Example]) -> torch.Tensor:
    """(n,) one id per distinct subject; an example without a subject is a group of its own."""
    ids: dict[str, int] = {}
    out = []
    for i, ex in enumerate(examples):
        key = f"subject:{ex.subject}" if ex.subject is not None else f"example:{i}"
        out.append(ids.setdefault(key, len(ids)))
    return torch.tensor(out, dtype=torch.long)
