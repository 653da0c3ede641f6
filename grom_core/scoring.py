"""Per-example answer likelihoods: the forward-only scoring every metric and check builds on."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from grom_core.capture import model_device
from grom_core.data import IGNORE_INDEX, Batch, Example, make_batches


@torch.no_grad()
def answer_nll(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """(N,) mean token NLL (nats) over each example's supervised tokens, float64, in example order."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for batch in batches:
            batch = batch.to(model_device(model))
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            labels = batch.labels[:, 1:]
            mask = labels != IGNORE_INDEX
            token_logp = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
            out.append((-token_logp.sum(1) / mask.sum(1).clamp_min(1)).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out)


def answer_probability(model: nn.Module, tokenizer, examples: Sequence[Example], batch_size: int = 16
                       ) -> torch.Tensor:
    """(N,) TOFU probability of each answer: exp(-mean token NLL) = P(a|q)^(1/|a|)."""
    return torch.exp(-answer_nll(model, make_batches(tokenizer, examples, batch_size)))
