"""Counterfactual drops: how much lower the model would rate each answer token if it had never heard of the subject.

A forget example about subject S ("Aurelio Marlowe") is rewritten with the first word of S replaced by other names
("Soren Marlowe", ...) that make an entity the data never mentions: what the model predicts there is what it says of
someone it never knew, the level a model trained without the forget data would give. The names are the first words
of the data's other multi-word subjects (a plausible name the model has read, in a combination it has not), then
invented ones (a one-word subject, "France", gets invented names only: another country is one it knows). With
rename="whole" the further words of S are replaced too, by invented names ("Soren Velkaro").

Which tokens get a gap depends on that choice. With the first word replaced, the rest of the name ("Marlowe" after
"Aurelio" in the answer) is aligned too, and a model that learnt the name rates it far above the stranger's (a tiny
model does not copy a name it never read from the question): the drops also lower the subject's own surname, and
generations lose it. With the whole name replaced, only what follows the name is compared: the facts and the
template words.

At each supervised position t whose next token y_t is also found, aligned, in a rewrite, the closed form is asked
for the log-odds gap

    drop_t = gain * max(0, logit p(y_t | x_<t) - logit qbar_t),   qbar_t = mean_j p_j(y_t | x'_j, aligned),

with logit(p) = log p - log(1 - p): the logit drop that takes p to qbar exactly (the other tokens keep their
ratios). Template words, equally likely for any subject, get a gap near 0; the tokens that carry what the model
knows about S get the gap; the replaced words are not aligned and get none.
`gain` > 1 asks for more than the gap at the trained phrasing so that other phrasings of the same fact, whose
positions the edit never sees, move too.

Tokens are aligned with difflib's matching blocks on the token ids, so a replacement name may have another length.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.capture import model_device, supervised_mask
from grom_core.data import IGNORE_INDEX, Batch, Example, PromptFormat, make_batches
from grom_core.errors import DataError
from grom_core.modes import evaluating
from grom_core.scoring import gold_logprobs

SYLLABLES = ("ka", "lo", "vi", "ren", "dor", "mi", "sa", "tul", "qua", "zen", "bri", "fel", "orn", "ula", "thes",
             "mar", "ivo", "pel", "cas", "nim")


def invented_names(k: int, seed: int, avoid: str) -> list[str]:
    """`k` distinct invented given names (2-3 syllables, capitalised), none of which occurs in `avoid` (lower
    case), seeded."""
    rng = random.Random(seed)
    names: list[str] = []
    if k <= 0:
        return names
    for _ in range(1000 * k):
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in names and name.lower() not in avoid:
            names.append(name)
        if len(names) == k:
            return names
    raise DataError(f"could not invent {k} names absent from the data; lower `counterfactuals`")


def replacement_names(subject: str, k: int, seed: int, pool: Sequence[str], avoid: str) -> list[str]:
    """`k` first words for `subject`: from `pool` (other subjects' first words) where "<word> <rest>" occurs
    nowhere in `avoid` (lower case), seeded; invented names for the rest, and for a one-word subject."""
    first, _, rest = subject.partition(" ")
    chosen: list[str] = []
    if rest:
        candidates = sorted({w for w in pool if w != first and f"{w} {rest}".lower() not in avoid})
        random.Random(f"{seed}:{subject}").shuffle(candidates)
        chosen = candidates[:k]
    return chosen + invented_names(k - len(chosen), seed, avoid)


def strangers(subject: str, k: int, seed: int, pool: Sequence[str], avoid: str, rename: str = "first") -> list[str]:
    """`k` subjects the data never mentions, to stand in for `subject`: its first word replaced
    (`replacement_names`), and with rename="whole" every further word too, by invented names ("Corvin Velkaro"
    for "Aurelio Marlowe"), so that no token of the subject is left for the model to complete."""
    firsts = replacement_names(subject, k, seed, pool, avoid)
    rest = subject.split(" ")[1:]
    if rename == "first" or not rest:
        return [" ".join([first, *rest]) for first in firsts]
    others = invented_names(k * len(rest), seed + 1, avoid)
    return [" ".join([first, *others[n * len(rest):(n + 1) * len(rest)]]) for n, first in enumerate(firsts)]


def rewrite(example: Example, stranger: str) -> Example:
    """The example with its subject replaced by `stranger` everywhere (question and answer)."""
    subject = example.subject
    if subject is None:
        raise DataError("a counterfactual needs the example's subject")
    return Example(question=example.question.replace(subject, stranger),
                   answer=example.answer.replace(subject, stranger), subject=stranger)


def other_questions(examples: Sequence[Example], contexts: int) -> tuple[list[Example], list[int]]:
    """Each answer of a subject that has several rows, read again after `contexts` of the subject's other questions
    (the next ones, cyclically): ([the new examples], [the index in `examples` of the answer each one carries]).

    The answer's facts then also stand in contexts the model was not trained on, and a subject's bag is asked of
    those keys too (GromParams.contexts; docs/minitofu.md). Examples without a subject, and subjects with one row,
    add nothing."""
    if contexts < 0:
        raise DataError(f"contexts must be >= 0, got {contexts}")
    by_subject: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        if ex.subject is not None and ex.question is not None:
            by_subject.setdefault(ex.subject, []).append(i)
    extra, sources = [], []
    for subject, rows in by_subject.items():
        for shift in range(1, min(contexts, len(rows) - 1) + 1):
            for n, i in enumerate(rows):
                question = examples[rows[(n + shift) % len(rows)]].question
                extra.append(Example(question=question, answer=examples[i].answer, subject=subject))
                sources.append(i)
    return extra, sources


def aligned(original: Sequence[int], rewritten: Sequence[int]) -> dict[int, int]:
    """Index map original -> rewritten for the tokens in matching blocks (the text around the replaced subject)."""
    out: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, list(original), list(rewritten), autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            out[block.a + i] = block.b + i
    return out


@torch.no_grad()
def next_token_logprobs(model: nn.Module, batches: Sequence[Batch]) -> dict[int, tuple[list[int], torch.Tensor]]:
    """example id -> (its T token ids, (T - 1,) float64 log p(x_{t+1} | x_<=t) of each real token after the
    first)."""
    device = model_device(model)
    out: dict[int, tuple[list[int], torch.Tensor]] = {}
    with evaluating(model):
        for batch in batches:
            logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)).logits
            lp = gold_logprobs(logits[:, :-1], batch.input_ids[:, 1:].to(device)).cpu()
            lengths = batch.attention_mask.sum(dim=1).tolist()
            for row, example_id in enumerate(batch.example_ids.tolist()):
                out[example_id] = (batch.input_ids[row, :lengths[row]].tolist(), lp[row, :lengths[row] - 1])
    return out


def logit(logp: torch.Tensor) -> torch.Tensor:
    """log p - log(1 - p) from log p, exact near p = 1."""
    logp = logp.clamp(max=-1e-12)
    return logp - torch.log(-torch.expm1(logp))


@dataclass
class CounterfactualDrops:
    """Per forget position (capture order of `batches`): drops (s,) float64 (gain applied), and the batches with
    only the positions whose gap reaches `min_gap` left supervised."""

    drops: torch.Tensor
    batches: list[Batch]
    positions_before: int
    rewrites: int  # rows read for the comparison (stranger rewrites, or cut-down sentences)


def counterfactual_drops(model: nn.Module, tokenizer, examples: Sequence[Example], batches: Sequence[Batch],
                         fmt: str | PromptFormat, *, k: int, gain: float, min_gap: float, seed: int,
                         batch_size: int, max_length: int, avoid: str, pool: Sequence[str] = (),
                         rename: str = "first") -> CounterfactualDrops:
    """The drops of the module docstring for `examples` (batched as `batches`, in order, by `make_batches`).

    Examples without a subject keep every supervised position with drop 0 there: nothing is asked of them (give
    subjects, or use the specificity drops). `avoid`: the data's text, which no rewritten subject may occur in;
    `pool`: the first words of the data's subjects (see `replacement_names`); `rename`: see `strangers`.
    """
    avoid = avoid.lower()
    own = next_token_logprobs(model, batches)
    named = [i for i, ex in enumerate(examples) if ex.subject is not None]
    pool = sorted(set(pool))
    by_subject = {subject: strangers(subject, k, seed, pool, avoid, rename)
                  for subject in dict.fromkeys(examples[i].subject for i in named)}
    slot = {i: n * k for n, i in enumerate(named)}  # where example i's rewrites start in `theirs`
    rewritten = [rewrite(examples[i], stranger) for i in named for stranger in by_subject[examples[i].subject]]
    theirs = (next_token_logprobs(model, make_batches(tokenizer, rewritten, batch_size, max_length, fmt=fmt))
              if rewritten else {})
    def gaps_of(example_id: int, positions: list[int]) -> torch.Tensor:
        if examples[example_id].subject is None:
            return torch.zeros(len(positions), dtype=torch.float64)
        return _gaps(own[example_id], [theirs[slot[example_id] + j] for j in range(k)], positions)

    return drops_from_gaps(batches, gaps_of, gain=gain, min_gap=min_gap, rewrites=len(rewritten),
                           nothing=f"no forget position is rated above what the model says of an unknown subject "
                                   f"by {min_gap:.3g} nats of log-odds or more: the model does not seem to know "
                                   f"these facts (or lower min_gap)")


def drops_from_gaps(batches: Sequence[Batch], gaps_of: Callable[[int, list[int]], torch.Tensor], *, gain: float,
                    min_gap: float, rewrites: int, nothing: str) -> CounterfactualDrops:
    """`gain` x the gaps (`gaps_of(example id, supervised positions)` -> (len(positions),) float64) of every
    forget position in capture order, keeping only positions whose gap reaches `min_gap` (the others are
    unsupervised in the returned batches). Raises DataError(`nothing`) when no position is kept."""
    drops, kept_batches, before = [], [], 0
    for batch in batches:
        labels = batch.labels.clone()
        mask = supervised_mask(batch)
        for row, example_id in enumerate(batch.example_ids.tolist()):
            positions = mask[row].nonzero().flatten().tolist()
            before += len(positions)
            for t, gap in zip(positions, gaps_of(example_id, positions).tolist(), strict=True):
                if gap < min_gap:
                    labels[row, t + 1] = IGNORE_INDEX
                else:
                    drops.append(gain * gap)
        kept_batches.append(Batch(batch.input_ids, batch.attention_mask, labels, batch.example_ids))
    if not drops:
        raise DataError(nothing)
    return CounterfactualDrops(drops=torch.tensor(drops, dtype=torch.float64), batches=kept_batches,
                               positions_before=before, rewrites=rewrites)


def _gaps(own: tuple[list[int], torch.Tensor], rewrites: Sequence[tuple[list[int], torch.Tensor]],
          positions: list[int]) -> torch.Tensor:
    """(len(positions),) max(0, logit p - logit qbar) of one example from its (ids, log-probs) and its rewrites';
    0 where no rewrite aligns."""
    ids, own_lp = own
    probs = torch.zeros(len(positions), dtype=torch.float64)
    counts = torch.zeros(len(positions), dtype=torch.float64)
    for other, lp in rewrites:
        where = aligned(ids, other)
        for n, t in enumerate(positions):
            # the next token must be matched; the prediction is read one position before its match
            b = where.get(t + 1)
            if b is not None and b >= 1:
                probs[n] += float(lp[b - 1].exp())
                counts[n] += 1
    gaps = torch.zeros(len(positions), dtype=torch.float64)
    seen = counts > 0
    if seen.any():
        qbar = (probs[seen] / counts[seen]).clamp_min(1e-300).log()
        p = own_lp[torch.tensor(positions)[seen]]
        gaps[seen] = (logit(p) - logit(qbar)).clamp_min(0)
    return gaps
