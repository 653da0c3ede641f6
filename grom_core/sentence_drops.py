"""Sentence drops: how much lower the model would rate each token if it had read only the token's own sentence.

Forget data that names no subject (passages a model may have memorised word for word, and questions about them)
gives the stranger rewrites of grom_core.counterfactual nothing to rename. What a model that never read such a
passage predicts at a position is, roughly, what the sentence so far makes likely: the template's and the
grammar's words. What it predicts beyond that, from the passage before, is what reading the passage added: which
sentence comes next, the number a report gave, the person a question is about. So every token of the forget rows
is read again in cut-down rows that keep only its own sentence:

    text rows:  BOS + the sentence up to the token (the passage before it cut away);
    QA rows:    BOS + the prompt of another question + the answer's sentence up to the token, once for each of
                the `swaps` retain questions that share the most words with the forget question (the same kind of
                question about something else), or with an empty question where the retain data asks none.

A QA row's rating is the highest of its swapped rows': a word that some question of the same template makes as
likely ("a" after "What did ... carry to ...?") is the template's, not the fact's, and gets no gap; lowering it
would take the retain answers of that template with it. An empty question would give such words a large gap,
since without a question they are unlikely. A retain question that is the forget question itself is not a swap.

A sentence ends after a token whose text ends in ".", "!" or "?", or holds a line break. The drop asked at the
position is, as for the counterfactual drops,

    drop_t = gain * max(0, logit p(y_t | x_<=t) - logit max_j q_j(y_t | the j-th cut-down context)),

and positions with a gap under `min_gap` are not forget keys. One forward pass per sentence and swap gives every
one of its tokens' cut-down ratings (causal attention: the prefix of a sentence is the cut-down context of its
next token).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from grom_core.capture import supervised_mask
from grom_core.counterfactual import CounterfactualDrops, drops_from_gaps, logit, next_token_logprobs
from grom_core.data import (
    IGNORE_INDEX,
    Batch,
    EncodedExample,
    Example,
    PromptFormat,
    collate,
    pad_token_id,
    prompt_format,
)

SENTENCE_ENDS = (".", "!", "?")


def sentence_ender(tokenizer) -> Callable[[int], bool]:
    """token id -> whether a sentence ends after it (its text ends in . ! ? or holds a line break); cached per id."""
    seen: dict[int, bool] = {}

    def ends(token: int) -> bool:
        if token not in seen:
            text = tokenizer.decode([token])
            seen[token] = "\n" in text or text.rstrip().endswith(SENTENCE_ENDS)
        return seen[token]
    return ends


def sentence_spans(ids: Sequence[int], start: int, ends: Callable[[int], bool]) -> Iterator[tuple[int, int]]:
    """Half-open [a, b) spans that cover ids[start:], a new one after every token that `ends` a sentence."""
    a = start
    for i in range(start, len(ids)):
        if ends(ids[i]) or i == len(ids) - 1:
            yield a, i + 1
            a = i + 1


class QuestionPool:
    """Questions to swap a forget question for, each distinct one once, with their lower-case word sets."""

    def __init__(self, questions: Sequence[str]) -> None:
        self.questions = list(dict.fromkeys(questions))
        self.words = [_words(q) for q in self.questions]

    def nearest(self, question: str, k: int) -> list[str]:
        """The `k` questions that share the most words with `question` (Jaccard index of the word sets; ties in
        pool order), `question` itself left out; [""] (the empty question) when none is left."""
        words = _words(question)
        scored = sorted((-len(words & other) / max(1, len(words | other)), n) for n, other in enumerate(self.words)
                        if self.questions[n] != question)
        return [self.questions[n] for _, n in scored[:k]] or [""]


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def sentence_drops(model: nn.Module, tokenizer, examples: Sequence[Example], batches: Sequence[Batch],
                   fmt: str | PromptFormat, *, gain: float, min_gap: float, batch_size: int,
                   questions: Sequence[str] = (), swaps: int = 16, max_length: int | None = None
                   ) -> CounterfactualDrops:
    """The drops of the module docstring for `examples` (batched as `batches`, in order, by `make_batches`): (s,)
    float64 per kept forget position in capture order, and the batches with only those positions supervised.
    `questions`: the retain questions a QA row's question is swapped for (the `swaps` nearest); a swap whose row
    would be longer than `max_length` tokens is left out (the empty question stands in if none is left)."""
    fmt = prompt_format(fmt)
    own = next_token_logprobs(model, batches)
    ends = sentence_ender(tokenizer)
    pool = QuestionPool(questions)
    prompts: dict[str, list[int]] = {}  # question -> the prefix and prompt that a swapped row starts with

    def prompt_ids(question: str) -> list[int]:
        if question not in prompts:
            prompts[question] = fmt.prefix(tokenizer) + tokenizer.encode(fmt.prompt(tokenizer, question),
                                                                         add_special_tokens=False)
        return prompts[question]

    cut: list[EncodedExample] = []
    where: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (example id, token index) -> [(cut row, index)]
    for batch in batches:
        mask = supervised_mask(batch)
        for row, example_id in enumerate(batch.example_ids.tolist()):
            ids = own[example_id][0]
            first = int(mask[row].nonzero()[0]) + 1  # the first supervised token: the text's or the answer's
            example, spans = examples[example_id], list(sentence_spans(ids, first, ends))
            if example.text is not None:
                prefixes = [fmt.prefix(tokenizer)]
            else:
                longest = max(b - a for a, b in spans)
                prefixes = [prompt for prompt in map(prompt_ids, pool.nearest(example.question, swaps))
                            if max_length is None or len(prompt) + longest <= max_length] or [prompt_ids("")]
            for a, b in spans:
                for prefix in prefixes:
                    for i in range(a, b):
                        where.setdefault((example_id, i), []).append((len(cut), len(prefix) + i - a))
                    cut.append(EncodedExample(prefix + ids[a:b], [IGNORE_INDEX] * (len(prefix) + b - a)))
    cut_batches = [collate(cut[s:s + batch_size], range(s, min(s + batch_size, len(cut))), pad_token_id(tokenizer))
                   for s in range(0, len(cut), batch_size)]
    theirs = next_token_logprobs(model, cut_batches)

    def gaps_of(example_id: int, positions: list[int]) -> torch.Tensor:
        p = own[example_id][1][positions]
        # without a BOS token a text sentence's first token has no cut-down rating: its gap is 0
        q = torch.stack([max((theirs[r][1][i - 1] for r, i in where[example_id, t + 1] if i > 0), default=p[n])
                         for n, t in enumerate(positions)])
        return (logit(p) - logit(q)).clamp_min(0)

    return drops_from_gaps(batches, gaps_of, gain=gain, min_gap=min_gap, rewrites=len(cut),
                           nothing=f"no forget token is rated above what its own sentence makes likely by "
                                   f"{min_gap:.3g} nats of log-odds or more: the model does not seem to have "
                                   f"memorised these rows (or lower min_gap)")
