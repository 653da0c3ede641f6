"""Attacks that read the model around an edit: does the forgetting live in the weights, or only in how one layer
reads them?

An edit that leaves the model's body unchanged and changes only how the last layer reads it (an LM-head edit) is
undone by anyone who reads the body another way. Three ways of reading around an edit, each a context manager that
changes the model for the `with` block and restores every bit after it, so that any evaluation runs inside it:

- `head_swapped`: the edited model's final hidden states read through the base model's output head (for a tied
  model, its input embedding, which an LM-head edit leaves alone). A head-only edit is recovered in full.
- `lens`: the logit lens: the residual stream after layer l read through the final norm and the base head (the
  blocks above l are skipped). An edit of the top layers is read from below them; `lens_layers` picks the layers.
- `relearned`: the relearning attack (Hu et al. 2024; Lucki et al. 2024): a few AdamW steps of plain fine-tuning on
  part of the forget set (or on retain data only: does ordinary fine-tuning bring it back?); the forgetting is
  then read on the other part (`split_halves`), which the attack never saw, by `heldout_metrics`.

Recovery is, as for quantization, the forget metric after the attack minus after the edit. `ATTACKS` names them
for `grom bench --attacks`, the flow's robustness report and the service's gates (`AttackKit.run`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import ModelAdapter, get_module, weight_out_in
from grom_core.capture import model_device
from grom_core.data import Example, make_batches, prompt_format
from grom_core.generation import greedy_generate
from grom_core.scoring import answer_nll
from grom_core.stash import stashed

log = logging.getLogger(__name__)

HEAD_SWAP, LOGIT_LENS, RELEARN, RELEARN_RETAIN = "head_swap", "logit_lens", "relearn", "relearn_retain"
ATTACKS = (HEAD_SWAP, LOGIT_LENS, RELEARN, RELEARN_RETAIN)
HELDOUT_ACCURACY, HELDOUT_PROBABILITY = "heldout_forget_accuracy", "heldout_forget_probability"


@contextmanager
@torch.no_grad()
def head_swapped(model: nn.Module, base_head: torch.Tensor, head_name: str | None = None) -> Iterator[None]:
    """The model's output head replaced by `base_head` ([vocab, hidden], the base model's output weights) for the
    `with` block; the head's own weights are restored bit for bit after."""
    head = get_module(model, head_name) if head_name else model.get_output_embeddings()
    weight = weight_out_in(head)
    if tuple(weight.shape) != tuple(base_head.shape):
        raise ValueError(f"base head {tuple(base_head.shape)} does not match the model's head {tuple(weight.shape)}")
    saved = weight.detach().clone()
    try:
        weight.copy_(base_head.to(weight.device, weight.dtype))
        yield
    finally:
        weight.copy_(saved)


@contextmanager
def lens(model: nn.Module, adapter: ModelAdapter, layer: int, base_head: torch.Tensor) -> Iterator[None]:
    """The logit lens at `layer`: the blocks above it are skipped (the residual stream after block `layer` goes
    straight to the final norm) and read through the base head, for the `with` block."""
    if not 0 <= layer < adapter.num_layers:
        raise ValueError(f"layer {layer} does not exist; the model has layers 0..{adapter.num_layers - 1}")
    path = adapter.block_names[0].rsplit(".", 1)[0]
    owner_path, _, attr = path.rpartition(".")
    owner = get_module(model, owner_path) if owner_path else model
    blocks = getattr(owner, attr)
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    setattr(owner, attr, nn.ModuleList(list(blocks)[:layer + 1]))
    if count is not None:
        config.num_hidden_layers = layer + 1
    try:
        with head_swapped(model, base_head, adapter.lm_head_name):
            yield
    finally:
        setattr(owner, attr, blocks)
        if count is not None:
            config.num_hidden_layers = count


def lens_layers(num_layers: int, count: int = 4) -> list[int]:
    """The layers the logit lens reads: `count` layers evenly spaced over the second half of the model, from its
    middle to the one below the last (the last one's output is what `head_swapped` reads)."""
    low, high = num_layers // 2, num_layers - 2
    if high < low:
        return [max(0, num_layers - 1)]
    if count <= 1 or high == low:
        return [high]
    return sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})


MIN_RELEARN_FACTS = 2


def _fact_groups(examples: Sequence[Example]) -> dict[str, list[Example]]:
    groups: dict[str, list[Example]] = {}
    for i, ex in enumerate(examples):
        key = (f"subject:{ex.subject}" if ex.subject else f"answer:{ex.answer.strip().lower()}" if ex.answer
               else f"row:{i}")
        groups.setdefault(key, []).append(ex)
    return groups


