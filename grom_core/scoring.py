"""Per-example likelihoods of answers or continuations: the forward-only scoring every metric builds on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.capture import model_device
from grom_core.data import (
    IGNORE_INDEX,
    Batch,
    EncodedExample,
    Example,
    bos_prefix,
    collate,
    make_batches,
    pad_token_id,
)
from grom_core.modes import evaluating

log = logging.getLogger(__name__)


@dataclass
class TokenScores:
    """Per example: the log-probabilities (nats) of its supervised tokens, in order."""

    logprobs: list[torch.Tensor]

    @property
    def mean_nll(self) -> torch.Tensor:
        """(N,) mean token NLL, float64."""
        return torch.stack([-lp.mean() if lp.numel() else torch.tensor(float("nan"), dtype=torch.float64)
                            for lp in self.logprobs])

    @property
    def sum_logprob(self) -> torch.Tensor:
        """(N,) total log-probability of each supervised continuation, float64."""
        return torch.stack([lp.sum() for lp in self.logprobs])


@torch.no_grad()
def token_logprobs(model: nn.Module, batches: Sequence[Batch], desc: str = "score") -> TokenScores:
    """Log-probabilities of every supervised token of every example (float64 softmax), in example order."""
    out: list[torch.Tensor] = []
    with evaluating(model):
        for i, batch in enumerate(batches, start=1):
            batch = batch.to(model_device(model))
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            labels = batch.labels[:, 1:]
            mask = labels != IGNORE_INDEX
            picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out.extend(picked[row][mask[row]].cpu() for row in range(picked.shape[0]))
            if i == len(batches) or i % max(1, len(batches) // 5) == 0:
                log.info("%s: batch %d/%d", desc, i, len(batches))
    return TokenScores(out)


def answer_nll(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """(N,) mean token NLL (nats) over each example's supervised tokens, float64, in example order."""
    return token_logprobs(model, batches).mean_nll


def answer_probability(model: nn.Module, tokenizer, examples: Sequence[Example], batch_size: int = 16,
                       fmt: str = "qa") -> torch.Tensor:
    """(N,) TOFU probability of each answer in prompt format `fmt`: exp(-mean token NLL) = P(a|q)^(1/|a|)."""
    return torch.exp(-answer_nll(model, make_batches(tokenizer, examples, batch_size, fmt=fmt)))


def continuation_scores(model: nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], batch_size: int = 16,
                        max_length: int = 512, desc: str = "score") -> TokenScores:
    """Token log-probs of each continuation given its prompt, both taken verbatim (no QA template).

    The prompt and continuation are encoded separately, so the boundary is exact; no EOS is appended.
    """
    bos = bos_prefix(tokenizer)
    encoded = []
    for prompt, continuation in pairs:
        p = bos + tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(continuation, add_special_tokens=False)
        ids = (p + c)[-max_length:]  # keep the continuation when too long: it is what is scored
        labels = ([IGNORE_INDEX] * len(p) + c)[-max_length:]
        encoded.append(EncodedExample(ids, labels))
    pad = pad_token_id(tokenizer)
    batches = [collate(encoded[s:s + batch_size], range(s, min(s + batch_size, len(encoded))), pad)
               for s in range(0, len(encoded), batch_size)]
    return token_logprobs(model, batches, desc=desc)
