"""`grom bench --ablation`: the closed form's design choices, one row each, on one benchmark in one process.

Every row starts from the parameters `grom bench` gives the closed form on that benchmark (its `params_for`) and
changes one thing; the row "library defaults" is GromParams() with only the benchmark's target kind, which is what
issue 13's "one default" asks of every benchmark. The retain statistics are computed once and shared by every row
that edits the same modules on the same data (a memory store): the first row that needs a module's statistics
pays for their pass, the others time their forget passes and solves. A row whose edit gives the model the same
weights as an earlier row's (a change that is a no-op on this data, such as "keys at answers" where the defaults
already key the answers) shares that row's evaluation and says so (`same_weights_as`).

Rows of the caller's own (`custom_row`, `grom bench --ablation --params JSON`) change the library defaults by a
JSON object of GromParams fields, so that a setting tried on the way to a default is a command anyone can rerun.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from flows.bench import attack_kit, evaluate_with_attacks, split_attacks
from flows.evaluation import build_benchmark, reference_path, sized_config
from flows.workspace import Workspace
from grom_core.adapter import ModelAdapter
from grom_core.benchmarks.registry import get_benchmark
from grom_core.data import Example, as_examples
from grom_core.edit import Edit
from grom_core.errors import DataError
from grom_core.gradient.methods import TrainerParams
from grom_core.grom import GromParams, run_grom
from grom_core.grom.plan import resolve_keys_and_drops
from grom_core.params import merged
from grom_core.profiling import measure
from grom_core.statistics import MemoryStatsStore
from tasks.records import EvaluationSpec
from tasks.steps import evaluate_loaded, load_for_edit

log = logging.getLogger("grom.ablation")


@dataclass(frozen=True)
class Ablation:
    """One row: a name, why it is there, and the change it makes to the benchmark's parameters."""

    name: str
    why: str
    change: Callable[[GromParams, int], dict | None]  # (base parameters, the model's number of layers) -> changes
    targets: tuple[str, ...] = ("suppress", "corrupt")  # the target kinds the row applies to
    subjects: bool = False  # applies only to forget data that names its subjects (fact benchmarks)
    drops: tuple[str, ...] = ("specificity", "counterfactual", "sentence")  # the base's drop kinds it changes


MEASURED = ("counterfactual", "sentence")  # the drop kinds measured on the model, which gain scales


def scaled_beta(params: GromParams, factor: float) -> dict:
    """`factor` times the specificity drop: beta where it is set, else the multiple of the measured margin."""
    spec = params.specificity
    if spec.beta is None:
        return {"specificity": {"margins": spec.margins * factor}}
    return {"specificity": {"beta": spec.beta * factor}}


