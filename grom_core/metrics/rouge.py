"""ROUGE-L with stemming (`rouge_score`), the scorer TOFU and MUSE both use."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _scorer():
    # imported here: rouge_score pulls in nltk (about 1.5 s), which a command that only parses its options or
    # loads a model should not pay
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def _tokenizer():
    from rouge_score import tokenizers

    return tokenizers.DefaultTokenizer(use_stemmer=True)  # the scorer's own: lowercase, alphanumeric, stemmed


def rouge_l_recall(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """(N,) ROUGE-L recall of each prediction against its reference: LCS / reference length (TOFU)."""
    scorer = _scorer()
    return np.array([scorer.score(ref, pred)["rougeL"].recall for pred, ref in zip(predictions, references,
                                                                                      strict=True)])


def rouge_l_f1(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """(N,) ROUGE-L F1 of each prediction against its reference (MUSE VerbMem, KnowMem)."""
    scorer = _scorer()
    return np.array([scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references,
                                                                                        strict=True)])


def rouge_l_recall_added(predictions: Sequence[str], references: Sequence[str], contexts: Sequence[str]
                         ) -> np.ndarray:
    """(N,) ROUGE-L recall of each prediction against what its reference adds to its context: the reference's
    words (tokenised and stemmed as `rouge_l_recall` does) that the context (the question) does not contain.

    Why: an answer that restates its question ("Gideon Thornbury was born in Tallinn." to "Where was Gideon
    Thornbury born?") keeps most of its recall in a model that never saw the fact, which repeats the name and the
    phrasing; only the added words (here "in", "Tallinn") can give the fact away. A reference that adds nothing
    is scored whole.
    """
    tokenize = _tokenizer().tokenize
    out = []
    for pred, ref, context in zip(predictions, references, contexts, strict=True):
        given = set(tokenize(context))
        words = tokenize(ref)
        added = [w for w in words if w not in given] or words
        out.append(_lcs_length(added, tokenize(pred)) / len(added) if added else 0.0)
    return np.array(out, dtype=np.float64)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists (one row of the DP table at a time)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]
