"""ROUGE-L with stemming (`rouge_score`), the scorer TOFU and MUSE both use."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _scorer():
    # imported here: rouge_score pulls in nltk (about 1.5 s), which a command that only parses its options or
    # loads a model should not pay
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


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
