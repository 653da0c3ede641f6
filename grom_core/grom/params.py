"""GROM's parameters: the method's knobs flat, the knobs of one drop kind grouped in its own dataclass.

    GromParams(retain_budget=0.02, gain=4.0)                          # the knobs a user touches
    GromParams.from_dict({"counterfactual": {"scope": "position"}})    # a drop kind's own knob

Every "auto" or None below is resolved once, by `grom_core.grom.plan.make_plan`, into the typed `Plan` that the
edit's manifest records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grom_core.params import Params, ParamsError

TARGETS = ("suppress", "corrupt")
KEYS = ("auto", "answer", "subject", "subject+answer")
DROPS = ("auto", "specificity", "counterfactual", "sentence")
STRATEGIES = ("sequential", "parallel")


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        quoted = [f"'{o}'" for o in options]
        raise ParamsError(f"{name} must be {', '.join(quoted[:-1])} or {quoted[-1]}, got '{value}'")


@dataclass(frozen=True)
class SpecificityDrops(Params):
    """Specificity drops: each forget position's gold token y is asked to drop by beta * a(y), a(y) in [0, 1] the
    token's forget-specificity (targets.specificity_weights).

    Attributes:
        beta: the drop at specificity 1, in nats of log-odds. None: `margins` times the mean margin of the forget
            answers' specific tokens (each gold token's logit over the best other token's, one forward pass over
            the forget rows, targets.margin_beta) where the keys are the answers, `subject_beta` where they are the
            subjects.
        margins: beta in units of that mean margin, where `beta` is None: the drop asked turns a token leading by
            the mean margin into one trailing its best rival by (margins - 1) margins.
        subject_beta: beta at subject keys where `beta` is None (nats). There the drop is asked of the residual at
            the subject's last token, layers before the answer whose margin could be read, so it is not a multiple
            of that margin.
        word_starts_only: a(y) = 0 for tokens that do not begin a word (targets.word_start_mask).
    """

    beta: float | None = None
    margins: float = 4.5
    subject_beta: float = 40.0
    word_starts_only: bool = False

    def validate(self) -> None:
        if (self.beta is not None and self.beta <= 0) or self.margins <= 0 or self.subject_beta <= 0:
            raise ParamsError("need specificity.beta > 0 (or None), specificity.margins > 0 and "
                              "specificity.subject_beta > 0")


@dataclass(frozen=True)
class CounterfactualDrops(Params):
    """Counterfactual drops (grom_core.counterfactual): each forget token is asked to drop by `gain` times the
    log-odds gap between the model's prediction for the subject and for invented strangers in its place.

    Attributes:
        strangers: invented names per example; their predictions are averaged.
        rename: which words of a subject a stranger replaces: "first" (the first word: the rest of the name, which
            the model completes for the subject it knows, drops too) or "whole" (only what follows the name is
            compared).
        contexts: how many of its subject's other questions each forget answer is also read after (the next ones in
            the data, cyclically, counterfactual.other_questions), each a forget row with its own measured drops.
        scope: "position" (each position lowers its own next token by its own drop) or "subject" (each position
            lowers every token asked to drop anywhere in its subject's rows, by the largest drop asked of it:
            targets.TokenDrops.over_groups). The LM head lowers the bag; the layers below it lower each position's
            own token.
    """

    strangers: int = 4
    rename: str = "first"
    contexts: int = 1
    scope: str = "subject"

    def validate(self) -> None:
        _choice("counterfactual.rename", self.rename, ("first", "whole"))
        _choice("counterfactual.scope", self.scope, ("position", "subject"))
        if self.strangers < 1 or self.contexts < 0:
            raise ParamsError("need counterfactual.strangers >= 1 and counterfactual.contexts >= 0")


@dataclass(frozen=True)
class SentenceDrops(Params):
    """Sentence drops (grom_core.sentence_drops): each forget token is asked to drop by `gain` times the log-odds
    gap between its reading in place and its reading from its own sentence alone.

    Attributes:
        swaps: how many retain questions (those sharing the most words with it) each forget question is swapped for,
            to rate its answer as the same kind of question about something else would; 0 rates it after an empty
            question.
    """

    swaps: int = 16

    def validate(self) -> None:
        if self.swaps < 0:
            raise ParamsError(f"need sentence.swaps >= 0, got {self.swaps}")


@dataclass(frozen=True)
class GromParams(Params):
    """Hyper-parameters of the closed-form edit.

    Attributes:
        layers: layers whose down-projection is edited; () edits the LM head alone (a mask). None: chosen by the plan
            (a band of `band_width` by logit-lens attribution; every layer for sentence drops).
        band_width: contiguous layers in the automatic band.
        edit_lm_head: also edit the LM head (suppression only).
        target: "suppress" (lower the forget tokens' logits) or "corrupt" (move the layer outputs to a random
            direction; multiple-choice benchmarks).
        keys: where forget keys are taken: "answer" (every answer position), "subject" (the last token of each
            example's subject), "subject+answer", or "auto" (the plan: subjects where rows name them and the answers
            are bare objects, else answers).
        drops: how much each forget position is asked to drop: "specificity", "counterfactual", "sentence" (the
            groups below), or "auto" (the plan: counterfactual where rows name subjects at answer keys, sentence
            where they hold texts, else specificity).
        gain: counterfactual and sentence drops: the multiple of the measured gap asked for.
        min_gap: counterfactual and sentence drops: positions whose gap is smaller (nats of log-odds) are no keys.
        protect: suppression by a down-projection: how many retain answer tokens (those whose unembeddings are most
            aligned with the tokens asked to drop) keep their logit-lens logits (targets.protected_tokens).
        retain_budget: the largest rise of the sampled retain answers' mean token NLL (nats per token) the edit may
            cause at answer keys; a larger edit is scaled down to fit (grom_core.grom.scaling). None: no limit.
        budget_examples: retain rows (drawn with `seed`, their first 128 tokens) the budget is read on.
        forget_target: a forget level instead of the full drop: the edit is scaled to the smallest alpha (within
            the budget) at which the forget answers' probability (TOFU's: exp of minus each row's mean token NLL,
            averaged) is at most this. None: the full edit.
        w_retain: weight of the mean squared retain output change against the mean squared forget error (whose
            weight is 1: only the ratio matters).
        relative_ridge: mu as a fraction of the mean retain key energy: mu = relative_ridge * w_retain * tr(G_r) /
            (r n), so one value suits any width and key scale.
        strategy: "sequential" (modules solved lowest first, each from keys read with the edits below applied, for
            its share of the drop still missing) or "parallel" (every module from the original keys, an equal share).
        corrupt_coefficient: c of the corruption target; None: 2x the mean residual norm of the forget positions.
        seed: seed of every random draw (corruption direction, strangers, the budget's sample).
        batch_size, max_length: forward pass batching (examples per batch, tokens per example).
        influence: also compute the exact per-example influence on every module's edit.
        specificity, counterfactual, sentence: the knobs of each drop kind.
    """

    layers: tuple[int, ...] | None = None
    band_width: int = 2
    edit_lm_head: bool = True
    target: str = "suppress"
    keys: str = "auto"
    drops: str = "auto"
    gain: float = 6.0
    min_gap: float = 0.5
    protect: int = 0
    retain_budget: float | None = 0.04
    budget_examples: int = 32
    forget_target: float | None = None
    w_retain: float = 10.0
    relative_ridge: float = 1e-3
    strategy: str = "sequential"
    corrupt_coefficient: float | None = None
    seed: int = 0
    batch_size: int = 16
    max_length: int = 512
    influence: bool = True
    specificity: SpecificityDrops = field(default_factory=SpecificityDrops)
    counterfactual: CounterfactualDrops = field(default_factory=CounterfactualDrops)
    sentence: SentenceDrops = field(default_factory=SentenceDrops)

    def validate(self) -> None:
        _choice("target", self.target, TARGETS)
        _choice("keys", self.keys, KEYS)
        _choice("drops", self.drops, DROPS)
        _choice("strategy", self.strategy, STRATEGIES)
        if self.protect < 0:
            raise ParamsError(f"protect counts tokens: need protect >= 0, got {self.protect}")
        if self.gain <= 0 or self.min_gap < 0:
            raise ParamsError("need gain > 0 and min_gap >= 0")
        if (self.retain_budget is not None and self.retain_budget <= 0) or self.budget_examples < 1:
            raise ParamsError("need retain_budget > 0 (or None) and budget_examples >= 1")
        if self.forget_target is not None and not 0 < self.forget_target < 1:
            raise ParamsError(f"forget_target is a probability: need 0 < forget_target < 1 (or None), got "
                              f"{self.forget_target}")
        if self.w_retain < 0 or self.relative_ridge <= 0:
            raise ParamsError("need w_retain >= 0 and relative_ridge > 0")
        if self.band_width < 1:
            raise ParamsError(f"need band_width >= 1, got {self.band_width}")
        if self.batch_size < 1 or self.max_length < 2:
            raise ParamsError("need batch_size >= 1 and max_length >= 2 (tokens)")
        if self.layers is not None and self.layers and min(self.layers) < 0:
            raise ParamsError(f"layers must be layer indices >= 0, got {list(self.layers)}")
        if self.layers is not None and not self.layers and not (self.edit_lm_head and self.target == "suppress"):
            raise ParamsError("layers [] edits the LM head alone: it needs edit_lm_head=True and target='suppress'; "
                              "name at least one layer otherwise")
        for group in (self.specificity, self.counterfactual, self.sentence):
            group.validate()

    @property
    def suppresses_with_head(self) -> bool:
        """The LM head is among the edited modules."""
        return self.edit_lm_head and self.target == "suppress"
