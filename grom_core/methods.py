"""The method registry: name -> (typed parameters, entry point returning an Edit).

Every unlearning method, the closed form and the gradient methods alike, is one `Method` entry. Its entry point
takes the model, the tokenizer, the forget and retain examples, its parameters and a `MethodContext`, leaves the
model's weights as they were, and returns a `MethodRun` whose `edit` is applied (and reverted) by the caller:

    entry = get_method("npo")
    run = entry.run(model, tokenizer, forget, retain, entry.params.from_dict({"beta": 0.2}), MethodContext())
    run.edit.apply(model)

The command line's choices and help, `grom bench`'s rows, the flows and the tests all derive from `METHODS`.
Adding a method is one module (its `Params` dataclass and entry point) plus one line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grom_core.errors import DataError
from grom_core.params import Params

if TYPE_CHECKING:
    from grom_core.adapter import ModelAdapter
    from grom_core.edit import Edit
    from grom_core.gradient.methods import MethodParams, Objective
    from grom_core.grom import GromParams
    from grom_core.influence import SolveRecord
    from grom_core.statistics import GramStats, StatsComputer, StatsStore


def load(ref):
    """The object a registry names as "package.module:attribute", imported now; any other value as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class MethodContext:
    """What the caller lends a method besides its data: hand-named modules, where retain statistics are cached or
    computed (used by methods that need them; others ignore it), and the data's prompt format."""

    adapter: ModelAdapter | None = None
    stats_store: StatsStore | None = None
    compute_stats: StatsComputer | None = None
    prompt_format: str = "qa"  # how the data's QA pairs become text (grom_core.data.PROMPT_FORMATS)


@dataclass(frozen=True)
class MethodRun:
    """What a method returns.

    Attributes:
        edit: the weight deltas (unapplied).
        steps: optimizer steps taken (0 for a closed form).
        forward_passes: forward passes over a batch (None where not counted).
        layers: the layers a locate-then-edit method chose.
        layer_scores: one row per layer {"layer", "forget", "retain", "score"} when layers were scored.
        records: module -> the keys and targets its solve used (closed forms; what the influence audit needs).
        retain_stats: module -> the retain statistics the solve used.
        reused_stats: modules whose retain statistics came from a cache.
        timings_s: the method's own stages, in seconds.
        peaks_mb: the peak resident memory of each of those stages, in MB.
    """

    edit: Edit
    steps: int = 0
    forward_passes: int | None = None
    layers: tuple[int, ...] = ()
    layer_scores: tuple[dict, ...] = ()
    records: Mapping[str, SolveRecord] = field(default_factory=dict)
    retain_stats: Mapping[str, GramStats] = field(default_factory=dict)
    reused_stats: tuple[str, ...] = ()
    timings_s: Mapping[str, float] = field(default_factory=dict)
    peaks_mb: Mapping[str, float] = field(default_factory=dict)


EntryPoint = Callable[..., MethodRun]  # (model, tokenizer, forget, retain, params, MethodContext) -> MethodRun


@dataclass(frozen=True)
class Method:
    """A registry entry.

    `params`, `run` and `objective` may be given as the "package.module:attribute" that defines them: they are
    imported on first use, so that listing the registry (the command line's help and choices) loads no torch.

    Attributes:
        name: what users type (`--method NAME`).
        params_ref: its parameter dataclass (a `Params`; defaults are the method's published ones), or where it is.
        run_ref: the entry point, or where it is.
        summary: one line for help texts and tables.
        objective_ref: the forget objective of a gradient method, or where it is (None for other methods).
    """

    name: str
    params_ref: type[Params] | str
    run_ref: EntryPoint | str
    summary: str
    objective_ref: Objective | str | None = None

    @property
    def params(self) -> type[Params]:
        return load(self.params_ref)

    @property
    def run(self) -> EntryPoint:
        return load(self.run_ref)

    @property
    def objective(self) -> Objective | None:
        return load(self.objective_ref)

    @property
    def gradient(self) -> bool:
        """A gradient method (trained with the shared trainer, its gradients composed): known without an import."""
        return self.objective_ref is not None


def closed_form(model, tokenizer, forget, retain, params: GromParams, context: MethodContext) -> MethodRun:
    """GROM. The influence audit is left to the caller (it needs only `records` and `retain_stats`)."""
    from grom_core.grom import run_grom

    run = run_grom(model, tokenizer, forget, retain, params.replace(influence=False), adapter=context.adapter,
                   stats_store=context.stats_store, compute_stats=context.compute_stats,
                   prompt_format=context.prompt_format)
    scores = [{"layer": i, "forget": s, "retain": None, "score": s, "chosen": i in run.plan.layers}
              for i, s in enumerate(run.plan.layer_scores)]
    return MethodRun(edit=run.edit, forward_passes=None, layers=run.plan.layers, layer_scores=tuple(scores),
                     records=run.records, retain_stats=run.retain_stats, reused_stats=tuple(run.reused_stats),
                     timings_s=run.timings_s, peaks_mb=run.peaks_mb)


