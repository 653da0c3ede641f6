"""GROM's entry point, its four steps in order:

    plan, inputs = make_plan(...)       # 1. every automatic choice, once (keys, drops, layers, placement)
    stats = retain_statistics(...)      # 2. the retain Gram matrix of every edited module (cached by content)
    solved = solve(...)                 # 3. targets and one ridge least-squares solve per module
    scaling = scale_edit(...)           # 4. alpha * P within the retain budget (and to the forget target)

Everything is forward passes and float64 linear algebra; no gradient is taken, and the model is never changed:
the result is an Edit value that the caller applies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from torch import nn

from grom_core.adapter import ModelAdapter
from grom_core.data import Example, PromptFormat
from grom_core.edit import Edit
from grom_core.grom.params import GromParams
from grom_core.grom.plan import Inputs, Plan, make_plan
from grom_core.grom.scaling import Scaling, scale_edit
from grom_core.grom.solve import BodyFirst, LogitDrop, Solved, scaled_record, solve
from grom_core.influence import InfluenceReport, SolveRecord, audit
from grom_core.profiling import Timings
from grom_core.readout import NllProbe
from grom_core.statistics import GramStats, StatsComputer, StatsStore, retain_statistics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manifest:
    """What an edit was made from and what each step measured; stored as the edit's metadata (`as_dict`)."""

    plan: Plan
    forget_digest: str
    retain_digest: str
    forget_examples: int
    retain_examples: int
    forget_positions: int
    retain_positions: dict[str, int]
    logit_drop: LogitDrop  # as solved, before scaling
    scaling: Scaling
    body_first: BodyFirst | None = None

    def as_dict(self) -> dict:
        return {**asdict(self), "plan": self.plan.as_dict()}


@dataclass
class GromRun:
    """The result of `run_grom`: the edit, its plan and manifest, and what the influence audit needs."""

    edit: Edit
    manifest: Manifest
    retain_stats: dict[str, GramStats]
    records: dict[str, SolveRecord] = field(default_factory=dict)
    influence: dict[str, InfluenceReport] = field(default_factory=dict)
    reused_stats: list[str] = field(default_factory=list)  # modules whose retain statistics came from a cache
    timings_s: dict[str, float] = field(default_factory=dict)
    peaks_mb: dict[str, float] = field(default_factory=dict)  # each stage's peak resident memory

    @property
    def plan(self) -> Plan:
        return self.manifest.plan

    @property
    def layers(self) -> list[int]:
        return list(self.plan.layers)


def run_grom(model: nn.Module, tokenizer, forget: Sequence[Example | dict | tuple | str],
             retain: Sequence[Example | dict | tuple | str], params: GromParams | None = None, *,
             adapter: ModelAdapter | None = None, retain_stats: Mapping[str, GramStats] | None = None,
             stats_store: StatsStore | None = None, compute_stats: StatsComputer | None = None,
             prompt_format: str | PromptFormat = "qa") -> GromRun:
    """The closed-form unlearning edit of `model` (a Hugging Face causal LM, not modified) for `forget` keeping
    `retain` (QA pairs or texts: Example, dicts, tuples, strings, in `prompt_format`: qa, completion, chat).

    `adapter` names the modules of an architecture the adapter does not know. Retain statistics are taken from
    `retain_stats` (checked against this model and retain data), then `stats_store`, else computed (by
    `compute_stats` where given, e.g. on a Dask cluster) and saved to the store.
    """
    params = params or GromParams()
    clock = Timings()
    with clock.stage("plan"):
        plan, inputs = make_plan(model, tokenizer, forget, retain, params, adapter, fmt=prompt_format)
    with clock.stage("retain_statistics"):
        stats, reused = retain_statistics(model, inputs, plan.modules, retain_stats, store=stats_store,
                                          compute=compute_stats)
    with clock.stage("retain_probe"):
        probe = retain_probe(model, inputs, plan)
    with clock.stage("solve"):
        solved = solve(model, inputs, plan, stats, params, probe)
    with clock.stage("scale"):
        scaling = scale_edit(model, solved.deltas, inputs.adapter.lm_head_name, probe,
                             params.retain_budget if plan.budget else None, inputs.forget_sample, params.forget_target)
    run = _edit(inputs, plan, params, solved, scaling, stats, reused)
    if params.influence:
        with clock.stage("influence"):
            run.influence = audit(run.records, stats)
    run.timings_s, run.peaks_mb = clock.seconds, clock.peak_mb
    log.info("GROM edit %s: %d modules, %d forget positions, scale %.3f, %s", run.edit.edit_id, len(plan.modules),
             run.manifest.forget_positions, scaling.scale, clock.summary())
    return run


def retain_probe(model: nn.Module, inputs: Inputs, plan: Plan) -> NllProbe | None:
    """The retain sample's NLL reader (one forward pass), shared by a body-first band's budget and the final scale;
    it keeps the stream entering the lowest edited layer, so that reading an update of the band costs a pass
    through the band and the layers above only. None without a retain budget."""
    if not plan.budget or inputs.retain_sample is None:
        return None
    blocks = inputs.adapter.block_names[0].rpartition(".")[0]
    return NllProbe(model, inputs.retain_sample, inputs.adapter.lm_head_name,
                    from_block=(blocks, min(plan.layers)) if plan.layers else None)


def _edit(inputs: Inputs, plan: Plan, params: GromParams, solved: Solved, scaling: Scaling,
          stats: dict[str, GramStats], reused: list[str]) -> GromRun:
    """The Edit of the scaled updates, its manifest and solve records."""
    deltas = {name: delta.scaled(scaling.scale) for name, delta in solved.deltas.items()}
    records = {name: scaled_record(rec, scaling.scale) for name, rec in solved.records.items()}
    manifest = Manifest(plan=plan, forget_digest=inputs.forget_digest, retain_digest=inputs.retain_digest,
                        forget_examples=len(inputs.forget), retain_examples=len(inputs.retain),
                        forget_positions=int(next(iter(records.values())).keys.shape[1]),
                        retain_positions={m: stats[m].count for m in plan.modules}, logit_drop=solved.logit_drop,
                        scaling=scaling, body_first=solved.body_first)
    edit = Edit(deltas=deltas, base_fingerprint=inputs.fingerprint, params={**params.to_dict(), "method": "grom"},
                metadata=manifest.as_dict())
    return GromRun(edit=edit, manifest=manifest, retain_stats=stats, records=records, reused_stats=reused)


def compute_edit(model: nn.Module, tokenizer, forget, retain, params: GromParams | None = None, **kwargs) -> Edit:
    """`run_grom(...).edit`: the Edit alone."""
    return run_grom(model, tokenizer, forget, retain, params, **kwargs).edit
