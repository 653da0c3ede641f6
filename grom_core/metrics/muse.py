"""MUSE metrics (Shi et al. 2024): VerbMem, KnowMem, PrivLeak (Min-K% probability, AUC), Utility Preservation.

- VerbMem: ROUGE-L F1 of the greedy continuation (128 new tokens) of forget-set prompts against the true text.
- KnowMem on the forget set and Utility Preservation (KnowMem on the retain set): few-shot QA, greedy 32 new
  tokens, ROUGE-L F1 against the answer.
- PrivLeak: membership inference with Min-K% probability (score = mean of the lowest 40% token log-probs; higher
  means "member"), AUC of forget texts against holdout texts, compared with the retain model's AUC:
  PrivLeak = ((1 - AUC_unlearned) - (1 - AUC_retain)) / (1 - AUC_retain) * 100. Near 0 is ideal; strongly
  negative: still memorised; strongly positive: over-unlearned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def min_k_score(token_logprobs: torch.Tensor | Sequence[float], k: float = 0.4) -> float:
    """Mean of the lowest ceil(k * T) token log-probabilities of one text (at least one token)."""
    lp = torch.as_tensor(token_logprobs, dtype=torch.float64).flatten()
    if lp.numel() == 0:
        raise ValueError("Min-K% needs at least one scored token")
    count = max(1, math.ceil(k * lp.numel()))
    return float(torch.sort(lp).values[:count].mean())


def auc(member_scores: Sequence[float], nonmember_scores: Sequence[float]) -> float:
    """P(member score > non-member score) + 0.5 P(tie): the ROC AUC, computed exactly by pair counting."""
    m = np.asarray(member_scores, dtype=np.float64)[:, None]
    n = np.asarray(nonmember_scores, dtype=np.float64)[None, :]
    if m.size == 0 or n.size == 0:
        raise ValueError("AUC needs scores on both sides")
    return float(((m > n).sum() + 0.5 * (m == n).sum()) / (m.size * n.size))


def priv_leak(auc_unlearned: float, auc_retain: float) -> float:
    """((1 - AUC_unlearned) - (1 - AUC_retain)) / (1 - AUC_retain) * 100 (see the module docstring)."""
    base = 1 - auc_retain
    if base <= 0:
        return float("inf") if auc_unlearned < auc_retain else 0.0
    return ((1 - auc_unlearned) - base) / base * 100


def few_shot_prompt(shots: Sequence[tuple[str, str]], question: str) -> str:
    """The KnowMem prompt: a few solved question/answer pairs, then the question."""
    parts = [f"Question: {q}\nAnswer: {a}" for q, a in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)


# the metric key of the forget texts' mean VerbMem in an own-data evaluation, which the gates read
FORGET_VERBATIM = "forget_verbatim_rougeL"


def verbatim_rouge(model, tokenizer, texts: Sequence[str], *, prompt_fraction: float = 0.25,
                   max_new_tokens: int = 128, batch_size: int = 16, bos: bool = True) -> np.ndarray:
    """VerbMem of each text (texts of fewer than two tokens are left out: nothing to continue): ROUGE-L F1 of the
    greedy continuation of its first `prompt_fraction` of tokens (at least one) against its next `max_new_tokens`
    tokens. `bos`: prompts start with the tokenizer's BOS, as in training."""
    from grom_core.generation import greedy_generate
    from grom_core.metrics.rouge import rouge_l_f1

    prompts, truths = [], []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < 2:
            continue
        cut = max(1, int(len(ids) * prompt_fraction))
        prompts.append(tokenizer.decode(ids[:cut]))
        truths.append(tokenizer.decode(ids[cut:cut + max_new_tokens]))
    if not prompts:
        return np.zeros(0)
    continuations = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                    desc="VerbMem", bos=bos)
    return rouge_l_f1(continuations, truths)