ABLATIONS: tuple[Ablation, ...] = (
    Ablation("benchmark parameters", "what `grom bench` runs on this benchmark", lambda p, n: {}),
    Ablation("library defaults", "GromParams() with the benchmark's target kind: the one default", lambda p, n: None),
    Ablation("beta x0.5", "half the logit drop asked for", lambda p, n: scaled_beta(p, 0.5), ("suppress",),
             drops=("specificity",)),
    Ablation("beta x2", "twice the logit drop asked for", lambda p, n: scaled_beta(p, 2.0), ("suppress",),
             drops=("specificity",)),
    Ablation("word starts only", "pieces inside a word are not suppressed",
             lambda p, n: {"specificity": {"word_starts_only": True}}, ("suppress",), drops=("specificity",)),
    Ablation("no LM head", "down-projections only", lambda p, n: {"edit_lm_head": False}, ("suppress",)),
    Ablation("parallel solve", "every module from the original keys, an equal share each",
             lambda p, n: {"strategy": "parallel"}),
    Ablation("weak retain constraint", "w_retain 1 instead of the parameters' value", lambda p, n: {"w_retain": 1.0}),
    Ablation("ridge x100", "a hundred times the relative ridge",
             lambda p, n: {"relative_ridge": p.relative_ridge * 100}),
    Ablation("keys at answers", "forget keys at the answer positions (where the answers restate their subject, as the "
             "defaults do)", lambda p, n: {"keys": "answer"}, ("suppress",), subjects=True),
    Ablation("keys at subjects", "forget keys at the subjects' last tokens (where the answers are bare objects, as "
             "the defaults do)", lambda p, n: {"keys": "subject"}, ("suppress",), subjects=True),
    Ablation("keys at subjects and answers", "forget keys at the subjects' last tokens and the answer positions",
             lambda p, n: {"keys": "subject+answer"}, ("suppress",), subjects=True),
    Ablation("specificity drops", "beta * a(y) at every answer position, not the measured gaps (counterfactual or "
             "sentence)", lambda p, n: {"drops": "specificity"}, ("suppress",), drops=MEASURED),
    Ablation("answers after an empty question", "sentence drops rate a QA row's answer after an empty question, "
             "not after the retain questions nearest to its own (swaps=0)", lambda p, n: {"sentence": {"swaps": 0}},
             ("suppress",), drops=("sentence",)),
    Ablation("drops by position", "each position lowers its own next token by its own gap (scope='position'), "
             "not its subject's whole bag", lambda p, n: {"counterfactual": {"scope": "position"}}, ("suppress",),
             drops=("counterfactual",)),
    Ablation("whole-name strangers", "the strangers replace every word of the subject, not its first: no drop on the "
             "rest of the name", lambda p, n: {"counterfactual": {"rename": "whole"}}, ("suppress",),
             drops=("counterfactual",)),
    Ablation("answers after their own question only", "each forget answer read after its own question, not also "
             "after another question of its subject (contexts=0)", lambda p, n: {"counterfactual": {"contexts": 0}},
             ("suppress",), drops=("counterfactual",)),
    Ablation("gain x0.5", "half the measured gap's multiple", lambda p, n: {"gain": p.gain / 2}, ("suppress",),
             drops=MEASURED),
    Ablation("gain x2", "twice the measured gap's multiple", lambda p, n: {"gain": p.gain * 2}, ("suppress",),
             drops=MEASURED),
    Ablation("no retain budget", "the edit at its full drop, whatever it costs the retain sample",
             lambda p, n: {"retain_budget": None}, ("suppress",)),
    Ablation("LM head alone", "the LM head alone, not weighed against the attributed band under the retain budget",
             lambda p, n: {"layers": ()}, ("suppress",), drops=("specificity",)),
    Ablation("defaults with forget target 0.05", "GromParams() scaled to the smallest edit that brings the "
             "forget answers' probability to 0.05, instead of the full drop (forget_target)",
             lambda p, n: {**GromParams(target=p.target, influence=False).to_dict(), "forget_target": 0.05},
             ("suppress",), drops=("specificity",)),
    Ablation("every layer", "every layer of the model is edited (below the LM head, which lowers a subject's bag, "
             "the layers lower each position's own token)", lambda p, n: {"layers": tuple(range(n))},
             drops=("specificity", "counterfactual")),
    Ablation("last two layers", "a band of two at the top, where attribution puts it on minimuse, instead of every "
             "layer", lambda p, n: {"layers": tuple(range(max(0, n - 2), n))}, drops=("sentence",)),
    Ablation("other target kind", "corruption on a generation benchmark, suppression on multiple choice",
             lambda p, n: {"target": "corrupt" if p.target == "suppress" else "suppress"}),
)


def custom_row(changes: Mapping[str, object]) -> Ablation:
    """A row of the caller's own: the library defaults with the benchmark's target kind, changed by `changes`
    (GromParams field -> JSON value), named by its JSON. It applies to any data."""
    changes = dict(changes)
    name = json.dumps(changes)
    return Ablation(name, f"the library defaults with {name}",
                    lambda p, n: merged(GromParams(target=p.target, influence=False).to_dict(), changes))


def ablation_params(base: GromParams, row: Ablation, target: str, num_layers: int) -> GromParams:
    """The row's parameters: its change over `base`, or (change None) the library defaults with `target`."""
    changes = row.change(base, num_layers)
    if changes is None:
        return GromParams(target=target, influence=False)
    return base.replace(**changes)


def applicable_rows(rows: Sequence[Ablation], base: GromParams, forget: Sequence[Example]) -> list[Ablation]:
    """The rows that can change anything on this data: those of the base's target kind, of the drop kind "auto"
    resolves to for these forget rows, and (rows about subjects) only where the rows name their subjects."""
    named = any(ex.subject is not None for ex in forget)
    _, drops = resolve_keys_and_drops(base, forget)
    return [r for r in rows if base.target in r.targets and (named or not r.subjects) and drops in r.drops]