def fact_count(examples: Sequence[Example]) -> int:
    """How many facts the forget rows hold, as `split_halves` groups them."""
    return len(_fact_groups(examples))


def split_halves(examples: Sequence[Example], seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(trained on, held out): the forget examples in two halves that share no fact, grouped by subject where the
    rows name one, else by answer (three phrasings of one capital are one group), else one group per row."""
    groups = _fact_groups(examples)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    half = len(keys) // 2
    if half == 0:
        raise ValueError(f"the relearning attack needs forget data of at least {MIN_RELEARN_FACTS} facts "
                         "(subjects, answers or rows): it trains on one half and reads the other")
    return ([ex for k in keys[:half] for ex in groups[k]], [ex for k in keys[half:] for ex in groups[k]])


@dataclass(frozen=True)
class RelearnRecipe:
    """The relearning attack's fine-tuning: `steps` AdamW steps (lr: the benchmark's gradient recipe's step size) on
    batches of `batch_size` rows, drawn with `seed`; `max_length` in tokens."""

    steps: int = 20
    lr: float = 1e-5
    batch_size: int = 4
    seed: int = 0
    max_length: int = 256


@contextmanager
def relearned(model: nn.Module, tokenizer, rows: Sequence[Example], recipe: RelearnRecipe, fmt: str = "qa"
              ) -> Iterator[list[float]]:
    """The model fine-tuned on `rows` (mean token NLL of their answers, or of their texts) for the `with` block;
    every weight is restored bit for bit after. Yields the loss of each step. Every parameter is trained (the
    attacker owns the weights), in float32 AdamW."""
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    was_training = model.training
    device = model_device(model)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    losses: list[float] = []
    with stashed({str(i): p for i, p in enumerate(params)}) as stash:  # the weights on disk, not twice in memory
        try:
            for p in params:
                p.requires_grad_(True)
            optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
            model.train()
            pool = list(rows)
            for _ in range(recipe.steps):
                picked = rng.sample(pool, min(recipe.batch_size, len(pool)))
                batch = make_batches(tokenizer, picked, len(picked), recipe.max_length, fmt=fmt)[0].to(device)
                loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                             use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
            del optimizer
            model.train(was_training)
            for p in params:
                p.requires_grad_(False)
            yield losses
        finally:
            stash.restore()
            for p, flag in zip(params, flags, strict=True):
                p.requires_grad_(flag)
                p.grad = None
            model.train(was_training)


def heldout_metrics(model: nn.Module, tokenizer, rows: Sequence[Example], fmt: str = "qa", batch_size: int = 16
                    ) -> dict[str, float]:
    """The forgetting read on `rows`: their answers' mean TOFU probability (exp of minus each answer's mean token
    NLL) and, for QA rows, the fraction whose greedy continuation of the prompt begins with the answer (case and
    surrounding space ignored)."""
    fmt_ = prompt_format(fmt)
    batches = make_batches(tokenizer, list(rows), batch_size, fmt=fmt_)
    out = {HELDOUT_PROBABILITY: float(torch.exp(-answer_nll(model, batches)).mean())}
    qa = [ex for ex in rows if ex.question is not None]
    if qa:
        answers = [ex.answer.strip().lower() for ex in qa]
        longest = max(len(tokenizer.encode(" " + ex.answer, add_special_tokens=False)) for ex in qa)
        outputs = greedy_generate(model, tokenizer, [fmt_.prompt(tokenizer, ex.question) for ex in qa],
                                  max_new_tokens=longest + 2, batch_size=batch_size, desc="relearn probe",
                                  bos=not fmt_.chat)
        hits = [out_.strip().lower().startswith(a) for out_, a in zip(outputs, answers, strict=True)]
        out[HELDOUT_ACCURACY] = sum(hits) / len(hits)
    return out


def recoveries(attacked: Mapping[str, object], edited: Mapping[str, object], keys: Sequence[str]) -> dict:
    """{"recovery_<key>": attacked - edited} for every key both measure as a number."""
    return {f"recovery_{k}": float(attacked[k]) - float(edited[k]) for k in keys
            if _number(attacked.get(k)) and _number(edited.get(k))}


def headline_recovery(result: Mapping[str, object], keys: Sequence[str]) -> float | None:
    """The one recovery a gate or a table reads from an attack's `result`: that of the first of `keys` it measured
    (the headline forget metric first), else, for the relearning attacks, of the held-out forget accuracy (or,
    for texts, probability); None where it measured none."""
    for key in (*keys, HELDOUT_ACCURACY, HELDOUT_PROBABILITY):
        value = result.get(f"recovery_{key}")
        if _number(value):
            return float(value)
    return None


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


@dataclass
class AttackKit:
    """What the attacks need besides the edited model: the base head, the forget and retain data, how the data
    becomes text, the relearning recipe and the evaluation to run under each attack.

    Attributes:
        base_head: the base model's output head [vocab, hidden] (for a tied model, its input embedding).
        forget, retain: the unlearning inputs (the relearning attack trains on half of `forget`, or on `retain`).
        evaluate: () -> flat metrics of the model as it is now (the benchmark's evaluation, or the own data's).
        recovery: the forget metrics whose rise means the forgetting came back.
        prompt_format: how the QA rows become text (grom_core.data.PROMPT_FORMATS).
        recipe: the relearning attack's steps and step size.
        lens_count: how many layers the logit lens reads (`lens_layers`).
    """

    base_head: torch.Tensor
    forget: Sequence[Example]
    retain: Sequence[Example]
    evaluate: Callable[[], dict]
    recovery: Sequence[str]
    prompt_format: str = "qa"
    recipe: RelearnRecipe = RelearnRecipe()
    lens_count: int = 4

    def run(self, name: str, model: nn.Module, tokenizer, edited: Mapping[str, object]) -> dict:
        """The metrics of the edited model (`edited`: its metrics without attack) after attack `name`, with their
        `recovery_<metric>` keys."""
        if name == HEAD_SWAP:
            with head_swapped(model, self.base_head):
                metrics = self.evaluate()
            out = {**metrics, **recoveries(metrics, edited, self.recovery)}
        elif name == LOGIT_LENS:
            out = self._lens(model, edited)
        elif name in (RELEARN, RELEARN_RETAIN):
            out = self._relearn(name, model, tokenizer)
        else:
            raise ValueError(f"unknown attack '{name}'; known: {', '.join(ATTACKS)}")
        if "skipped" in out:
            log.info("%s skipped: %s", name, out["skipped"])
            return {**out, "recovery": None}
        return {**out, "recovery": headline_recovery(out, self.recovery)}

    def _lens(self, model: nn.Module, edited: Mapping[str, object]) -> dict:
        """The layer whose lens recovers the headline forget metric most, its metrics and every layer's value."""
        adapter = ModelAdapter.for_model(model)
        key = self.recovery[0]
        best, per_layer = None, {}
        for layer in lens_layers(adapter.num_layers, self.lens_count):
            with lens(model, adapter, layer, self.base_head):
                metrics = self.evaluate()
            value = metrics.get(key)
            per_layer[f"lens_{key}_layer{layer}"] = value
            score = float(value) if _number(value) else float("-inf")
            if best is None or score > best[0]:
                best = (score, layer, metrics)
        _, layer, metrics = best
        log.info("logit lens: %s", ", ".join(f"{k.rsplit('layer', 1)[1]}: {v}" for k, v in per_layer.items()))
        return {**metrics, **recoveries(metrics, edited, self.recovery), "lens_layer": layer, **per_layer}

    def _relearn(self, name: str, model: nn.Module, tokenizer) -> dict:
        """Fine-tune on one half of the forget facts (or, `relearn_retain`, on retain rows only), read the other
        half before and after."""
        if name == RELEARN and fact_count(self.forget) < MIN_RELEARN_FACTS:
            return {"skipped": f"{name} needs forget data of at least {MIN_RELEARN_FACTS} facts (subjects, answers "
                               f"or rows) to train on one half and read the other; this forget set holds one"}
        if fact_count(self.forget) >= MIN_RELEARN_FACTS:  # both attacks read the same held-out half
            trained, heldout = split_halves(list(self.forget), self.recipe.seed)
        else:  # relearn_retain on a single fact: it is held out whole
            trained, heldout = [], list(self.forget)
        rows = trained if name == RELEARN else list(self.retain)
        if not rows:
            raise ValueError(f"the {name} attack needs {'forget' if name == RELEARN else 'retain'} rows to train on")
        before = heldout_metrics(model, tokenizer, heldout, self.prompt_format)
        with relearned(model, tokenizer, rows, self.recipe, self.prompt_format) as losses:
            after = heldout_metrics(model, tokenizer, heldout, self.prompt_format)
        log.info("%s: %d steps on %d rows (loss %.3f -> %.3f), held-out %s", name, self.recipe.steps, len(rows),
                 losses[0], losses[-1], ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in after))
        return {**after, **{f"{k}_before": v for k, v in before.items()},
                **recoveries(after, before, list(after)), "heldout_rows": len(heldout), "trained_rows": len(rows)}
