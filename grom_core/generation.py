"""Batched greedy generation with left padding, stopping each sequence at its end-of-sequence token."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from grom_core.capture import model_device
from grom_core.data import bos_prefix, pad_token_id
from grom_core.modes import evaluating
from grom_core.progress import progress_bar

log = logging.getLogger(__name__)


@torch.no_grad()
def greedy_generate(model: nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 200,
                    batch_size: int = 32, desc: str = "generate", bos: bool = True) -> list[str]:
    """Greedy continuations of `prompts` (decoded, special tokens dropped), in order.

    Prompts are encoded with the tokenizer's BOS (as in training) and left-padded so all continuations start at the
    same column; generation stops at EOS or after `max_new_tokens` tokens.
    """
    device = model_device(model)
    pad = pad_token_id(tokenizer)
    bos = bos_prefix(tokenizer) if bos else []  # a chat-templated prompt opens the sequence itself
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    outputs: list[str] = []
    with evaluating(model), progress_bar(len(prompts), desc) as advance:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            encoded = [bos + tokenizer.encode(p, add_special_tokens=False) for p in chunk]
            width = max(len(e) for e in encoded)
            new_tokens = max_new_tokens if limit is None else max(1, min(max_new_tokens, limit - width))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, e in enumerate(encoded):
                ids[row, width - len(e):] = torch.tensor(e)
                mask[row, width - len(e):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
            for row in out[:, width:].tolist():
                if tokenizer.eos_token_id in row:
                    row = row[:row.index(tokenizer.eos_token_id)]
                outputs.append(tokenizer.decode(row, skip_special_tokens=True).strip())
            advance(len(chunk))
    log.debug("%s: %d prompts", desc, len(prompts))
    return outputs
