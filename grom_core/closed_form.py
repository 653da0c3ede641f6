"""The one-call GROM edit: statistics, layer choice, targets and solve on a model and two lists of examples.

    run = run_grom(model, tokenizer, forget, retain, GromParams())
    run.edit          # the Edit value; the model is unchanged until run.edit.apply(model)
    run.influence     # module -> InfluenceReport (when GromParams.influence)

Everything is forward passes and float64 linear algebra; no gradient is taken.

Several layers: editing layer l changes the keys of every later layer. With strategy="sequential" (the default)
the modules are solved from the lowest layer up; before each solve the forget keys are collected again with the
edits so far applied, and the module is asked for its share of the logit drop that is still missing (measured on
the real logits, MEMIT's way of spreading a residual over layers). strategy="parallel" solves every module from the
original keys with an equal share of the drop: one pass instead of one per module, less accurate.

What is asked at each forget position is a set of tokens and their logit drops (targets.TokenDrops): the gold next
token alone (specificity drops, or counterfactual drops with scope="position"), or the whole bag of tokens flagged
anywhere in the rows of the position's subject (scope="subject", the default where rows name their subjects).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from grom_core.adapter import ModelAdapter, get_module, weight_out_in
from grom_core.capture import collect
from grom_core.counterfactual import counterfactual_drops, other_questions
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
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError, FingerprintMismatchError, UnsupportedArchitectureError
from grom_core.fingerprint import data_digest, weights_fingerprint
from grom_core.influence import InfluenceReport, influence_report
from grom_core.layers import LayerScores, choose_band, score_layers
from grom_core.params import Params, ParamsError
from grom_core.profiling import Timings
from grom_core.quantization import QuantSpec, quantized, quantizers
from grom_core.readout import NllProbe
from grom_core.scoring import answer_nll, gold_margins
from grom_core.sentence_drops import sentence_drops
from grom_core.solver import solve_factors
from grom_core.statistics import GramStats, StatsComputer, StatsStore, accumulate
from grom_core.targets import (
    TokenDrops,
    lm_head_suppression,
    margin_beta,
    project_out,
    protected_tokens,
    representation_corruption,
    residual_suppression,
    specificity_weights,
    suggest_coefficient,
    suppression_drops,
    word_start_mask,
)

log = logging.getLogger(__name__)

# beta where `beta` is None and the forget keys are at the subjects: their drop is asked of the residual stream at the
# subject's last token, far from the answer position whose margin `margin_beta` reads; measured on minizsre
# (docs/minizsre.md)
SUBJECT_KEYS_BETA = 40.0


@dataclass(frozen=True)
class GromParams(Params):
    """Hyper-parameters of the closed-form edit.

    Attributes:
        layers: layers whose down-projection is edited; [] edits the LM head alone (suppression with
            `edit_lm_head`). None picks a band by logit-lens attribution, or every layer for sentence drops (what
            a model memorised word for word is not held in one band: on minimuse the attributed band of two
            forgets less at the same retain budget, docs/minimuse.md). With specificity drops under a retain budget
            the band is solved first and scaled to the budget on its own, and the LM head then lowers what it left
            (`solve_body_first`): what the band removes is gone for any reader of the body (grom_core.attacks),
            what the head adds is not.
        band_width: number of contiguous layers in the automatic band.
        late_fraction: the band is searched among the last `late_fraction` of the layers.
        edit_lm_head: also edit the LM head (suppression targets only).
        target: "suppress" (lower the gold tokens' logits; generation benchmarks) or "corrupt" (move the layer
            output to a random direction; multiple-choice benchmarks).
        drops: how much each forget position's gold token is lowered: "specificity" (beta * a(y_t), a the token's
            forget-specificity, see targets.specificity_weights), "counterfactual" (gain times the log-odds gap to
            what the model predicts when the subject is a stranger, see grom_core.counterfactual; needs subjects
            and answer keys), "sentence" (gain times the log-odds gap to what the model predicts from the token's
            own sentence alone, a QA row's answer after other questions of its kind, see
            grom_core.sentence_drops; needs answer keys), or "auto": "counterfactual"
            where the forget data names subjects and the keys are the answers, else "sentence" where it holds
            texts (passages that can be memorised word for word), else "specificity".
        beta: specificity drops: the logit drop asked for at a forget position with specificity 1 (nats of
            log-odds). None: `beta_margins` times the mean margin of the forget answers' specific tokens (each gold
            token's logit over the best other token's, measured by one forward pass over the forget rows; see
            targets.margin_beta): about 40 on the tiny models, 16 on SmolLM2's capitals, where 40 takes
            neighbouring facts along (docs/minirwku.md). At subject keys (`keys`) None is SUBJECT_KEYS_BETA, 40:
            the margin is read where the answer is, and a drop asked at the subject, layers before it, with the
            measured beta (11 on minizsre) forgets half the facts that 40 does (docs/minizsre.md).
        beta_margins: beta in units of that mean margin, when `beta` is None. 4.5 keeps the drop the tiny models
            were tuned at (a memorised answer's tokens lead by about 9 nats there).
        gain: counterfactual and sentence drops: multiple of the gap asked for (> 1 so that phrasings the edit
            never sees move).
        counterfactuals: counterfactual drops: invented names per example (their predictions are averaged).
        rename: counterfactual drops: which words of a subject the strangers replace: "first" (the first word:
            the drops also lower the rest of the name, which the model completes for the subject it knows) or
            "whole" (every word: only what follows the name is compared); see grom_core.counterfactual.
        contexts: counterfactual drops: how many of its subject's other questions each forget answer is also read
            after (the next ones in the data, cyclically; see counterfactual.other_questions), each reading a forget
            row of its own with its own measured drops. The answer's facts then stand in contexts the model was not
            trained on, and the subject's bag is asked there too: on minitofu one such context keeps 0.001-0.004
            more Model Utility at about the same Forget Quality (four seeds), two or more lose Forget Quality
            (docs/minitofu.md). 0: each answer after its own question only.
        scope: counterfactual drops: which tokens each forget position is asked to lower: "position" (its own
            next token, by its own drop) or "subject" (every token that is asked to drop anywhere in the rows of
            its subject, by the largest drop asked of it there: the same bag at every position of a subject, which
            the edit can only meet through what those keys share, the subject, so the facts also drop in phrasings
            the solve never saw; see targets.TokenDrops.over_groups). The LM head lowers the bag (its rows are
            the tokens: no other token's logit changes anywhere); the band's layers lower each position's own token
            first, and without the head they carry the bag.
        swaps: sentence drops: how many retain questions (those sharing the most words with it) each forget
            question is swapped for to rate its answer as the same kind of question about something else would;
            0 rates it after an empty question (the answer to any question), as where the retain data asks none.
        min_gap: counterfactual and sentence drops: positions whose gap (before the gain) is smaller, in nats of
            log-odds, are not forget keys: the model rates their token about as it would for anyone (or from its
            sentence alone).
        protect: suppression by a down-projection: how many retain answer tokens (those whose unembeddings are
            most aligned with the tokens asked to drop, targets.protected_tokens) keep their logit-lens logits: the
            residual change asked of the band is built orthogonal to their unembeddings, so that lowering one
            capital does not lower the others its unembedding resembles. 0: none kept (the smallest change).
        retain_budget: suppression keyed at the answers (any drop kind): the largest mean increase of the retain
            answers' token NLL (nats per token, on `budget_examples` retain rows drawn with `seed`, their first 128
            tokens) the edit may cause; a larger edit is scaled down (alpha * P for every module, found by
            bisection on readings of the sample, grom_core.readout) until it fits. How far `gain` or `beta` can
            go depends on how entangled the forget facts are with the retain ones; the budget finds out on the data.
            None: no limit.
        forget_target: a stated forget level instead of the full drop: the edit is scaled down to the smallest
            alpha (the budget's grid, within what the budget allows) at which the forget answers' probability
            (TOFU's: exp of minus each answer's mean token NLL, averaged over the forget rows, in the prompt format)
            is at most this. The drops asked for (beta, gain) were sized on small models; on a pretrained model
            they can ask several times what forgetting needs, and the surplus moves neighbouring facts too
            (docs/minirwku.md). None: the full edit. Any drop kind.
        forget_target_attack: a quantization attack (grom_core.quantization: gguf_q4_1, rtn4, fp4, nf4, int8,
            fp4_head_kept) after which the forget target is read: every probe of the bisection round-trips the
            whole edited model. An edit scaled to the target can be rounded away (llama.cpp's Q4_1 gives most of a
            SmolLM2 edit scaled to 0.05 back, docs/minirwku.md); read after the round trip, the target holds after
            it. None: read on the model as edited.
        sharpness, threshold, smoothing: shape of the specificity weights (see targets.specificity_weights).
        word_starts_only: suppress only tokens that begin a word, not the pieces inside one (see
            targets.word_start_mask).
        keys: where forget keys are taken: "answer" (every supervised answer position), "subject" (the last token
            of each example's subject, asked to lower the answer's first token there: where a model holds what it
            knows about the subject, ROME's finding), "subject+answer" (both), or "auto": "subject" where the forget
            data names subjects and its answers are the bare objects ("Paris" for "The capital of France is"),
            "answer" where most answers restate their subject (QA sentences, which carry the fact along the answer,
            where the counterfactual drops find it) or no subject is named. Examples without a subject keep their
            answer positions.
        w_forget, w_retain: weights of the mean squared forget error and the mean squared retain output change.
        relative_ridge: mu as a fraction of the mean retain key energy, mu = relative_ridge * w_retain * tr(G_r) /
            (r n), so the same value suits any model width and key scale.
        strategy: "sequential" or "parallel" (see the module docstring).
        corrupt_coefficient: c of the corruption target; None uses 2x the mean residual norm of the forget positions.
        seed: seed of the corruption direction.
        batch_size, max_length: forward pass batching (examples per batch, tokens per example).
        influence: also compute the exact per-example influence on every module's edit.
    """

    layers: tuple[int, ...] | None = None
    band_width: int = 2
    late_fraction: float = 0.75
    edit_lm_head: bool = True
    target: str = "suppress"
    drops: str = "auto"
    beta: float | None = None
    beta_margins: float = 4.5
    gain: float = 6.0
    counterfactuals: int = 4
    rename: str = "first"
    contexts: int = 1
    scope: str = "subject"
    swaps: int = 16
    min_gap: float = 0.5
    protect: int = 0
    retain_budget: float | None = 0.04
    budget_examples: int = 32
    forget_target: float | None = None
    forget_target_attack: str | None = None
    sharpness: float = 2.0
    threshold: float = 0.5
    smoothing: float = 1.0
    word_starts_only: bool = False
    keys: str = "auto"
    w_forget: float = 1.0
    w_retain: float = 10.0
    relative_ridge: float = 1e-3
    strategy: str = "sequential"
    corrupt_coefficient: float | None = None
    seed: int = 0
    batch_size: int = 16
    max_length: int = 512
    influence: bool = True

    def validate(self) -> None:
        if self.target not in ("suppress", "corrupt"):
            raise ParamsError(f"target must be 'suppress' or 'corrupt', got '{self.target}'")
        if self.keys not in ("auto", "answer", "subject", "subject+answer"):
            raise ParamsError(f"keys must be 'auto', 'answer', 'subject' or 'subject+answer', got '{self.keys}'")
        if self.drops not in ("auto", "specificity", "counterfactual", "sentence"):
            raise ParamsError(f"drops must be 'auto', 'specificity', 'counterfactual' or 'sentence', got "
                              f"'{self.drops}'")
        if self.rename not in ("first", "whole"):
            raise ParamsError(f"rename must be 'first' or 'whole', got '{self.rename}'")
        if self.scope not in ("position", "subject"):
            raise ParamsError(f"scope must be 'position' or 'subject', got '{self.scope}'")
        if self.protect < 0:
            raise ParamsError(f"protect counts tokens: need protect >= 0, got {self.protect}")
        if self.gain <= 0 or self.counterfactuals < 1 or self.swaps < 0 or self.min_gap < 0 or self.contexts < 0:
            raise ParamsError("need gain > 0, counterfactuals >= 1, contexts >= 0, swaps >= 0 and min_gap >= 0")
        if (self.retain_budget is not None and self.retain_budget <= 0) or self.budget_examples < 1:
            raise ParamsError("need retain_budget > 0 (or None) and budget_examples >= 1")
        if self.forget_target is not None and not 0 < self.forget_target < 1:
            raise ParamsError(f"forget_target is a probability: need 0 < forget_target < 1 (or None), got "
                              f"{self.forget_target}")
        if self.forget_target_attack is not None:
            if self.forget_target is None:
                raise ParamsError("forget_target_attack reads the forget target after an attack: set forget_target "
                                  "too")
            if self.forget_target_attack not in quantizers(available=True):
                raise ParamsError(f"forget_target_attack must be one of {', '.join(quantizers(available=True))}, "
                                  f"got '{self.forget_target_attack}'")
        if self.strategy not in ("sequential", "parallel"):
            raise ParamsError(f"strategy must be 'sequential' or 'parallel', got '{self.strategy}'")
        if (self.beta is not None and self.beta <= 0) or self.w_forget <= 0 or self.w_retain < 0 \
                or self.relative_ridge <= 0:
            raise ParamsError("need beta > 0 (or None), w_forget > 0, w_retain >= 0 and relative_ridge > 0")
        if self.beta_margins <= 0:
            raise ParamsError(f"need beta_margins > 0, got {self.beta_margins}")
        if self.band_width < 1 or not 0 < self.late_fraction <= 1:
            raise ParamsError("need band_width >= 1 and 0 < late_fraction <= 1")
        if self.batch_size < 1 or self.max_length < 2:
            raise ParamsError("need batch_size >= 1 and max_length >= 2 (tokens)")
        if not 0 <= self.threshold <= 1 or self.sharpness <= 0 or self.smoothing < 0:
            raise ParamsError("need 0 <= threshold <= 1, sharpness > 0 and smoothing >= 0")
        if self.layers is not None and self.layers and min(self.layers) < 0:
            raise ParamsError(f"layers must be layer indices >= 0, got {list(self.layers)}")
        if self.layers is not None and not self.layers and not (self.edit_lm_head and self.target == "suppress"):
            raise ParamsError("layers [] edits the LM head alone: it needs edit_lm_head=True and target='suppress'; "
                              "name at least one layer otherwise")


@dataclass
class SolveRecord:
    """Everything one module's solve used, kept for the influence audit. Shapes: keys (n, s), targets (m, s),
    example_ids, positions and tokens (s,) (the gold next token at each position); ridge is mu, w_forget and
    w_retain the objective's weights (REFERENCE section 1). An LM head's targets are kept by their non-zero rows
    (`target_rows`), which leaves every norm of the influence audit unchanged."""

    module: str
    keys: torch.Tensor
    targets: torch.Tensor
    example_ids: torch.Tensor
    ridge: float
    retain_count: int
    w_forget: float = 1.0
    w_retain: float = 1.0
    positions: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    target_rows: torch.Tensor | None = None  # (u,) for a row-sparse target: targets are the rows D[target_rows]


@dataclass
class GromRun:
    """The result of `run_grom`: the edit and what it was made from."""

    edit: Edit
    layers: list[int]
    layer_scores: LayerScores | None
    retain_stats: dict[str, GramStats]
    records: dict[str, SolveRecord] = field(default_factory=dict)
    influence: dict[str, InfluenceReport] = field(default_factory=dict)
    reused_stats: list[str] = field(default_factory=list)  # modules whose retain statistics came from a cache
    timings_s: dict[str, float] = field(default_factory=dict)


def _head_logits(head: nn.Module, keys: torch.Tensor, rows: torch.Tensor, delta: ModuleDelta | None = None
                 ) -> torch.Tensor:
    """(u, s) logits of tokens `rows` (u,) from LM-head keys (s, hidden), float64; `delta` adds an (unapplied)
    head edit."""
    w = weight_out_in(head).detach()
    weights = w[rows.to(w.device)].double()
    if delta is not None:
        weights = weights + delta.rows_at(rows).to(weights.device)
    logits = weights @ keys.double().to(w.device).T
    bias = getattr(head, "bias", None)
    if bias is not None:
        logits = logits + bias.detach().double()[rows.to(bias.device)][:, None]
    return logits.cpu()


def _mu(stats: GramStats, params: GromParams) -> float:
    energy = float(stats.gram.diagonal().sum()) / max(1, stats.count) / stats.dim
    return params.relative_ridge * max(params.w_retain, 1e-12) * max(energy, 1e-12)


@dataclass
class Prepared:
    """The inputs of every stage, prepared once: examples, batches, specificity weights and digests."""

    adapter: ModelAdapter
    forget: list[Example]
    retain: list[Example]
    forget_batches: list[Batch]
    retain_batches: list[Batch]
    weights: torch.Tensor  # (vocab,) specificity a(j)
    fingerprint: str
    forget_digest: str
    retain_digest: str
    stats_digest: str  # what the retain statistics depend on: the retain data, max_length and the prompt format
    drops: torch.Tensor | None = None  # (s,) measured drops per forget position; None: beta * weights
    drops_kind: str = "specificity"
    retain_sample: list[Batch] | None = None  # where the retain budget is measured (suppression at the answers)
    drop_groups: torch.Tensor | None = None  # (forget examples,) subject of each example, whose drops are pooled
    # the forget rows, every answer token scored (forget_target)
    forget_sample: list[Batch] | None = None
    beta: float | None = None  # specificity drops: the logit drop at specificity 1, params.beta or measured
    mean_margin: float | None = None  # where beta was measured: the forget answers' mean margin (nats)
    retain_tokens: torch.Tensor | None = None  # (k,) the distinct retain answer tokens (candidates to protect)


def prepare(model: nn.Module, tokenizer, forget, retain, params: GromParams = GromParams(),
            adapter: ModelAdapter | None = None, fingerprint: str | None = None,
            fmt: str | PromptFormat = "qa") -> Prepared:
    """Validate and batch the data (in prompt format `fmt`), fingerprint the model, and weigh tokens by
    forget-specificity."""
    fmt = prompt_format(fmt)
    params.validate()
    if params.forget_target_attack is not None:
        attack_spec(params.forget_target_attack)  # before any forward pass, not after the solve
    forget_ex, retain_ex = as_examples(forget), as_examples(retain)
    adapter = adapter or ModelAdapter.for_model(model)
    if params.edit_lm_head and params.target == "suppress" and adapter.lm_head_is_tied():
        raise UnsupportedArchitectureError(
            f"'{adapter.lm_head_name}' is tied to the input embedding: call adapter.untie_lm_head() first "
            f"(numerically a no-op), or set edit_lm_head=False")
    forget_batches = make_batches(tokenizer, forget_ex, params.batch_size, params.max_length, fmt=fmt)
    keys, drops_kind = resolve_keys_and_drops(params, forget_ex)
    if keys != "answer":
        forget_batches = mark_subjects(tokenizer, forget_ex, forget_batches, fmt, answers=keys != "subject")
    retain_batches = make_batches(tokenizer, retain_ex, params.batch_size, params.max_length,
                                  first_id=len(forget_ex), fmt=fmt, by_length=True)  # only summed: any order
    vocab = weight_out_in(adapter.lm_head).shape[0]
    weights = specificity_weights(iter_answer_tokens(forget_batches), iter_answer_tokens(retain_batches), vocab,
                                  sharpness=params.sharpness, threshold=params.threshold,
                                  smoothing=params.smoothing)
    if params.word_starts_only:
        weights = weights * word_start_mask(tokenizer, vocab)
    drops, retain_sample, groups = None, None, None
    if drops_kind in ("counterfactual", "sentence"):
        forget_batches, drops = _measured_drops(model, tokenizer, forget_ex, retain_ex, forget_batches, fmt, params,
                                                drops_kind)
        if drops_kind == "counterfactual" and params.scope == "subject":
            groups = subject_groups(forget_ex)
    if params.retain_budget is not None and params.target == "suppress" and keys == "answer" and retain_ex:
        rows = random.Random(params.seed).sample(retain_ex, min(params.budget_examples, len(retain_ex)))
        # at most 128 tokens a row: the budget is a sample's mean, long prose rows need not be read whole
        retain_sample = make_batches(tokenizer, rows, params.batch_size, min(params.max_length, 128), fmt=fmt,
                                     by_length=True)  # a mean over rows: any order, and a third of the padding
    forget_sample = None
    if params.forget_target is not None:
        forget_sample = make_batches(tokenizer, forget_ex, params.batch_size, params.max_length, fmt=fmt)
    beta, mean_margin = params.beta, None
    if beta is None and keys != "answer":
        beta = SUBJECT_KEYS_BETA  # asked of the residual at the subject, not against the answer's own margin
    if drops_kind == "specificity" and params.target == "suppress" and beta is None:
        answers = forget_sample or make_batches(tokenizer, forget_ex, params.batch_size, params.max_length, fmt=fmt)
        beta, mean_margin = margin_beta(*gold_margins(model, answers), weights, params.beta_margins)
        log.info("specificity drops: beta %.2f = %.3g x the forget answers' mean margin %.3f nats", beta,
                 params.beta_margins, mean_margin)
        if beta == 0.0:
            log.warning("the model prefers none of the forget answers' specific tokens over the others (mean margin "
                        "0): there is nothing to lower, and the edit is zero; set beta to lower them anyway")
    retain_digest = data_digest(ex.record() for ex in retain_ex)
    return Prepared(adapter=adapter, forget=forget_ex, retain=retain_ex, forget_batches=forget_batches,
                    retain_batches=retain_batches, weights=weights, drops=drops, drops_kind=drops_kind,
                    retain_sample=retain_sample, drop_groups=groups, forget_sample=forget_sample, beta=beta,
                    mean_margin=mean_margin,
                    retain_tokens=torch.tensor(sorted(set(iter_answer_tokens(retain_batches))), dtype=torch.long),
                    fingerprint=fingerprint or weights_fingerprint(model),
                    forget_digest=data_digest(ex.record() for ex in forget_ex), retain_digest=retain_digest,
                    stats_digest=data_digest([{"retain": retain_digest, "max_length": params.max_length,
                                               "prompt_format": fmt.name}]))


def _measured_drops(model: nn.Module, tokenizer, forget_ex: list[Example], retain_ex: list[Example],
                    forget_batches: list[Batch], fmt: PromptFormat, params: GromParams, kind: str
                    ) -> tuple[list[Batch], torch.Tensor]:
    """The forget batches cut to the positions that carry what the model knows (counterfactual or sentence drops,
    `kind`) and their drops (s,)."""
    if kind == "sentence":
        questions = [ex.question for ex in retain_ex if ex.question is not None]
        found = sentence_drops(model, tokenizer, forget_ex, forget_batches, fmt, gain=params.gain,
                               min_gap=params.min_gap, batch_size=params.batch_size, questions=questions,
                               swaps=params.swaps, max_length=params.max_length)
    else:
        everything = [*forget_ex, *retain_ex]
        text = " ".join(str(v) for ex in everything for v in ex.record().values())
        pool = [ex.subject.split(" ", 1)[0] for ex in everything if ex.subject and " " in ex.subject]
        extra, sources = other_questions(forget_ex, params.contexts)
        if extra:
            forget_batches = [*forget_batches, *make_batches(tokenizer, extra, params.batch_size, params.max_length,
                                                             first_id=len(forget_ex), fmt=fmt)]
            log.info("counterfactual drops: %d answers also read after %d other question(s) of their subject",
                     len(extra), params.contexts)
        found = counterfactual_drops(model, tokenizer, [*forget_ex, *extra], forget_batches, fmt,
                                     k=params.counterfactuals, gain=params.gain, min_gap=params.min_gap,
                                     seed=params.seed, batch_size=params.batch_size, max_length=params.max_length,
                                     avoid=text, pool=pool, rename=params.rename)
        # an answer read after another question is its own example's key: its subject's bag, its influence
        owner = torch.tensor([*range(len(forget_ex)), *sources], dtype=torch.long)
        found.batches = [dataclasses.replace(b, example_ids=owner[b.example_ids]) for b in found.batches]
    log.info("%s drops: %d of %d forget positions with a gap >= %.2f (mean drop %.2f), %d rewritten rows", kind,
             found.drops.numel(), found.positions_before, params.min_gap, float(found.drops.mean()), found.rewrites)
    return found.batches, found.drops


def subject_groups(examples: Sequence[Example]) -> torch.Tensor:
    """(n,) one id per distinct subject; an example without a subject is a group of its own."""
    ids: dict[str, int] = {}
    out = []
    for i, ex in enumerate(examples):
        key = f"subject:{ex.subject}" if ex.subject is not None else f"example:{i}"
        out.append(ids.setdefault(key, len(ids)))
    return torch.tensor(out, dtype=torch.long)


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


def select_layers(model: nn.Module, prep: Prepared, params: GromParams) -> tuple[list[int], LayerScores | None]:
    """The manual layers, or every layer for sentence drops, or the best band by logit-lens attribution on the forget
    data (with the scores)."""
    adapter = prep.adapter
    if params.layers is not None:
        layers = sorted(set(params.layers))
        bad = [layer for layer in layers if not 0 <= layer < adapter.num_layers]
        if bad:
            raise DataError(f"layers {bad} do not exist; the model has layers 0..{adapter.num_layers - 1}")
        return layers, None
    if prep.drops_kind == "sentence":
        log.info("sentence drops: every layer is edited")
        return list(range(adapter.num_layers)), None
    scores = score_layers(model, adapter, prep.forget_batches, prep.weights)
    layers = choose_band(scores.score, min(params.band_width, adapter.num_layers), params.late_fraction)
    log.info("layer scores %s -> editing layers %s", ", ".join(f"{v:.3f}" for v in scores.score.tolist()), layers)
    return layers, scores


def body_first(prep: Prepared, params: GromParams, layers: Sequence[int]) -> bool:
    """Whether the band is solved before the LM head and scaled to the retain budget alone (`solve_body_first`):
    the layers left to the library, suppression at the answers by specificity drops, the head edited too, and a
    retain budget to scale the band at. Counterfactual drops keep the joint solve (band, then head, scaled
    together): there the band, scaled to the budget alone, lowers a subject's facts too little for the head's
    share of what is left (on the tiny authors, 0.64 of the forget probability kept against 0.11)."""
    return (params.layers is None and bool(layers) and prep.drops_kind == "specificity"
            and params.edit_lm_head and params.target == "suppress" and prep.retain_sample is not None
            and params.retain_budget is not None)


def solve_body_first(model: nn.Module, prep: Prepared, params: GromParams, layers: list[int], modules: list[str],
                     stats: dict[str, GramStats]) -> tuple[Solved, dict]:
    """Removal before masking: the band's down-projections are solved for the whole drop as the unedited LM head
    reads it (so what they remove is gone for any reader of the body, grom_core.attacks), scaled to the retain
    budget on their own, and only then is the head solved, with the scaled band applied, for what the band left:
    the head completes the forgetting, it never carries it alone where the band can carry any. Returns the
    combined updates (the band's scaled; `solve` fits the sum to the budget again) and what was measured."""
    head = prep.adapter.lm_head_name
    band_modules = [m for m in modules if m != head]
    band = solve_modules(model, prep, layers, band_modules, {m: stats[m] for m in band_modules}, params)
    fit = fit_to_budget(NllProbe(model, prep.retain_sample, head), band.deltas, float(params.retain_budget))
    deltas = {name: d.scaled(fit.scale) for name, d in band.deltas.items()}
    records = {name: dataclasses.replace(rec, targets=rec.targets * fit.scale) for name, rec in band.records.items()}
    with Edit(deltas=deltas, base_fingerprint="").applied(model, verify=False):
        rest = solve_modules(model, prep, [], [head], {head: stats[head]}, params)
    log.info("body first: the band %s costs the retain sample %.4f nats at full size, kept at scale %.3f; the LM "
             "head lowers the rest (mean drop asked %.3g)", layers, fit.damage_unscaled, fit.scale,
             rest.achieved["asked_mean"])
    measured = {"band_scale": fit.scale, "band_damage_unscaled": fit.damage_unscaled, "band_damage": fit.damage,
                "band_logit_drop": band.achieved, "head_logit_drop": rest.achieved}
    return Solved(deltas={**deltas, **rest.deltas}, records={**records, **rest.records},
                  achieved=rest.achieved), measured


def edited_modules(adapter: ModelAdapter, layers: Sequence[int], params: GromParams) -> list[str]:
    """Module names in solve order: the layers' down-projections, lowest first, then the LM head if edited."""
    modules = [adapter.down_proj_names[layer] for layer in sorted(layers)]
    if params.edit_lm_head and params.target == "suppress":
        modules.append(adapter.lm_head_name)
    return modules


def check_statistics(stats: Mapping[str, GramStats], prep: Prepared) -> None:
    """Refuse statistics computed on other weights, other retain data or another `max_length`."""
    for name, st in stats.items():
        if st.fingerprint != prep.fingerprint:
            raise FingerprintMismatchError(
                f"retain statistics of '{name}' were computed on model {st.fingerprint[:12] or '(unrecorded)'}, not "
                f"{prep.fingerprint[:12]}; recompute them for this model")
        if st.data_digest != prep.stats_digest:
            raise DataError(f"retain statistics of '{name}' were computed on other retain data (or another "
                            f"max_length): digest {st.data_digest[:12] or '(unrecorded)'}, expected "
                            f"{prep.stats_digest[:12]}; recompute them for this retain data")


def retain_statistics(model: nn.Module, prep: Prepared, modules: Sequence[str],
                      cached: Mapping[str, GramStats] | None = None, *, store: StatsStore | None = None,
                      compute: StatsComputer | None = None) -> tuple[dict[str, GramStats], list[str]]:
    """GramStats per module and the names of those that were reused.

    Reused: `cached` (checked against this model's fingerprint and this retain data), then whatever `store`
    holds under (fingerprint, stats digest). The rest are computed (by `compute` when given, e.g. sharded over a
    cluster, else in this process) and saved to `store`.
    """
    stats = {m: st for m, st in (cached or {}).items() if m in modules}
    check_statistics(stats, prep)
    missing = [m for m in modules if m not in stats]
    if missing and store is not None:
        found = store.load(prep.fingerprint, prep.stats_digest, missing)
        check_statistics(found, prep)
        stats.update(found)
    reused = [m for m in modules if m in stats]
    missing = [m for m in modules if m not in stats]
    if missing:
        if compute is not None:
            computed = compute(missing, prep.fingerprint, prep.stats_digest)
        else:
            # stopped at the last hooked input, the LM head's too: its vocabulary-wide product is never needed
            computed = accumulate(model, prep.retain_batches, missing, fingerprint=prep.fingerprint,
                                  data_digest=prep.stats_digest)
        check_statistics(computed, prep)
        if store is not None:
            store.save(computed)
        stats.update(computed)
    return {m: stats[m] for m in modules}, reused


@dataclass
class Solved:
    """The unscaled updates of one placement: module -> delta and solve record, and the logit drop as solved."""

    deltas: dict[str, ModuleDelta]
    records: dict[str, SolveRecord]
    achieved: dict[str, float]


def solve_modules(model: nn.Module, prep: Prepared, layers: list[int], modules: list[str],
                  stats: dict[str, GramStats], params: GromParams) -> Solved:
    """Targets and closed-form solves of every module (see the module docstring); the model is left unchanged."""
    solver = _SequentialSolver(model, prep.adapter, prep.forget_batches, prep.weights, params, stats, layers,
                               prep.drops, prep.drop_groups, prep.beta, retain_tokens=prep.retain_tokens)
    deltas, records = solver.solve(modules)
    return Solved(deltas=deltas, records=records, achieved=solver.achieved)


def solve(model: nn.Module, prep: Prepared, layers: list[int], modules: list[str], stats: dict[str, GramStats],
          params: GromParams, scores: LayerScores | None = None, solved: Solved | None = None,
          fit: BudgetFit | None = None) -> tuple[Edit, dict[str, SolveRecord]]:
    """The Edit of `modules`: solved (unless `solved` is given), scaled to the retain budget (unless its `fit` is
    given) and to the forget target; the model is left unchanged."""
    solved = solved or solve_modules(model, prep, layers, modules, stats, params)
    deltas, records = solved.deltas, solved.records
    enough = None
    if fit is None and prep.retain_sample is not None and params.retain_budget is not None:
        fit = fit_to_budget(NllProbe(model, prep.retain_sample, prep.adapter.lm_head_name), deltas,
                            params.retain_budget)
    if prep.forget_sample is not None and params.forget_target is not None:
        enough = fit_to_forget_target(model, prep.forget_sample, deltas, params.forget_target,
                                      upper=fit.scale if fit else 1.0, attack=params.forget_target_attack,
                                      head=prep.adapter.lm_head_name)
    scale = enough.scale if enough else fit.scale if fit else 1.0
    if scale != 1.0:
        deltas = {name: delta.scaled(scale) for name, delta in deltas.items()}
        records = {name: dataclasses.replace(rec, targets=rec.targets * scale) for name, rec in records.items()}
    edit = Edit(deltas=deltas, base_fingerprint=prep.fingerprint, params={**params.to_dict(), "method": "grom"},
                metadata={"layers": layers, "modules": modules, "retain_digest": prep.retain_digest,
                          "forget_digest": prep.forget_digest, "forget_examples": len(prep.forget),
                          "retain_examples": len(prep.retain),
                          "forget_positions": int(next(iter(records.values())).keys.shape[1]),
                          "retain_positions": {m: stats[m].count for m in modules},
                          "layer_scores": scores.as_rows() if scores is not None else None,
                          "logit_drop": solved.achieved,  # as solved, before a retain budget's scale
                          "drops": prep.drops_kind,
                          "beta": prep.beta, "mean_margin": prep.mean_margin,  # specificity drops
                          "retain_budget": dataclasses.asdict(fit) if fit else None,
                          "forget_target": dataclasses.asdict(enough) if enough else None})
    return edit, records


@dataclass(frozen=True)
class BudgetFit:
    """The scale alpha given to every module's update, and the retain damage (mean increase of the sampled retain
    answers' token NLL, nats) at alpha = 1 and at the chosen alpha."""

    scale: float
    damage_unscaled: float
    damage: float


def fit_to_budget(probe: NllProbe, deltas: Mapping[str, ModuleDelta], budget: float, steps: int = 5,
                  full: float | None = None) -> BudgetFit:
    """The largest alpha in [0, 1] (bisection, `steps` halvings) whose update alpha * P raises the mean token NLL
    of the retain sample `probe` reads by at most `budget` nats; the model is left unchanged. `full` (the damage at
    alpha = 1), where already measured, saves its reading."""
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


def attack_spec(name: str) -> QuantSpec:
    """The quantization attack `name` as this machine can run it, or a DataError saying what it lacks."""
    available = quantizers()
    if name not in available:
        raise DataError(f"forget_target_attack '{name}' needs bitsandbytes, which this machine lacks; available "
                        f"here: {', '.join(available)}")
    return available[name]


@dataclass(frozen=True)
class ForgetFit:
    """The scale alpha given to every module's update for a forget target, the forget answers' probability there
    and at the scale it started from, and whether the target was reached (no: the starting scale is kept)."""

    scale: float
    probability: float
    probability_unscaled: float
    reached: bool
    attack: str | None = None  # where the probabilities were read after a quantization round trip


def fit_to_forget_target(model: nn.Module, sample: Sequence[Batch], deltas: Mapping[str, ModuleDelta],
                         target: float, upper: float = 1.0, steps: int = 5, attack: str | None = None,
                         head: str | None = None) -> ForgetFit:
    """The smallest alpha on the grid upper * k / 2**steps whose update alpha * P leaves the forget answers'
    probability (mean over rows of exp(-mean token NLL)) at most `target`, by bisection on readings of the sample;
    the model is left unchanged. Where even alpha = upper does not reach it, alpha = upper. `attack`: a quantizer
    name (grom_core.quantization.quantizers); each probability is read by a forward pass after its round trip of
    the whole edited model. Without one, `head` (the LM head's name) lets a head-only update be read from the head's
    inputs (grom_core.readout)."""
    spec = attack_spec(attack) if attack is not None else None
    probe = NllProbe(model, sample, head) if spec is None and head is not None else None

    def attacked(alpha: float) -> float:
        edit = Edit(deltas={name: d.scaled(alpha) for name, d in deltas.items()}, base_fingerprint="")
        with edit.applied(model, verify=False), quantized(model, spec) if spec is not None else nullcontext():
            return float(torch.exp(-answer_nll(model, sample)).mean())

    def probability(alpha: float) -> float:
        return float(torch.exp(-probe.nll(deltas, alpha)).mean()) if probe is not None else attacked(alpha)

    at_upper = probability(upper)
    if at_upper > target:
        log.warning("forget target %.3g not reached: the forget answers' probability is %.3g at scale %.3f, the "
                    "most the edit (and the retain budget) allows", target, at_upper, upper)
        return ForgetFit(scale=upper, probability=at_upper, probability_unscaled=at_upper, reached=False,
                         attack=attack)
    low, high, at_high = 0.0, upper, at_upper
    for _ in range(steps):
        mid = (low + high) / 2
        got = probability(mid)
        low, high, at_high = (low, mid, got) if got <= target else (mid, high, at_high)
    log.info("forget target %.3g: update scaled by %.3f (forget probability %.4f, %.4f at %.3f)", target, high,
             at_high, at_upper, upper)
    return ForgetFit(scale=high, probability=at_high, probability_unscaled=at_upper, reached=True, attack=attack)


def audit(records: dict[str, SolveRecord], stats: dict[str, GramStats], params: GromParams
          ) -> dict[str, InfluenceReport]:
    """Exact leave-one-out influence of every forget example on every module's edit."""
    return {name: record_influence(rec, stats[name]) for name, rec in records.items()}


def record_influence(record: SolveRecord, stats: GramStats) -> InfluenceReport:
    """Exact leave-one-out influence of every forget example on one module's edit, from what its solve used.

    Exact for that module with everything else held fixed: its keys, targets, specificity weights, the chosen
    layers and c = w_forget / s. Leaving an example out for real would also change those (see `refit_check`)."""
    return influence_report(record.keys, record.targets, stats.gram, record.retain_count, record.example_ids,
                            w_forget=record.w_forget, w_retain=record.w_retain, ridge=record.ridge)


def run_grom(model: nn.Module, tokenizer, forget: Sequence[Example | dict | tuple | str],
             retain: Sequence[Example | dict | tuple | str], params: GromParams = GromParams(), *,
             adapter: ModelAdapter | None = None, retain_stats: Mapping[str, GramStats] | None = None,
             stats_store: StatsStore | None = None, compute_stats: StatsComputer | None = None,
             prompt_format: str | PromptFormat = "qa") -> GromRun:
    """Compute the closed-form unlearning edit of `model` for `forget` while preserving `retain`.

    Args:
        model: a Hugging Face causal LM (any device); it is not modified.
        tokenizer: its tokenizer.
        forget, retain: QA pairs or texts (Example, dicts with question/answer or text, tuples, strings).
        params: GromParams.
        adapter: hand-named modules for architectures the adapter does not know.
        retain_stats: cached GramStats per module (must match this model's fingerprint, this retain data and
            max_length); missing ones are looked up in `stats_store`, then computed (by `compute_stats` if given).
        stats_store: where retain statistics are cached (see statistics.StatsStore); computed ones are saved there.
        compute_stats: computes missing statistics elsewhere, e.g. sharded over a Dask cluster.
        prompt_format: how QA pairs become text (data.PROMPT_FORMATS: qa, completion, chat).
    """
    clock = Timings()
    with clock.stage("prepare"):
        prep = prepare(model, tokenizer, forget, retain, params, adapter, fmt=prompt_format)
    with clock.stage("layer_scores"):
        layers, scores = select_layers(model, prep, params)
    modules = edited_modules(prep.adapter, layers, params)
    with clock.stage("retain_statistics"):
        stats, reused = retain_statistics(model, prep, modules, retain_stats, store=stats_store,
                                          compute=compute_stats)
    with clock.stage("solve"):
        if body_first(prep, params, layers):
            solved, placement = solve_body_first(model, prep, params, layers, modules, stats)
            edit, records = solve(model, prep, layers, modules, stats, params, scores, solved=solved)
            edit.metadata["placement"] = placement
        else:
            edit, records = solve(model, prep, layers, modules, stats, params, scores)
    run = GromRun(edit=edit, layers=layers, layer_scores=scores, retain_stats=stats, records=records,
                  reused_stats=reused)
    if params.influence:
        with clock.stage("influence"):
            run.influence = audit(records, stats, params)
    run.timings_s = clock.seconds
    log.info("GROM edit %s: %d modules, %d forget positions, stages %s", edit.edit_id, len(modules),
             edit.metadata["forget_positions"], {k: round(v, 3) for k, v in clock.seconds.items()})
    return run


def compute_edit(model: nn.Module, tokenizer, forget, retain, params: GromParams = GromParams(), **kwargs) -> Edit:
    """`run_grom(...).edit`: the Edit alone."""
    return run_grom(model, tokenizer, forget, retain, params, **kwargs).edit


class _SequentialSolver:
    """Solves the modules lowest layer first (or all at once for strategy="parallel")."""

    def __init__(self, model, adapter: ModelAdapter, forget_batches: Sequence[Batch], weights: torch.Tensor,
                 params: GromParams, stats: dict[str, GramStats], layers: list[int],
                 drops: torch.Tensor | None = None, groups: torch.Tensor | None = None,
                 beta: float | None = None, retain_tokens: torch.Tensor | None = None) -> None:
        self.model, self.adapter, self.batches = model, adapter, forget_batches
        self.retain_tokens = retain_tokens
        self.drops, self.groups = drops, groups
        self.beta = beta  # prepare() resolved it (params.beta or measured); None where the drops are measured
        self.weights, self.params, self.stats, self.layers = weights, params, stats, layers
        self.achieved: dict[str, float] = {}

    def _collect(self, modules: Sequence[str], edit: Edit | None):
        """Forget-side capture (with `edit` applied when given): keys of `modules`, the LM-head key (logits) and
        the final-norm input (its scale), plus the block outputs for corruption targets."""
        inputs = list(dict.fromkeys([*modules, self.adapter.lm_head_name, self.adapter.final_norm_name]))
        outputs = []
        if self.params.target == "corrupt":
            outputs = [self.adapter.block_names[layer] for layer in self.layers]
        # early stop: the pass ends at the LM head's input, the logits themselves are never needed
        if edit is None or not edit.deltas:
            return collect(self.model, self.batches, inputs, outputs, desc="forget keys")
        with edit.applied(self.model, verify=False):
            return collect(self.model, self.batches, inputs, outputs, desc="forget keys")

    def solve(self, modules: list[str]) -> tuple[dict[str, ModuleDelta], dict[str, SolveRecord]]:
        params, adapter = self.params, self.adapter
        base = self._collect(modules, None)
        tokens = base.next_tokens.cpu()
        drops = self.drops if self.drops is not None else suppression_drops(tokens, self.weights, self.beta or 0.0)
        if drops.numel() != tokens.numel():  # the drops were computed on other batches than the keys
            raise RuntimeError(f"{drops.numel()} drops for {tokens.numel()} forget positions")
        if self.groups is not None:
            desired = TokenDrops.over_groups(tokens, drops, self.groups[base.example_ids.cpu()])
        else:
            desired = TokenDrops.at_next_tokens(tokens, drops)
        # the entries solved for: each position's own gold token (even where nothing is asked of it, so that a
        # rise caused by the layers below is taken back) and, with a subject's bag, every token of the bag
        own = desired.rows[:, None] == tokens[None, :]
        solved = desired.entries() | own
        # a subject's bag is the LM head's to lower (its rows are the tokens); the layers below it, when any are
        # edited, lower only each position's own token: a residual change that lowers a whole bag moves far more
        layer_entries = own if self.groups is not None and adapter.lm_head_name in modules else solved
        logits0 = _head_logits(adapter.lm_head, base.inputs[adapter.lm_head_name], desired.rows)
        deltas: dict[str, ModuleDelta] = {}
        records: dict[str, SolveRecord] = {}
        got = base
        sequential = params.strategy == "sequential"
        with ExitStack() as solved_so_far:  # sequential: each solved layer's update stays applied until the end
            for i, name in enumerate(modules):
                if sequential and i > 0:
                    got = self._collect(modules, None)
                deltas[name], records[name] = self._solve_module(name, i, modules, got, desired, solved,
                                                                 layer_entries, logits0)
                if sequential and name != adapter.lm_head_name:
                    solved_so_far.enter_context(Edit(deltas={name: deltas[name]}, base_fingerprint="").applied(
                        self.model, verify=False))
            if sequential and modules[-1] == adapter.lm_head_name:
                final = got  # collected with every other module's edit applied; the head's own delta is added below
            elif sequential:
                final = self._collect([], None)
            else:
                final = self._collect([], Edit(deltas={m: d for m, d in deltas.items() if m != adapter.lm_head_name},
                                               base_fingerprint=""))
        head_key = final.inputs[adapter.lm_head_name]
        drop = logits0 - _head_logits(adapter.lm_head, head_key, desired.rows, deltas.get(adapter.lm_head_name))
        # over the entries solved for: each position's gold token (the mean over positions), and a subject's bag
        self.achieved = {"asked_mean": float(desired.amounts[solved].mean()),
                         "achieved_mean": float(drop[solved].mean())}
        return deltas, records

    def _solve_module(self, name: str, i: int, modules: list[str], got, desired: TokenDrops, solved: torch.Tensor,
                      layer_entries: torch.Tensor, logits0: torch.Tensor) -> tuple[ModuleDelta, SolveRecord]:
        """The update of the i-th module, from the forget keys `got` collected with the modules before it edited
        (sequential) or none (parallel)."""
        params, adapter = self.params, self.adapter
        if params.strategy == "sequential":
            # the down-projections split what is still missing; the LM head, last, is asked for the rest
            achieved = logits0 - _head_logits(adapter.lm_head, got.inputs[adapter.lm_head_name], desired.rows)
            left_to_do = max(1, sum(1 for m in modules[i:] if m != adapter.lm_head_name))
            share = torch.where(solved, desired.amounts - achieved, 0.0).clamp_min(0) / left_to_do
        else:
            share = desired.amounts / len(modules)
        if name != adapter.lm_head_name:
            share = torch.where(layer_entries, share, 0.0)
        rows, targets = self._targets(name, got, TokenDrops(desired.rows, share))
        keys = got.inputs[name].double().cpu().T.contiguous()  # (n, s)
        st = self.stats[name]
        mu = _mu(st, params)
        left, right, system = solve_factors(keys, targets, st.gram.cpu(), st.count, w_forget=params.w_forget,
                                            w_retain=params.w_retain, ridge=mu)
        out_features = weight_out_in(get_module(self.model, name)).shape[0]
        delta = ModuleDelta.from_factors(name, left, right, row_index=rows, out_features=out_features)
        record = SolveRecord(module=name, keys=keys, targets=targets, example_ids=got.example_ids.cpu(),
                             ridge=mu, retain_count=st.count, w_forget=params.w_forget,
                             w_retain=params.w_retain, positions=got.positions.cpu(),
                             tokens=got.next_tokens.cpu(), target_rows=rows)
        log.info("solved %s: keys %s, ridge %.3g%s", name, tuple(keys.shape), mu,
                 f", jitter {system.jitter:.3g}" if system.jitter else "")
        return delta, record

    def _targets(self, name: str, got, share: TokenDrops) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rows, D): the module's targets, D (out, s), or, for the LM head, its non-zero rows (u,) and D[rows]."""
        adapter = self.adapter
        if self.params.target == "corrupt":
            layer = adapter.down_proj_names.index(name)
            h = got.outputs[adapter.block_names[layer]]
            c = self.params.corrupt_coefficient or suggest_coefficient(h)
            return None, representation_corruption(h, c, self.params.seed + layer)
        if name == adapter.lm_head_name:
            return lm_head_suppression(share)
        scale = adapter.norm_scale(got.inputs[adapter.final_norm_name])
        unembedding = adapter.unembedding(share.rows)
        if self.params.protect and self.retain_tokens is not None:
            kept = protected_tokens(share.rows, self.retain_tokens, adapter.unembedding, self.params.protect)
            unembedding = project_out(unembedding, adapter.unembedding(kept))
        return None, residual_suppression(share, unembedding, scale)
