"""A batch of facts written into a band of layers, MEMIT's way: v* at the band's last layer, the missing output
spread over the layers from the lowest up, each layer solved with the keys the edits below it produce.

MEMIT and AlphaEdit differ only in the update each layer solves (`updates.memit_update`,
`updates.alphaedit_update`); this module is the procedure around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from grom_core.adapter import ModelAdapter
from grom_core.edit import Edit, ModuleDelta
from grom_core.editors.facts import (
    EditorParams,
    capture_at,
    chosen_layers,
    covariance,
    start_edit,
)
from grom_core.profiling import Timings

log = logging.getLogger(__name__)

# (keys (in, N), residuals (out, N), retain covariance C (in, in)) -> (left (out, N), right (N, in))
LayerUpdate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

BAND = (0.11, 0.29)  # MEMIT's layers 3-8 of GPT-J's 28, as fractions of the depth


def edit_band(model, tokenizer, forget, retain, params: EditorParams, context, method: str, update: LayerUpdate):
    """The edit and what it was made from (a `grom_core.methods.MethodRun`); the model is left unchanged."""
    from grom_core.methods import MethodRun

    clock = Timings()
    adapter = context.adapter or ModelAdapter.for_model(model)
    layers = chosen_layers(params, adapter, *BAND)
    modules = [adapter.down_proj_names[layer] for layer in layers]
    start = start_edit(model, tokenizer, forget, retain, params, context, adapter, layers, clock)
    facts, stats, info = start.facts, start.stats, start.info
    last = adapter.block_names[layers[-1]]
    with clock.stage("targets"):
        targets = capture_at(model, facts.batches, facts.masks, outputs=[last])[last] + start.delta  # (N, hidden)
    deltas: dict[str, ModuleDelta] = {}
    with clock.stage("solve"):
        for i, (layer, name) in enumerate(zip(layers, modules, strict=True)):
            edits = Edit(deltas=dict(deltas), base_fingerprint="")
            with edits.applied(model, verify=False):
                got = capture_at(model, facts.batches, facts.masks, inputs=[name], outputs=[last])
            # this layer's share of what is still missing at the last layer (MEMIT's residual spreading)
            residuals = (targets - got[last]).T / (len(layers) - i)
            left, right = update(got[name].T, residuals, covariance(stats[name]))
            deltas[name] = ModuleDelta.from_factors(name, left, right)
            log.info("%s: layer %d solved, %d facts, mean residual %.3g", method, layer, residuals.shape[1],
                     float(residuals.norm(dim=0).mean()))
    edit = Edit(deltas=deltas, base_fingerprint=start.fingerprint, params={"method": method, **params.to_dict()},
                metadata={"layers": layers, "modules": modules, "forget_examples": len(facts.examples),
                          "value_steps": info["steps"], "facts_above_target": info["facts_above"]})
    return MethodRun(edit=edit, steps=info["steps"], layers=tuple(layers), retain_stats=stats,
                     reused_stats=tuple(start.reused), timings_s=clock.seconds)
