"""What the locate-then-edit editors share: facts with their subject token, the keys and values there, the value
vector v* each fact's memory is rewritten to, and the covariance of the keys that must keep their outputs.

ROME, MEMIT and AlphaEdit read an MLP down-projection W (out, in) as a key-value memory: the key k at a fact's
subject token is mapped to a value W k that later layers read the fact from. An editor picks a new value
v* = W k + delta per fact (delta optimised by a few gradient steps on that one vector, the model frozen) and changes
W so that the keys map to the new values while the retain data's keys keep theirs.

For unlearning, delta makes the model give up the fact: the answer's log-probability is pushed below
`forget_logprob` (we chose the low-probability-answer variant over an "I don't know" target, which would teach a
new string; the loss is the unlikelihood of its tokens, see `_unlikelihood`), with ROME's KL term keeping the
model's next-token distribution after "{subject} is a" and ROME's norm penalty and clamp on delta. ROME also
averages keys over random prefixes; here a fact's key is taken on its own prompt only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import ModelAdapter
from grom_core.capture import KeyCapture, model_device
from grom_core.data import (
    IGNORE_INDEX,
    Batch,
    EncodedExample,
    Example,
    PromptFormat,
    as_examples,
    bos_prefix,
    collate,
    encode,
    pad_token_id,
    prompt_format,
    subject_position,
)
from grom_core.errors import DataError
from grom_core.grom.params import GromParams
from grom_core.grom.plan import retain_rows
from grom_core.modes import evaluating
from grom_core.params import Params, ParamsError
from grom_core.statistics import GramStats, retain_statistics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EditorParams(Params):
    """Knobs every editor shares (ROME's and MEMIT's published values where they apply).

    Attributes:
        layers: the edited layers (ROME: one; MEMIT and AlphaEdit: a band, v* is found at the last); None picks
            them by depth as the papers did on GPT-J (see `default_layers`).
        forget_logprob: the answer's log-probability (nats, all its tokens) v* pushes the fact below.
        v_steps, v_lr: Adam steps and step size of the delta optimisation.
        v_weight_decay: weight of ||delta|| / ||v||^2 in its loss (v: the original value; ROME's form).
        clamp_norm_factor: ||delta|| is kept below this x ||v||.
        kl_factor: weight of KL(original || edited) after "{subject} is a" (facts with a subject only).
        batch_size, max_length: facts per forward pass, tokens per fact (and per retain example).
    """

    layers: tuple[int, ...] | None = None
    forget_logprob: float = -6.0
    v_steps: int = 25
    v_lr: float = 0.5
    v_weight_decay: float = 0.5
    clamp_norm_factor: float = 4.0
    kl_factor: float = 0.0625
    batch_size: int = 16
    max_length: int = 512

    def validate(self) -> None:
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ParamsError(f"layers must be a non-empty list of layer indices >= 0, got {list(self.layers)}")
        if self.v_steps < 1 or self.v_lr <= 0 or self.v_weight_decay < 0 or self.clamp_norm_factor <= 0:
            raise ParamsError("need v_steps >= 1, v_lr > 0, v_weight_decay >= 0 and clamp_norm_factor > 0")
        if self.kl_factor < 0 or self.forget_logprob >= 0:
            raise ParamsError("need kl_factor >= 0 and forget_logprob < 0 (nats per answer token)")
        if self.batch_size < 1 or self.max_length < 2:
            raise ParamsError("need batch_size >= 1 and max_length >= 2 (tokens)")


def default_layers(num_layers: int, first: float, last: float) -> list[int]:
    """The layers between fractions `first` and `last` of the depth (ROME edited GPT-J's layer 5 of 28, 0.18;
    MEMIT its layers 3-8, 0.11-0.29); at least one layer."""
    lo = min(num_layers - 1, round(first * (num_layers - 1)))
    hi = max(lo, min(num_layers - 1, round(last * (num_layers - 1))))
    return list(range(lo, hi + 1))


def chosen_layers(params: EditorParams, adapter: ModelAdapter, first: float, last: float) -> list[int]:
    if params.layers is None:
        return default_layers(adapter.num_layers, first, last)
    layers = sorted(set(params.layers))
    bad = [layer for layer in layers if layer >= adapter.num_layers]
    if bad:
        raise DataError(f"layers {bad} do not exist; the model has layers 0..{adapter.num_layers - 1}")
    return layers


@dataclass
class Facts:
    """The forget facts encoded once. batches: the fact prompts with their answers supervised; masks (B, T) bool:
    each row's subject token; essence / essence_masks: "{subject} is a" with the same token (None without
    subjects)."""

    examples: list[Example]
    batches: list[Batch]
    masks: list[torch.Tensor]
    essence: list[Batch] | None
    essence_masks: list[torch.Tensor] | None


def _batched(encoded: Sequence[EncodedExample], positions: Sequence[int], size: int, pad: int
             ) -> tuple[list[Batch], list[torch.Tensor]]:
    batches, masks = [], []
    for start in range(0, len(encoded), size):
        chunk = range(start, min(start + size, len(encoded)))
        batch = collate([encoded[i] for i in chunk], list(chunk), pad)
        mask = torch.zeros_like(batch.input_ids, dtype=torch.bool)
        mask[torch.arange(len(chunk)), torch.tensor([positions[i] for i in chunk])] = True
        batches.append(batch)
        masks.append(mask)
    return batches, masks


def encode_facts(tokenizer, forget, params: EditorParams, fmt: str | PromptFormat) -> Facts:
    fmt = prompt_format(fmt)
    examples = as_examples(forget)
    if any(ex.question is None for ex in examples):
        raise DataError("the editors rewrite facts: every forget row must be a question/answer pair (optionally "
                        "with its subject); texts have no fact to locate")
    encoded = [encode(tokenizer, ex, params.max_length, fmt) for ex in examples]
    positions = [subject_position(tokenizer, ex, fmt) for ex in examples]
    if any(p >= len(e.input_ids) for p, e in zip(positions, encoded, strict=True)):
        raise DataError(f"a fact's prompt is cut by max_length={params.max_length}; raise it")
    pad = pad_token_id(tokenizer)
    batches, masks = _batched(encoded, positions, params.batch_size, pad)
    essence = essence_masks = None
    if all(ex.subject is not None for ex in examples):
        bos = bos_prefix(tokenizer)
        ids = [bos + tokenizer.encode(f"{ex.subject} is a", add_special_tokens=False) for ex in examples]
        at = [len(bos) + len(tokenizer.encode(ex.subject, add_special_tokens=False)) - 1 for ex in examples]
        essence, essence_masks = _batched([EncodedExample(i, [-100] * len(i)) for i in ids], at, params.batch_size,
                                          pad)
    return Facts(examples, batches, masks, essence, essence_masks)


def capture_at(model: nn.Module, batches: Sequence[Batch], masks: Sequence[torch.Tensor], inputs: Sequence[str] = (),
               outputs: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """name -> (N, dim) float64: the inputs (keys) and outputs of named modules at each fact's subject token."""
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in [*inputs, *outputs]}
    # a block's output hook fires after its own modules' hooks, so a pass that wants both cannot stop early
    with evaluating(model), KeyCapture(model, inputs, outputs, early_stop=not outputs) as cap:
        for batch, mask in zip(batches, masks, strict=True):
            got = cap.run(batch, mask)
            for name in inputs:
                parts[name].append(got.inputs[name].double().cpu())
            for name in outputs:
                parts[name].append(got.outputs[name].double().cpu())
    return {name: torch.cat(p) for name, p in parts.items()}


