"""The training loop of the gradient-based methods, returning the same Edit value as the closed form.

Per optimizer step: the forget objective's gradient g_f and the retain objective's gradient g_r are accumulated
separately over the micro-batches (two backward passes each), composed once (sum, PCGrad or SAGO: composition is
not linear, so it must see the whole accumulated gradients), written into `.grad`, and AdamW steps. Only the weights
of the linear layers (attention, MLP, LM head) are trained, so that the result is a set of [out, in] deltas: an
Edit that applies, reverts, registers and quantizes like the closed-form one. The model is restored bit for bit at
the end; the edit is returned unapplied.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from grom_core.adapter import is_conv1d, weight_out_in
from grom_core.capture import model_device
from grom_core.data import Example, as_examples, make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError, UnsupportedArchitectureError
from grom_core.fingerprint import weights_fingerprint
from grom_core.gradient.composition import COMPOSERS
from grom_core.gradient.losses import answer_logprobs, kl_to_reference, nll
from grom_core.gradient.methods import METHODS, ForgetBatchOutputs, MethodParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerParams:
    """The recipe, the same for every method. TOFU's is lr 1e-5, 10 epochs, effective batch 32, AdamW on 7B
    models; tiny models need a larger lr (units: AdamW step size)."""

    lr: float = 1e-3
    epochs: int = 10
    batch_size: int = 8
    grad_accum: int = 4
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    max_length: int = 512


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


def trainable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every nn.Linear / GPT-2 Conv1D: the weights the baselines train."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


def _sequence_outputs(model, batch):
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logp, lengths = answer_logprobs(out.logits, batch.labels)
    return out.logits, logp, lengths


def unlearn_gradient(model: nn.Module, tokenizer, forget, retain, method: str = "npo", compose: str = "sum",
                     method_params: MethodParams | None = None, trainer: TrainerParams = TrainerParams()
                     ) -> GradientRun:
    """Train `model` to forget `forget` and keep `retain` with a gradient method; return the weight deltas as an Edit.

    The model's weights are the same before and after the call (restored exactly); apply the returned edit.
    """
    if method not in METHODS:
        raise DataError(f"unknown method '{method}'; choose one of {', '.join(sorted(METHODS))}")
    if compose not in COMPOSERS:
        raise DataError(f"unknown composer '{compose}'; choose one of {', '.join(sorted(COMPOSERS))}")
    spec = METHODS[method]
    params = method_params or spec.params()
    forget_ex, retain_ex = as_examples(forget), as_examples(retain)
    if any(ex.question is None for ex in forget_ex) and spec.needs_idk:
        raise DataError("IdkDPO needs question/answer forget examples (the preferred answer is an 'I don't know')")
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        raise UnsupportedArchitectureError("the LM head is tied to the input embedding; untie it first with "
                                           "ModelAdapter.for_model(model).untie_lm_head()")
    start = time.perf_counter()
    base_fingerprint = weights_fingerprint(model)
    rng = random.Random(trainer.seed)
    torch.manual_seed(trainer.seed)
    modules = trainable_modules(model)
    originals = {name: m.weight.detach().clone() for name, m in modules.items()}
    reference = None
    if spec.needs_reference or params.retain_loss == "kl":
        reference = copy.deepcopy(model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    trained = [m.weight for m in modules.values()]
    frozen = [p for p in model.parameters() if all(p is not t for t in trained)]
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=trainer.lr, weight_decay=trainer.weight_decay)
    composer = COMPOSERS[compose]
    idk = idk_answers() if spec.needs_idk else []
    device = model_device(model)
    steps = passes = 0
    history = []
    was_training = model.training
    model.train()
    try:
        for epoch in range(trainer.epochs):
            order = list(range(len(forget_ex)))
            rng.shuffle(order)
            forget_batches = make_batches(tokenizer, [forget_ex[i] for i in order], trainer.batch_size,
                                          trainer.max_length)
            idk_batches = (make_batches(tokenizer, [Example(question=forget_ex[i].question, answer=rng.choice(idk))
                                                    for i in order], trainer.batch_size, trainer.max_length)
                           if idk else [None] * len(forget_batches))
            retain_order = rng.sample(range(len(retain_ex)), len(retain_ex))
            retain_batches = make_batches(tokenizer, [retain_ex[i] for i in retain_order], trainer.batch_size,
                                          trainer.max_length)
            epoch_f = epoch_r = 0.0
            for first in range(0, len(forget_batches), trainer.grad_accum):
                group = range(first, min(first + trainer.grad_accum, len(forget_batches)))
                g_f = [torch.zeros_like(p) for p in trained]
                g_r = [torch.zeros_like(p) for p in trained]
                for i in group:
                    fb = forget_batches[i].to(device)
                    rb = retain_batches[i % len(retain_batches)].to(device)
                    loss_f = _forget_objective(model, reference, spec, params, fb, idk_batches[i], device)
                    passes += 1 + spec.needs_reference + 2 * spec.needs_idk
                    _accumulate(loss_f * params.gamma / len(group), trained, g_f)
                    epoch_f += loss_f.item()
                    if params.alpha:
                        loss_r = _retain_objective(model, reference, params, rb)
                        passes += 1 + (params.retain_loss == "kl")
                        _accumulate(loss_r * params.alpha / len(group), trained, g_r)
                        epoch_r += loss_r.item()
                # the weights are already in g_f and g_r, so the composer combines them with unit weights
                composed = composer(g_f, g_r, 1.0, 1.0)
                for p, g in zip(trained, composed, strict=True):
                    p.grad = g
                if trainer.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(trained, trainer.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
            history.append({"epoch": epoch + 1, "forget_loss": epoch_f / len(forget_batches),
                            "retain_loss": epoch_r / len(forget_batches)})
            log.info("%s+%s: epoch %d/%d, forget loss %.4f, retain loss %.4f, %d steps", method, compose, epoch + 1,
                     trainer.epochs, history[-1]["forget_loss"], history[-1]["retain_loss"], steps)
        deltas = {}
        with torch.no_grad():
            for name, module in modules.items():
                old = originals[name]
                new = module.weight.detach()
                diff = (new.double() - old.double())
                diff = diff.T if is_conv1d(module) else diff  # [out, in], as ModuleDelta expects
                if bool(diff.abs().max() > 0):
                    deltas[name] = ModuleDelta(name=name, shape=tuple(weight_out_in(module).shape),
                                               dense=diff.cpu().contiguous())
    finally:
        with torch.no_grad():
            for name, module in modules.items():
                module.weight.copy_(originals[name])  # the exact original bits
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])
            p.grad = None
        model.train(was_training)
    edit = Edit(deltas=deltas, base_fingerprint=base_fingerprint,
                params={"method": method, "compose": compose, **asdict(params), **asdict(trainer)},
                metadata={"steps": steps, "forward_passes": passes, "history": history,
                          "forget_examples": len(forget_ex), "retain_examples": len(retain_ex)})
    return GradientRun(edit=edit, steps=steps, seconds=time.perf_counter() - start, forward_passes=passes,
                       losses=history)


def _accumulate(loss: torch.Tensor, params: list[torch.Tensor], into: list[torch.Tensor]) -> None:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for buffer, g in zip(into, grads, strict=True):
        if g is not None:
            buffer.add_(g)


def _forget_objective(model, reference, spec, params, batch, idk_batch, device) -> torch.Tensor:
    _, logp, lengths = _sequence_outputs(model, batch)
    out = ForgetBatchOutputs(logp=logp, lengths=lengths)
    if reference is not None and spec.needs_reference:
        with torch.no_grad():
            out.ref_logp = _sequence_outputs(reference, batch)[1]
    if spec.needs_idk:
        idk_batch = idk_batch.to(device)
        out.idk_logp = _sequence_outputs(model, idk_batch)[1]
        with torch.no_grad():
            out.idk_ref_logp = _sequence_outputs(reference, idk_batch)[1]
    return spec.forget_loss(out, params)


def _retain_objective(model, reference, params, batch) -> torch.Tensor:
    logits, logp, lengths = _sequence_outputs(model, batch)
    if params.retain_loss == "kl":
        with torch.no_grad():
            ref_logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   use_cache=False).logits
        return kl_to_reference(logits, ref_logits, batch.labels)
    return nll(logp, lengths)
