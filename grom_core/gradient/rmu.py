"""RMU, representation misdirection for unlearning (Li et al. 2024, the WMDP baseline).

With h_l(x) the residual stream after block l and u a fixed random unit vector,

    min  mean_{forget tokens} ||h_l(x) - c u||^2 / d  +  alpha mean_{retain tokens} ||h_l(x) - h_l^0(x)||^2 / d

over the MLP down-projections of blocks l - k + 1 .. l (h^0: the frozen model). The forget text's activations are
driven to a large meaningless direction, which the later layers cannot read; the retain text's are held where they
were. Only blocks up to l run (nothing after l enters the loss), and h^0 of the retain batches is read once before
training, so no copy of the model is held. The steering coefficient is given as a multiple of the frozen model's
mean activation norm at l on the forget tokens (Dang et al. 2025, "adaptive RMU": c = beta ||h_l^0||), so that one
value means the same on models whose residual norms differ by orders of magnitude; WMDP's c = 6.5 was set by hand
for Zephyr-7B.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from grom_core.adapter import ModelAdapter, is_conv1d, weight_out_in
from grom_core.capture import model_device
from grom_core.data import Batch, as_examples, make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.fingerprint import weights_fingerprint
from grom_core.gradient.methods import TrainerParams
from grom_core.params import Params, ParamsError

if TYPE_CHECKING:
    from grom_core.methods import MethodRun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RMUParams(Params):
    """RMU's knobs, WMDP's published values unless said.

    layer: the block whose output is steered (None: the block at 7/32 of the depth, WMDP's layer 7 of 32);
    trained_layers: how many blocks, ending at `layer`, have their MLP down-projection trained (WMDP: 3);
    steering: the steering coefficient c as a multiple of the frozen model's mean activation norm at `layer` on the
    forget tokens (adaptive RMU's beta); alpha: the weight of the retain term (WMDP: 1200);
    trainer: the recipe (WMDP: AdamW, lr 5e-5, batches of 4; the epochs repeat a small forget set).
    """

    layer: int | None = None
    trained_layers: int = 3
    steering: float = 5.0
    alpha: float = 1200.0
    seed: int = 0
    trainer: TrainerParams = TrainerParams(lr=5e-5, epochs=10, batch_size=4, grad_accum=1)

    def validate(self) -> None:
        if self.layer is not None and self.layer < 0:
            raise ParamsError(f"RMU's layer must be >= 0, got {self.layer}")
        if self.trained_layers < 1 or self.steering <= 0 or self.alpha < 0:
            raise ParamsError("RMU needs trained_layers >= 1, steering > 0 and alpha >= 0")
        self.trainer.validate()


@dataclass(frozen=True)
class RMURun:
    edit: Edit
    steps: int
    seconds: float
    forward_passes: int


class _Stop(Exception):
    pass


@contextmanager
def block_output(model: nn.Module, name: str) -> Iterator[dict]:
    """Within the block, `run(batch)` returns the output of module `name` (with its graph) and stops the forward
    pass there."""
    got: dict = {}

    def hook(module, args, output):
        got["out"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    handle = model.get_submodule(name).register_forward_hook(hook)

    def run(batch: Batch) -> torch.Tensor:
        with suppress(_Stop):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return got.pop("out")

    try:
        yield run
    finally:
        handle.remove()


def masked_mse(hidden: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions `mask` (B, T) selects of ||hidden - target||^2 / d; `target` broadcasts."""
    err = ((hidden.float() - target.float()) ** 2).mean(-1)
    weights = mask.to(err.dtype)
    return (err * weights).sum() / weights.sum().clamp_min(1)


def steered_layer(params: RMUParams, num_layers: int) -> int:
    layer = round(7 / 32 * num_layers) if params.layer is None else params.layer
    if layer >= num_layers:
        raise ParamsError(f"RMU's layer {layer} does not exist: the model has {num_layers} blocks "
                          f"(0..{num_layers - 1}); pass a lower layer")
    return layer


def run_rmu(model: nn.Module, tokenizer, forget, retain, params: RMUParams, prompt_format: str = "qa",
            adapter: ModelAdapter | None = None) -> RMURun:
    """Train the down-projections of RMU's blocks; return their deltas as an Edit. The model is left as it was."""
    params.validate()
    recipe = params.trainer
    adapter = adapter or ModelAdapter.for_model(model)
    layer = steered_layer(params, adapter.num_layers)
    names = adapter.down_proj_names[max(0, layer - params.trained_layers + 1): layer + 1]
    block = adapter.block_names[layer]
    start, device = time.perf_counter(), model_device(model)
    base_fingerprint = weights_fingerprint(model)
    batches = lambda rows: [b.to(device) for b in make_batches(  # noqa: E731
        tokenizer, as_examples(rows), recipe.batch_size, recipe.max_length, fmt=prompt_format)]
    forget_batches, retain_batches = batches(forget), batches(retain)
    modules = {name: model.get_submodule(name) for name in names}
    originals = {name: m.weight.detach().clone() for name, m in modules.items()}
    flags = {id(p): p.requires_grad for p in model.parameters()}
    was_training = model.training
    rng = random.Random(params.seed)
    generator = torch.Generator().manual_seed(params.seed)
    steps = passes = 0
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.no_grad(), block_output(model, block) as run:
            frozen = [run(b).detach() for b in retain_batches]
            norms = [run(b).float().norm(dim=-1)[b.attention_mask.bool()] for b in forget_batches]
        passes += len(retain_batches) + len(forget_batches)
        coeff = params.steering * float(torch.cat(norms).mean())
        direction = torch.rand(adapter.model.config.hidden_size, generator=generator, dtype=torch.float64)
        control = (coeff * direction / direction.norm()).to(device)
        trained = [m.weight for m in modules.values()]
        for w in trained:
            w.requires_grad_(True)
        optimizer = torch.optim.AdamW(trained, lr=recipe.lr, weight_decay=recipe.weight_decay)
        model.train()
        with block_output(model, block) as run:
            for epoch in range(recipe.epochs):
                order = rng.sample(range(len(forget_batches)), len(forget_batches))
                total_f = total_r = 0.0
                for i in order:
                    fb = forget_batches[i]
                    j = rng.randrange(len(retain_batches))
                    loss_f = masked_mse(run(fb), control, fb.attention_mask)
                    loss_r = masked_mse(run(retain_batches[j]), frozen[j], retain_batches[j].attention_mask)
                    (loss_f + params.alpha * loss_r).backward()
                    if recipe.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(trained, recipe.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    steps, passes = steps + 1, passes + 2
                    total_f, total_r = total_f + loss_f.item(), total_r + loss_r.item()
                log.info("rmu: epoch %d/%d, forget MSE %.4g (c = %.3g), retain MSE %.4g, %d steps", epoch + 1,
                         recipe.epochs, total_f / len(order), coeff, total_r / len(order), steps)
        with torch.no_grad():
            deltas = {}
            for name, m in modules.items():
                diff = m.weight.detach() - originals[name]  # exact in the weights' dtype (Sterbenz)
                diff = diff.T if is_conv1d(m) else diff  # [out, in], as ModuleDelta expects
                deltas[name] = ModuleDelta(name=name, shape=tuple(weight_out_in(m).shape),
                                           dense=diff.cpu().contiguous())
    finally:
        with torch.no_grad():
            for name, m in modules.items():
                m.weight.copy_(originals[name])
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])
            p.grad = None
        model.train(was_training)
    edit = Edit(deltas=deltas, base_fingerprint=base_fingerprint, params={"method": "rmu", **params.to_dict()},
                metadata={"steps": steps, "forward_passes": passes, "layer": layer, "steering_coeff": coeff,
                          "trained": names})
    return RMURun(edit=edit, steps=steps, seconds=time.perf_counter() - start, forward_passes=passes)


def run(model, tokenizer, forget, retain, params: RMUParams, context) -> MethodRun:
    """The registry's entry point (grom_core.methods)."""
    from grom_core.methods import MethodRun

    out = run_rmu(model, tokenizer, forget, retain, params, prompt_format=context.prompt_format,
                  adapter=context.adapter)
    return MethodRun(edit=out.edit, steps=out.steps, forward_passes=out.forward_passes,
                     layers=tuple(range(out.edit.metadata["layer"] - len(out.edit.deltas) + 1,
                                        out.edit.metadata["layer"] + 1)),
                     timings_s={"train": out.seconds})