@contextmanager
def adding_at(module: nn.Module, delta: torch.Tensor, mask: torch.Tensor) -> Iterator[None]:
    """While open, `module`'s output gets delta (B, out) added at the one position per row `mask` (B, T) marks."""

    def hook(mod, args, output):
        out = output.clone()
        out[mask] = out[mask] + delta.to(out.dtype)
        return out

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _next_logprobs(model, batch: Batch, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return torch.log_softmax(logits[mask].float(), dim=-1)  # (B, vocab) at the subject token


def _unlikelihood(logits: torch.Tensor, labels: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) log-probability of each answer (nats, summed over its tokens), and the loss: for every fact still above
    `floor`, the mean over its answer tokens of -log(1 - p) (unlikelihood, Welleck et al. 2020). Its gradient does
    not vanish where the model is sure of a token, as log p's does (d log p / d logit = 1 - p ~ 0 for a memorised
    fact). The whole answer's probability is what counts: a value at the subject moves the first answer token most,
    and a greedy reader that does not start the answer does not give it."""
    shifted, target = logits[:, :-1].float(), labels[:, 1:]
    mask = target != IGNORE_INDEX
    logp = torch.log_softmax(shifted, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    total = (logp * mask).sum(1)
    active = mask & (total > floor).unsqueeze(1)
    unlikely = -torch.log1p(-logp.clamp_max(-1e-6).exp())  # -log(1 - p), finite at p -> 1
    return total.detach(), ((unlikely * active).sum(1) / mask.sum(1).clamp_min(1)).sum()


def optimise_values(model: nn.Module, adapter: ModelAdapter, facts: Facts, layer: int, params: EditorParams
                    ) -> tuple[torch.Tensor, dict]:
    """delta (N, out) float64: what to add to layer `layer`'s down-projection output at each fact's subject token so
    that the fact is given up (see the module docstring); the model's weights are not touched.

    Each fact's delta changes only its own sequence, so all facts are optimised together, one forward and backward
    pass per batch and step; a fact stops moving once its answer is below `forget_logprob`."""
    device = model_device(model)
    module = adapter.module(adapter.down_proj_names[layer])
    name = adapter.down_proj_names[layer]
    values = capture_at(model, facts.batches, facts.masks, outputs=[name])[name]  # (N, out): the original W k
    norms = values.norm(dim=1).clamp_min(1e-12).to(device).float()
    delta = torch.zeros(values.shape, device=device, dtype=torch.float32, requires_grad=True)
    reference = None
    if facts.essence is not None and params.kl_factor:
        with torch.no_grad(), evaluating(model):
            reference = [_next_logprobs(model, b.to(device), m.to(device))
                         for b, m in zip(facts.essence, facts.essence_masks, strict=True)]
    optimizer = torch.optim.Adam([delta], lr=params.v_lr)
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    history = []
    try:
        with evaluating(model):
            for step in range(params.v_steps):
                optimizer.zero_grad(set_to_none=True)
                above, total = 0, 0.0
                for i, (batch, mask) in enumerate(zip(facts.batches, facts.masks, strict=True)):
                    rows = batch.example_ids.to(device)
                    batch, mask = batch.to(device), mask.to(device)
                    with adding_at(module, delta[rows], mask):
                        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                       use_cache=False).logits
                    answer_logp, loss = _unlikelihood(logits, batch.labels, params.forget_logprob)
                    above += int((answer_logp > params.forget_logprob).sum())
                    if reference is not None:
                        e_batch, e_mask = facts.essence[i].to(device), facts.essence_masks[i].to(device)
                        with adding_at(module, delta[rows], e_mask):
                            now = _next_logprobs(model, e_batch, e_mask)
                        kl = (reference[i].exp() * (reference[i] - now)).sum(dim=1)
                        loss = loss + params.kl_factor * kl.sum()
                    loss = loss + params.v_weight_decay * (delta[rows].norm(dim=1) / norms[rows].pow(2)).sum()
                    loss.backward()
                    total += float(loss.detach())
                history.append({"step": step, "loss": total, "facts_above": above})
                if above == 0:
                    break
                optimizer.step()
                with torch.no_grad():  # ROME's clamp: delta stays within clamp_norm_factor x ||v||
                    limit = params.clamp_norm_factor * norms
                    scale = (limit / delta.norm(dim=1).clamp_min(1e-12)).clamp_max(1.0)
                    delta.mul_(scale.unsqueeze(1))
    finally:
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])
    log.info("v*: %d facts at layer %d, %d steps, %d still above %.1f nats", len(facts.examples), layer,
             len(history), history[-1]["facts_above"], params.forget_logprob)
    return delta.detach().double().cpu(), {"steps": len(history), "facts_above": history[-1]["facts_above"],
                                           "history": history}


def key_covariances(model: nn.Module, tokenizer, forget, retain, modules: Sequence[str], params: EditorParams,
                    adapter: ModelAdapter, context) -> tuple[dict[str, GramStats], list[str], str]:
    """The retain keys' statistics of `modules` through GROM's own cache (same model fingerprint, retain data,
    max_length and prompt format give the same entries), and the model's fingerprint. C = gram / count."""
    grom = GromParams(batch_size=params.batch_size, max_length=params.max_length)
    rows = retain_rows(model, tokenizer, as_examples(retain), len(forget), grom, prompt_format(context.prompt_format))
    stats, reused = retain_statistics(model, rows, modules, store=context.stats_store, compute=context.compute_stats)
    return stats, reused, rows.fingerprint