def gradient_method(name: str, params: type[MethodParams] | str, objective: Objective | str, summary: str
                    ) -> Method:
    """A registry entry for a gradient method: its parameters and its forget objective (each an object or where it
    is), and the shared trainer."""

    def run(model, tokenizer, forget, retain, p: MethodParams, context: MethodContext) -> MethodRun:
        from grom_core.gradient.trainer import train
        from grom_core.profiling import Timings

        clock = Timings()
        with clock.stage("train"):
            out = train(model, tokenizer, forget, retain, p, load(objective), name=name,
                        prompt_format=context.prompt_format)
        return MethodRun(edit=out.edit, steps=out.steps, forward_passes=out.forward_passes,
                         timings_s=clock.seconds, peaks_mb=clock.peak_mb)

    return Method(name, params, run, summary, objective)


DEFAULT_METHOD = "grom"

_GRADIENT = "grom_core.gradient.methods"

METHODS: dict[str, Method] = {
    "grom": Method("grom", "grom_core.grom:GromParams", closed_form,
                   "closed-form edit (forward passes and one solve per module)"),
    "ga": gradient_method("ga", f"{_GRADIENT}:GAParams", f"{_GRADIENT}:GA", "gradient ascent"),
    "graddiff": gradient_method("graddiff", f"{_GRADIENT}:GradDiffParams", f"{_GRADIENT}:GRADDIFF",
                                "gradient difference (ascent on forget, descent on retain)"),
    "npo": gradient_method("npo", f"{_GRADIENT}:NPOParams", f"{_GRADIENT}:NPO", "negative preference optimisation"),
    "simnpo": gradient_method("simnpo", f"{_GRADIENT}:SimNPOParams", f"{_GRADIENT}:SIMNPO", "reference-free NPO"),
    "idkdpo": gradient_method("idkdpo", f"{_GRADIENT}:IdkDPOParams", f"{_GRADIENT}:IDKDPO",
                              "DPO towards 'I don't know' answers"),
    "altpo": gradient_method("altpo", f"{_GRADIENT}:AltPOParams", f"{_GRADIENT}:ALTPO",
                             "alternate preference optimisation: DPO towards in-domain alternative answers"),
    "rmu": Method("rmu", "grom_core.gradient.rmu:RMUParams", "grom_core.gradient.rmu:run",
                  "representation misdirection: forget activations of a middle layer pushed to a random vector"),
    "rome": Method("rome", "grom_core.editors.rome:RomeParams", "grom_core.editors.rome:run",
                   "rank-one edit of one layer per fact, v* giving the fact up"),
    "memit": Method("memit", "grom_core.editors.memit:MemitParams", "grom_core.editors.memit:run",
                    "least-squares edit of a band of layers for many facts"),
    "alphaedit": Method("alphaedit", "grom_core.editors.alphaedit:AlphaEditParams", "grom_core.editors.alphaedit:run",
                        "MEMIT's edit projected onto the null space of the retain keys"),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise DataError(f"unknown method '{name}'; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def method_params(name: str, values: Mapping | None = None) -> Params:
    """The parameters of method `name` from a JSON-like mapping (checked: unknown keys, types, ranges)."""
    method = get_method(name)
    if "compose" in (values or {}) and not method.gradient:
        raise DataError(f"compose applies to gradient methods only; {name} has no gradients to compose")
    return method.params.from_dict(values)


def methods_help() -> str:
    return "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())


def refit_without(method: str, model, tokenizer, forget: Sequence, retain: Sequence, params: Params, edit: Edit,
                  examples: Sequence[int], context: MethodContext | None = None) -> list[dict]:
    """The real change of each module's delta when forget example i is left out and the method is run again.

    The check of an influence audit: the audit's leave-one-out values are exact for one module with everything
    else held fixed (keys, targets, specificity weights, layer choice, c = w_forget / s); a real refit lets all of
    those move. Returns one row per (example, module): {"example_index", "module", "actual"}, the Frobenius norm
    of the difference of the deltas (a module that only one of the two edits touches counts whole)."""
    entry = get_method(method)
    rows = []
    for index in examples:
        if not 0 <= index < len(forget):
            raise DataError(f"forget example {index} does not exist (0..{len(forget) - 1})")
        kept = [row for i, row in enumerate(forget) if i != index]
        if not kept:
            raise DataError("a refit needs at least two forget examples")
        refit = entry.run(model, tokenizer, kept, retain, params, context or MethodContext()).edit
        for module in sorted(set(edit.deltas) | set(refit.deltas)):
            mine, theirs = edit.deltas.get(module), refit.deltas.get(module)
            actual = mine.distance(theirs) if mine is not None else theirs.distance(None)
            rows.append({"example_index": index, "module": module, "actual": actual})
    return rows
