"""ROME (Meng et al. 2022, "Locating and Editing Factual Associations in GPT") as an unlearning method: one layer,
one rank-one update per fact, applied one fact after the other (sequential ROME, the way it edits many facts)."""

from __future__ import annotations

from dataclasses import dataclass

from grom_core.adapter import ModelAdapter
from grom_core.edit import Edit, ModuleDelta
from grom_core.editors.facts import (
    EditorParams,
    capture_at,
    chosen_layers,
    covariance,
    start_edit,
)
from grom_core.editors.updates import rome_updates
from grom_core.params import ParamsError
from grom_core.profiling import Timings

LAYER = 0.18  # ROME's layer 5 of GPT-J's 28, as a fraction of the depth


@dataclass(frozen=True)
class RomeParams(EditorParams):
    """ROME edits one layer (`layers`: one index, or None for `LAYER` of the depth). relative_ridge: added to
    C's diagonal as a fraction of its mean eigenvalue, so that C is invertible on little retain data (ROME's C comes
    from 100k Wikipedia samples and needs none)."""

    relative_ridge: float = 1e-3

    def validate(self) -> None:
        super().validate()
        if self.layers is not None and len(set(self.layers)) != 1:
            raise ParamsError(f"ROME edits one layer; got layers {list(self.layers)} (MEMIT spreads over several)")
        if self.relative_ridge < 0:
            raise ParamsError("need relative_ridge >= 0")


def run(model, tokenizer, forget, retain, params: RomeParams, context):
    from grom_core.methods import MethodRun

    clock = Timings()
    adapter = context.adapter or ModelAdapter.for_model(model)
    layer = chosen_layers(params, adapter, LAYER, LAYER)[0]
    name = adapter.down_proj_names[layer]
    start = start_edit(model, tokenizer, forget, retain, params, context, adapter, [layer], clock)
    facts, stats, delta, info = start.facts, start.stats, start.delta, start.info
    with clock.stage("keys"):
        keys = capture_at(model, facts.batches, facts.masks, inputs=[name])[name]  # (N, in)
    with clock.stage("solve"):
        cov = covariance(stats[name])
        ridge = params.relative_ridge * float(cov.diagonal().mean())
        left, right = rome_updates(keys.T, delta.T, cov, ridge)  # v* - W k = delta: the residual of each fact
    edit = Edit(deltas={name: ModuleDelta.from_factors(name, left, right)}, base_fingerprint=start.fingerprint,
                params={"method": "rome", **params.to_dict()},
                metadata={"layers": [layer], "modules": [name], "forget_examples": len(facts.examples),
                          "value_steps": info["steps"], "facts_above_target": info["facts_above"]})
    return MethodRun(edit=edit, steps=info["steps"], layers=(layer,), retain_stats=stats,
                     reused_stats=tuple(start.reused),
                     timings_s=clock.seconds)