@dataclass
class EditorStart:
    """What every editor computes before its update: the facts, the retain statistics of the edited modules (and
    which came from the cache), the model's fingerprint, and delta (N, out) at the last edited layer."""

    facts: Facts
    stats: dict[str, GramStats]
    reused: list[str]
    fingerprint: str
    delta: torch.Tensor
    info: dict


def start_edit(model: nn.Module, tokenizer, forget, retain, params: EditorParams, context, adapter: ModelAdapter,
               layers: Sequence[int], clock) -> EditorStart:
    """The shared stages (timed on `clock`): encode the facts, the retain statistics of `layers`' down-projections,
    v* at the last of `layers`."""
    modules = [adapter.down_proj_names[layer] for layer in layers]
    with clock.stage("prepare"):
        facts = encode_facts(tokenizer, forget, params, context.prompt_format)
    with clock.stage("retain_statistics"):
        stats, reused, fingerprint = key_covariances(model, tokenizer, forget, retain, modules, params, adapter,
                                                     context)
    with clock.stage("values"):
        delta, info = optimise_values(model, adapter, facts, layers[-1], params)
    return EditorStart(facts, stats, reused, fingerprint, delta, info)


def covariance(stats: GramStats) -> torch.Tensor:
    """C = E[k k^T] (in, in) float64 over the retain positions."""
    if stats.count == 0:
        raise DataError(f"{stats.module}: no retain positions; the editors need retain data")
    return stats.gram.double().cpu() / stats.count
