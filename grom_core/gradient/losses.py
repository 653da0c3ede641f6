"""Unlearning losses as small pure functions of per-sequence answer log-probabilities.

Inputs are per-sequence sums of answer-token log-probabilities (B,) and answer lengths (B,), as `answer_logprobs`
returns them; every loss returns a scalar to *minimise*. Published defaults: NPO beta 0.1 (Zhang et al. 2024),
SimNPO beta 4.5 and delta 0 (Fan et al. 2024), DPO beta 0.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grom_core.data import IGNORE_INDEX


def answer_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) sum of log p(answer token) over supervised tokens, and (B,) their counts. logits (B, T, V)."""
    shifted, target = logits[:, :-1].float(), labels[:, 1:]
    mask = target != IGNORE_INDEX
    logp = torch.log_softmax(shifted, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(dim=1), mask.sum(dim=1)


def nll(logp_sum: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean token NLL over all answer tokens of the batch (the usual causal-LM loss)."""
    return -logp_sum.sum() / lengths.sum().clamp_min(1)


def gradient_ascent(logp_sum: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """GA: minimise -NLL(forget), i.e. push the forget answers' likelihood down without bound."""
    return -nll(logp_sum, lengths)


def npo(logp_sum: torch.Tensor, ref_logp_sum: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """NPO: -(2/beta) mean log sigmoid(-beta (log p_theta(y|x) - log p_ref(y|x))), sequence log-probs."""
    return -(2.0 / beta) * F.logsigmoid(-beta * (logp_sum - ref_logp_sum)).mean()


def simnpo(logp_sum: torch.Tensor, lengths: torch.Tensor, beta: float = 4.5, delta: float = 0.0) -> torch.Tensor:
    """SimNPO: -(2/beta) mean log sigmoid(-(beta/|y|) log p_theta(y|x) - delta); no reference model."""
    return -(2.0 / beta) * F.logsigmoid(-(beta / lengths.clamp_min(1)) * logp_sum - delta).mean()


def dpo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        beta: float = 0.1) -> torch.Tensor:
    """DPO: -mean log sigmoid(beta ((log p(chosen) - log p_ref(chosen)) - (log p(rejected) - log p_ref(rejected))))."""
    return -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()


def kl_to_reference(logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over supervised positions of KL(p_ref || p_theta) of the next-token distributions (GradDiff's KL)."""
    mask = labels[:, 1:] != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ref = torch.log_softmax(ref_logits[:, :-1].float(), dim=-1)
    kl = (ref.exp() * (ref - logp)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp_min(1)