def run_ablation(home: str | None = None, benchmark: str = "minitofu", split: str | None = None,
                 rows: tuple[str, ...] | None = None, authors: int | None = None,
                 config: Mapping[str, object] | None = None, custom: Sequence[Mapping[str, object]] = (),
                 attacks: Sequence[str] = ()) -> dict:
    """Evaluate every ablation row (or those named in `rows`), then a `custom_row` for each of `custom` (given
    alone, they replace the full list), on the benchmark's target model (of the benchmark's data with `config`'s
    fields, see `sized_config`), and again after each attack in `attacks` (quantization round trips, names of
    grom_core.quantization.quantizers, and attacks that read around the edit, grom_core.attacks.ATTACKS), so that
    a row shows whether its forgetting survives them. Unknown row names, parameters and attacks are refused before
    any work; an attack this machine cannot run (bitsandbytes missing) is left out with a warning.

    Returns {"benchmark", "split", "columns" (the benchmark's table metrics), "forget_metric" (the one whose
    recovery is reported), "attacks" (those run), "before" (the unedited model's metrics), "rows": [{"name",
    "why", "params", "seconds", "layers", "forget_positions", "logit_drop", "metrics", "quantized" (attack ->
    metrics with "recovery_<forget_metric>": after the attack minus before it, and "recovery", the headline
    one), "same_weights_as" (the earlier row whose edit gave the model the same weights, whose evaluation the row
    shares; None)}]}.
    """
    bench = get_benchmark(benchmark)
    chosen = [r for r in ABLATIONS if (rows is None and not custom) or r.name in (rows or ())]
    unknown = sorted(set(rows or ()) - {r.name for r in ABLATIONS})
    if unknown:
        raise DataError(f"no ablation row named {', '.join(map(repr, unknown))}; rows: "
                        f"{', '.join(r.name for r in ABLATIONS)}")
    base = GromParams.from_dict({**bench.params_for("grom", False), "influence": False})
    own = [custom_row(changes) for changes in custom]
    for row in own:
        ablation_params(base, row, base.target, 1)  # a ParamsError names the field now, not after a build
    chosen += own
    quants, reading = split_attacks(attacks)
    ws = Workspace.resolve(home)
    built = build_benchmark(benchmark, None, str(ws.root), split, config=sized_config(benchmark, authors, config))
    forget, retain = built.unlearning_inputs()
    spec = EvaluationSpec(benchmark=benchmark, split=built.split, reference=str(reference_path(built)),
                          splits={k: str(v) for k, v in built.splits.items()})
    model, tokenizer = load_for_edit(str(built.models["target"]))
    kit = attack_kit(model, tokenizer, spec, bench, forget, retain, TrainerParams.from_dict(bench.trainer))
    before = evaluate_loaded(model, tokenizer, spec)
    store = MemoryStatsStore()  # retain statistics shared by rows that edit the same modules
    out = []
    evaluated: dict[str, dict] = {}  # weights digest -> the first row that gave those weights
    applicable = applicable_rows(chosen, base, as_examples(forget))
    num_layers = ModelAdapter.for_model(model).num_layers
    for i, row in enumerate(applicable):
        params = ablation_params(base, row, base.target, num_layers)
        with measure() as cost:
            run = run_grom(model, tokenizer, forget, retain, params, stats_store=store,
                           prompt_format=bench.prompt_format)
        digest = weights_digest(run.edit)
        first = evaluated.get(digest)
        if first is None:
            with run.edit.applied(model):
                metrics, attacked = evaluate_with_attacks(model, tokenizer, spec, quants, bench.metrics.forget, kit,
                                                          reading)
        else:  # the same weights as an earlier row (a change that is a no-op on this data): the same figures
            metrics, attacked = first["metrics"], first["quantized"]
        out.append({"name": row.name, "why": row.why, "params": params.to_dict(), "seconds": cost.seconds,
                    "layers": run.layers, "plan": run.plan.as_dict(),
                    "forget_positions": run.manifest.forget_positions,
                    "logit_drop": asdict(run.manifest.logit_drop), "scaling": asdict(run.manifest.scaling),
                    "metrics": metrics,
                    "quantized": attacked, "same_weights_as": first["name"] if first else None})
        evaluated.setdefault(digest, out[-1])
        log.info("ablation %d/%d %s: %.2f s, %s", i + 1, len(applicable), row.name, cost.seconds,
                 ", ".join(f"{k} {metrics[k]:.3g}" for k in bench.metrics.table[:3]
                           if isinstance(metrics.get(k), float)))
    return {"benchmark": benchmark, "split": built.split, "columns": list(bench.metrics.table),
            "forget_metric": bench.metrics.forget, "attacks": [*quants, *reading], "before": before, "rows": out}


def weights_digest(edit: Edit) -> str:
    """A hash over the edit's factor bytes alone (not its parameters): two rows with the same digest give the
    model the same weights, so their evaluations are the same."""
    return Edit(deltas=edit.deltas, base_fingerprint=edit.base_fingerprint).edit_id
