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
    """Per example: the log-probabilities (nats) of its supervised tokens, in order, and whether each token is the
    model's top choice there (teacher forced: given the true tokens before it)."""

    logprobs: list[torch.Tensor]
    top_is_gold: list[torch.Tensor] | None = None

    @property
    def mean_nll(self) -> torch.Tensor:
        """(N,) mean token NLL, float64."""
        return torch.stack([-lp.mean() if lp.numel() else torch.tensor(float("nan"), dtype=torch.float64)
                            for lp in self.logprobs])

    @property
    def sum_logprob(self) -> torch.Tensor:
        """(N,) total log-probability of each supervised continuation, float64."""
        return torch.stack([lp.sum() for lp in self.logprobs])


def gold_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target], float64, for logits (..., vocab) and integer targets (...,).

    The exponentials of the other tokens are summed in the logits' own precision (at least float32), the rest is
    float64: log p = g - log1p(expm1(g) + rest), g the target's logit minus the max, rest the others' sum. A float64
    copy of the logits would cost as much as SmolLM2's forward pass (49,152 tokens a position); summing the others
    apart keeps 1 - p to float32's relative precision even for near-certain tokens, whose log-odds the drops read.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    index = targets.unsqueeze(-1)
    top = logits.amax(dim=-1, keepdim=True)
    others = (logits - top).exp_().scatter_(-1, index, 0.0).sum(dim=-1).double()
    gold = (logits.gather(-1, index) - top).squeeze(-1).double()
    return gold - torch.log1p(torch.expm1(gold) + others)


SHARED_PREFIX_MIN = 16  # tokens: a batch whose rows open with this many identical tokens reads them once


def shared_prefix_length(batch: Batch) -> int:
    """How many leading tokens every row of `batch` shares, unsupervised and unpadded (a chat template's system
    prompt), up to the token before the first supervised one: what `batch_logits` reads once for the batch."""
    ids, mask = batch.input_ids, batch.attention_mask
    same = (ids == ids[:1]).all(dim=0) & (mask == 1).all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    supervised = (batch.labels != IGNORE_INDEX).any(dim=0).nonzero()
    first = int(supervised[0]) if len(supervised) else ids.shape[1]
    return max(0, min(common, first - 1))


def batch_logits(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """(logits of positions start.., start): the model's logits over a batch, the rows' shared prefix (at least
    SHARED_PREFIX_MIN tokens, `shared_prefix_length`) computed once and its key-value cache repeated over the rows.
    The same values as one full pass up to float rounding; chat-formatted evaluation sets halve their cost."""
    start = shared_prefix_length(batch) if len(batch.input_ids) > 1 else 0
    if start < SHARED_PREFIX_MIN:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits, 0
    cache = model(input_ids=batch.input_ids[:1, :start], use_cache=True).cache
    cache.batch_repeat_interleave(len(batch.input_ids))
    logits = model(input_ids=batch.input_ids[:, start:], attention_mask=batch.attention_mask, cache=cache,
                   use_cache=True).logits
    return logits, start


@torch.no_grad()
def token_logprobs(model: nn.Module, batches: Sequence[Batch], desc: str = "score") -> TokenScores:
    """Log-probabilities of every supervised token of every example (float64, see `gold_logprobs`), in example
    order."""
    out: list[torch.Tensor] = []
    top: list[torch.Tensor] = []
    with evaluating(model):
        for i, batch in enumerate(batches, start=1):
            batch = batch.to(model_device(model))
            logits, start = batch_logits(model, batch)
            labels = batch.labels[:, start + 1:]
            mask = labels != IGNORE_INDEX
            supervised, gold = logits[:, :-1][mask], labels[mask]  # supervised positions, row-major
            counts = mask.sum(dim=1).tolist()
            out.extend(gold_logprobs(supervised, gold).cpu().split(counts))
            top.extend((supervised.argmax(dim=-1) == gold).cpu().split(counts))
            if i == len(batches) or i % max(1, len(batches) // 5) == 0:
                log.debug("%s: batch %d/%d", desc, i, len(batches))
    return TokenScores(out, top)


@torch.no_grad()
def gold_margins(model: nn.Module, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """At every supervised position, in batch order: the gold next token (s,) long and its margin (s,) float64,
    its logit minus the largest logit of any other token (nats; negative where the model prefers another token).
    The margin is what a logit drop must exceed to take the token off the top."""
    tokens, margins = [], []
    with evaluating(model):
        for batch in batches:
            batch = batch.to(model_device(model))
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            labels = batch.labels[:, 1:]
            mask = labels != IGNORE_INDEX
            picked, gold = logits[:, :-1][mask], labels[mask]
            own = picked.gather(-1, gold[:, None]).squeeze(-1)
            others = picked.scatter(-1, gold[:, None], float("-inf")).amax(dim=-1)
            tokens.append(gold.cpu())
            margins.append((own.double() - others.double()).cpu())
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    return torch.cat(tokens), torch.cat(margins)


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
