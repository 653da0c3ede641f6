"""The training loop of the gradient-based methods, returning the same Edit value as the closed form.

Per optimizer step with `sum` composition, the plain training loop: one backward pass of gamma L_f + alpha L_r per
micro-batch into `.grad`, then AdamW. With PCGrad or SAGO the forget gradient g_f and the retain gradient g_r are
accumulated separately over the micro-batches (two backward passes each) and composed once (composition is not
linear, so it must see the whole accumulated gradients). The frozen reference model NPO compares against is not
kept: its log-probabilities of the forget answers are computed once before training (it never changes), so no copy
of the model is held unless the KL retain loss or IdkDPO needs the reference on new inputs. Only the weights of the
linear layers (attention, MLP, LM head) are trained, so that the result is a set of [out, in] deltas: an Edit that
applies, reverts, registers and quantizes like the closed-form one. The model is restored bit for bit at the end;
the edit is returned unapplied, its deltas in the weights' own dtype (new - old is exact there for the small steps
of training: Sterbenz).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from grom_core.adapter import is_conv1d, shares_input_embedding, weight_out_in
from grom_core.capture import model_device
from grom_core.data import Example, as_examples, make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError, TiedWeightsError
from grom_core.fingerprint import weights_fingerprint
from grom_core.gradient.composition import COMPOSERS
from grom_core.gradient.losses import answer_logprobs, kl_to_reference, nll
from grom_core.gradient.methods import ForgetBatchOutputs, MethodParams, Objective
from grom_core.stash import stashed

log = logging.getLogger(__name__)


@dataclass
class GradientRun:
    edit: Edit
    steps: int
    seconds: float
    forward_passes: int
    losses: list[dict] = field(default_factory=list)


def idk_answers(path: str | Path | None = None) -> list[str]:
    """The "I don't know" answers of TOFU (data/tofu/idontknow.jsonl: one sentence per line)."""
    from grom_core.benchmarks.minitofu import tofu_data_dir

    path = Path(path) if path else tofu_data_dir() / "idontknow.jsonl"
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) if line.startswith('"') else line for line in lines]


ALTERNATIVES = 3  # candidates per forget question; one is drawn per epoch


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def alternative_answers(forget: list[Example], retain: list[Example], k: int = ALTERNATIVES) -> list[list[str]]:
    """Per forget question, the answers of the k retain questions most like it (word Jaccard; ties by order) whose
    answer differs from the forget answer: plausible, in-domain and false for this question, which is what AltPO
    prefers. (The paper has the model write alternatives; a tiny model given the forget question writes the
    memorised answer back, so they are taken from the retain facts of the same kind.)"""
    pool = [ex for ex in retain if ex.question is not None]
    if not pool:
        raise DataError("AltPO takes its alternative answers from the retain questions; the retain data has none")
    words = [_words(ex.question) for ex in pool]
    out = []
    for ex in forget:
        mine = _words(ex.question)
        scored = sorted(range(len(pool)), key=lambda j: -len(mine & words[j]) / max(1, len(mine | words[j])))
        picks = [pool[j].answer for j in scored if pool[j].answer.strip() != ex.answer.strip()][:k]
        out.append(picks or [pool[scored[0]].answer])
    return out


def preferred_answers(kind: str | None, forget: list[Example], retain: list[Example]) -> list[list[str]]:
    """Per forget example, the answers a preference method may prefer to it ([] when it prefers none)."""
    if kind is None:
        return []
    if kind == "idk":
        idk = idk_answers()
        return [idk] * len(forget)
    return alternative_answers(forget, retain)


def trainable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every nn.Linear / GPT-2 Conv1D: the weights the baselines train."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


def _sequence_outputs(model, batch):
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logp, lengths = answer_logprobs(out.logits, batch.labels)
    return out.logits, logp, lengths


def unlearn_gradient(model: nn.Module, tokenizer, forget, retain, method: str = "npo",
                     params: MethodParams | None = None, prompt_format: str = "qa") -> GradientRun:
    """`train` with a gradient method of the registry by name (its default parameters unless `params`)."""
    from grom_core.methods import get_method

    entry = get_method(method)
    if not entry.gradient:
        raise DataError(f"'{method}' is not a gradient method; call run_grom for the closed form")
    return train(model, tokenizer, forget, retain, params or entry.params(), entry.objective, name=method,
                 prompt_format=prompt_format)


def train(model: nn.Module, tokenizer, forget, retain, params: MethodParams, objective: Objective,
          name: str = "gradient", prompt_format: str = "qa") -> GradientRun:
    """Train `model` to forget `forget` and keep `retain` with a gradient method; return the weight deltas as an Edit.

    Args:
        params: the method's parameters, with its composer (`params.compose`) and recipe (`params.trainer`).
        objective: its forget loss and what that loss needs (a frozen reference model, "I don't know" answers).
        name: the method's name, for logs and the edit's parameters.
        prompt_format: how QA pairs become text (grom_core.data.PROMPT_FORMATS).

    The model's weights are the same before and after the call (restored exactly); apply the returned edit.
    """
    params.validate()
    spec, trainer, compose = objective, params.trainer, params.compose
    forget_ex, retain_ex = as_examples(forget), as_examples(retain)
    if any(ex.question is None for ex in forget_ex) and spec.preferred:
        raise DataError(f"{name} needs question/answer forget examples (it prefers another answer to each)")
    head = model.get_output_embeddings()
    if head is not None and shares_input_embedding(model, head):
        raise TiedWeightsError("the LM head is tied to the input embedding; untie it first with "
                               "ModelAdapter.for_model(model).untie_lm_head()")
    start = time.perf_counter()
    base_fingerprint = weights_fingerprint(model)
    rng = random.Random(trainer.seed)
    torch.manual_seed(trainer.seed)
    modules = trainable_modules(model)
    reference = None
    if spec.preferred or params.retain_loss == "kl":  # the reference is asked about inputs made during training
        reference = copy.deepcopy(model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    ref_logp = (reference_logprobs(model, tokenizer, forget_ex, trainer.batch_size, trainer.max_length,
                                   prompt_format) if spec.needs_reference and reference is None else None)
    trained = [m.weight for m in modules.values()]
    frozen = [p for p in model.parameters() if all(p is not t for t in trained)]
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=trainer.lr, weight_decay=trainer.weight_decay)
    composer = COMPOSERS[compose]
    candidates = preferred_answers(spec.preferred, forget_ex, retain_ex)
    device = model_device(model)
    steps = passes = 0
    history = []
    was_training = model.training
    model.train()
    # the original weights wait on disk (grom_core.stash), not as a second copy of the model in memory
    with stashed({name: m.weight for name, m in modules.items()}) as originals:
        try:
            for epoch in range(trainer.epochs):
                order = list(range(len(forget_ex)))
                rng.shuffle(order)
                original_id = torch.tensor(order)  # a batch's example ids count positions in the shuffled order
                forget_batches = make_batches(tokenizer, [forget_ex[i] for i in order], trainer.batch_size,
                                              trainer.max_length, fmt=prompt_format)
                preferred = [Example(question=forget_ex[i].question, answer=rng.choice(candidates[i])) for i in order
                             ] if candidates else []
                preferred_batches = (make_batches(tokenizer, preferred, trainer.batch_size, trainer.max_length,
                                                  fmt=prompt_format) if candidates else [None] * len(forget_batches))
                retain_order = rng.sample(range(len(retain_ex)), len(retain_ex))
                retain_batches = make_batches(tokenizer, [retain_ex[i] for i in retain_order], trainer.batch_size,
                                              trainer.max_length, fmt=prompt_format)
                epoch_f = epoch_r = 0.0
                for first in range(0, len(forget_batches), trainer.grad_accum):
                    group = range(first, min(first + trainer.grad_accum, len(forget_batches)))
                    g_f = g_r = None
                    if compose != "sum":
                        g_f = [torch.zeros_like(p) for p in trained]
                        g_r = [torch.zeros_like(p) for p in trained]
                    for i in group:
                        fb = forget_batches[i].to(device)
                        rb = retain_batches[i % len(retain_batches)].to(device)
                        stored = (ref_logp[original_id[fb.example_ids.cpu()]].to(device) if ref_logp is not None
                                  else None)
                        loss_f = _forget_objective(model, reference, spec, params, fb, preferred_batches[i], device,
                                                   stored)
                        passes += 1 + (reference is not None and spec.needs_reference) + 2 * bool(spec.preferred)
                        epoch_f += loss_f.item()
                        loss_r = None
                        if params.alpha:
                            loss_r = _retain_objective(model, reference, params, rb)
                            passes += 1 + (params.retain_loss == "kl")
                            epoch_r += loss_r.item()
                        if g_f is None:  # sum: one backward pass of the weighted total, as a plain loop does
                            total = loss_f * params.gamma + (loss_r * params.alpha if loss_r is not None else 0.0)
                            (total / len(group)).backward()
                        else:
                            _accumulate(loss_f * params.gamma / len(group), trained, g_f)
                            if loss_r is not None:
                                _accumulate(loss_r * params.alpha / len(group), trained, g_r)
                    if g_f is not None:
                        # the weights are already in g_f and g_r, so the composer combines them with unit weights
                        for p, g in zip(trained, composer(g_f, g_r, 1.0, 1.0), strict=True):
                            p.grad = g
                    if trainer.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(trained, trainer.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    steps += 1
                history.append({"epoch": epoch + 1, "forget_loss": epoch_f / len(forget_batches),
                                "retain_loss": epoch_r / len(forget_batches)})
                log.info("%s+%s: epoch %d/%d, forget loss %.4f, retain loss %.4f, %d steps", name, compose, epoch + 1,
                         trainer.epochs, history[-1]["forget_loss"], history[-1]["retain_loss"], steps)
            optimizer.state.clear()  # the moments are done with: their memory goes before the deltas are formed
            deltas = {}
            with torch.no_grad():
                for module_name, module in modules.items():
                    # exact in the weights' dtype (Sterbenz)
                    diff = module.weight.detach() - originals.read(module_name).to(module.weight.device)
                    diff = diff.T if is_conv1d(module) else diff  # [out, in], as ModuleDelta expects
                    if bool(diff.abs().max() > 0):
                        deltas[module_name] = ModuleDelta(name=module_name, shape=tuple(weight_out_in(module).shape),
                                                          dense=diff.cpu().contiguous())
        finally:
            originals.restore()  # the exact original bits
            for p in model.parameters():
                p.requires_grad_(flags[id(p)])
                p.grad = None
            model.train(was_training)
    edit = Edit(deltas=deltas, base_fingerprint=base_fingerprint,
                params={"method": name, **params.to_dict()},
                metadata={"steps": steps, "forward_passes": passes, "history": history,
                          "forget_examples": len(forget_ex), "retain_examples": len(retain_ex)})
    return GradientRun(edit=edit, steps=steps, seconds=time.perf_counter() - start, forward_passes=passes,
                       losses=history)


def _accumulate(loss: torch.Tensor, params: list[torch.Tensor], into: list[torch.Tensor]) -> None:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for buffer, g in zip(into, grads, strict=True):
        if g is not None:
            buffer.add_(g)


@torch.no_grad()
def reference_logprobs(model, tokenizer, examples, batch_size: int, max_length: int, prompt_format: str
                       ) -> torch.Tensor:
    """(N,) the frozen model's summed answer log-probability of every example (by example id), computed once."""
    out = torch.zeros(len(examples), dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        for batch in make_batches(tokenizer, examples, batch_size, max_length, fmt=prompt_format):
            batch = batch.to(model_device(model))
            out[batch.example_ids.cpu()] = _sequence_outputs(model, batch)[1].float().cpu()
    finally:
        model.train(was_training)
    return out


def _forget_objective(model, reference, spec, params, batch, preferred_batch, device, ref_logp=None) -> torch.Tensor:
    _, logp, lengths = _sequence_outputs(model, batch)
    out = ForgetBatchOutputs(logp=logp, lengths=lengths, ref_logp=ref_logp)
    if reference is not None and spec.needs_reference:
        with torch.no_grad():
            out.ref_logp = _sequence_outputs(reference, batch)[1]
    if spec.preferred:
        preferred_batch = preferred_batch.to(device)
        _, out.preferred_logp, out.preferred_lengths = _sequence_outputs(model, preferred_batch)
        with torch.no_grad():
            out.preferred_ref_logp = _sequence_outputs(reference, preferred_batch)[1]
    return spec.forget_loss(out, params)


def _retain_objective(model, reference, params, batch) -> torch.Tensor:
    logits, logp, lengths = _sequence_outputs(model, batch)
    if params.retain_loss == "kl":
        with torch.no_grad():
            ref_logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   use_cache=False).logits
        return kl_to_reference(logits, ref_logits, batch.labels)
    return nll(logp, lengths)
