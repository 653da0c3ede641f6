"""The `unlearn` flow, read top to bottom as the pipeline:

    ingest -> load the model (once) -> unlearn (the method: for GROM layer scores, retain statistics (cached),
           solve) -> evaluate before -> apply and save -> influence audit -> evaluate after
           -> quantization attack -> attacks that read around the edit -> report
           -> register (MLflow: the edit over the version holding the unedited weights) and commit (DuckDB
              catalog), one Prefect transaction

Each stage is a Prefect task exchanging the typed records of `tasks.records`; the registration and the catalog
commit run in one transaction, so a failed commit rolls the registration back (its rollback hook deletes the
version) and leaves the catalog and the registry as they were.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.transactions import transaction

from flows.formatting import fmt
from flows.reconcile import reconcile
from flows.runtime import kill_point
from flows.workspace import Workspace
from grom_core.profiling import Timings
from tasks import steps
from tasks.catalog import now, record_run
from tasks.names import safe_name
from tasks.plots import influence_plot, layer_scores_plot
from tasks.records import EvaluationSpec, Outcome
from tasks.requests import claim_owner
from tasks.tracking import Registration, check_model_name, register
from tasks.versions import EDIT, STORAGE_TAG, root_version

log = logging.getLogger("grom.flow")


@flow(name="unlearn")
def unlearn(model: str, forget: str, retain: str, home: str | None = None, method: str = "grom",
            params: dict | None = None, evaluation: EvaluationSpec | None = None, model_name: str | None = None,
            workers: int = 0, dask_address: str | None = None, tags: dict | None = None,
            quantization: bool = True, prompt_format: str = "qa", quantizers: list[str] | None = None,
            attacks: list[str] | None = None, max_examples: int = 200) -> dict:
    """Unlearn `forget` from the model in `model` while keeping `retain`; register the edited model.

    Args:
        model: local model directory (save_pretrained, safetensors).
        forget, retain: data files (JSON, JSONL, Parquet or CSV with question/answer or text columns).
        home: workspace folder (default ./.grom or GROM_HOME).
        method: a name in the method registry (`grom_core.methods.METHODS`).
        params: the method's parameters (fields of its Params dataclass; checked before any work).
        evaluation: a shipped benchmark's split to evaluate with; None evaluates probability and ROUGE-L on the
            forget and retain data themselves.
        model_name: registered model name in MLflow (default from the benchmark or the model folder).
        workers: shard the retain statistics over a local Dask cluster of this many processes (0: in process).
        dask_address: an existing Dask scheduler (tcp://host:8786) instead.
        tags: extra tags for the MLflow run and model version (e.g. deletion request ids).
        quantization: run the robustness checks on the edited model: the quantization recovery attacks (reported
            under metrics.quantized) and the attacks that read around the edit (metrics.attacks).
        quantizers, attacks: with `quantization`, which of each to run (None: every available quantization attack
            and `steps.READING_ATTACKS`).
        prompt_format: how the data's QA pairs become text, for the keys, the targets and the own-data metrics:
            qa, completion (a pretrained base model's) or chat (grom_core.data.PROMPT_FORMATS).
        max_examples: without `evaluation`, how many forget and how many retain rows the own-data evaluation reads.
    """
    ws = Workspace.resolve(home)
    name = check_model_name(model_name or (f"grom-{evaluation.benchmark}-{evaluation.split}"
                                           if evaluation and evaluation.benchmark
                                           else f"grom-{safe_name(Path(model).name)}"))
    reconcile(ws.root, ws.catalog(), name)  # what a killed run of this name left behind
    started, timings = now(), Timings(log, after_stage=kill_point)
    outcome = compute(timings, ws, model=model, forget=forget, retain=retain, method=method, params=params or {},
                      evaluation=evaluation, workers=workers, dask_address=dask_address,
                      quantizers=quantizers if quantization else [], prompt_format=prompt_format,
                      attacks=attacks if quantization else [], max_examples=max_examples)
    with transaction():
        registration = timings.run("register", register_outcome, ws, outcome, name=name,
                                   tags={"grom.kind": "unlearn", "grom.owner": claim_owner(), **(tags or {})},
                                   timings=timings.seconds)
        stage_timings = run_timings(timings, outcome)
        commit(ws, outcome.catalog_rows(registration, flow="unlearn", started=started, timings=stage_timings))
    result = outcome.summary(registration, stage_timings, ws.root, run_peaks(timings, outcome))
    publish(result)
    return result


def compute(timings: Timings, ws: Workspace, *, model: str | steps.LoadedModel, forget: str, retain: str,
            method: str, params: dict, evaluation: EvaluationSpec | None, workers: int = 0,
            dask_address: str | None = None, quantizers: list[str] | None = None, max_examples: int = 200,
            prompt_format: str = "qa", attacks: list[str] | None = None) -> Outcome:
    """Everything before registration. Writes only content-addressed files under the workspace's lake, edits
    and models folders, so a failure here leaves the catalog and the registry untouched.

    `model`: a folder, loaded once here, or a model the caller loaded (`steps.load`); either way the tasks share
    one copy, edited in place by `apply_and_save`. `quantizers`: the quantization attacks to run (None: every
    available one; []: none); `attacks`: those that read around the edit (grom_core.attacks; None:
    `steps.READING_ATTACKS`; []: none). `max_examples`: the own-data evaluation's size when `evaluation` is None."""
    lake_root = str(ws.root / "lake")
    data = timings.run("ingest", steps.ingest, forget, retain, lake_root)
    loaded = model if isinstance(model, steps.LoadedModel) else timings.run("load", steps.load, model)
    unlearned = timings.run("unlearn", steps.unlearn, loaded, data, method, params, lake_root, str(ws.edits),
                            workers, dask_address, prompt_format)
    spec = evaluation or EvaluationSpec(forget=data.forget.path, retain=data.retain.path, max_examples=max_examples,
                                        prompt_format=prompt_format)
    cache_root = str(ws.root / "cache" / "evaluations")
    before = timings.run("evaluate_before", steps.evaluate, loaded, spec, cache_root)
    edited = timings.run("apply_and_save", steps.apply_and_save, loaded, unlearned, str(ws.models))
    audit = timings.run("influence", steps.influence_audit, unlearned, data, lake_root)
    after = timings.run("evaluate_after", steps.evaluate, loaded, spec, cache_root)
    quantized, read = {}, {}
    if quantizers != []:
        quantized = timings.run("quantization", steps.quantization_check, loaded, unlearned, spec,
                                dict(after.metrics), quantizers)
    if attacks != []:
        read = timings.run("read_around", steps.read_around, loaded, data, spec, dict(after.metrics), attacks)
    plots = ws.root / "lake" / "plots" / unlearned.edit_id
    outcome = Outcome(model=loaded.model_dir, ingested=data, unlearned=unlearned, edited=edited, audit=audit,
                      before=before.metrics, after=after.metrics, quantized=quantized, plots=str(plots),
                      attacks=read)
    write_report(outcome, timings.seconds)
    return outcome


def run_timings(timings: Timings, outcome: Outcome) -> dict:
    """Stage seconds of a run as reported: the flow's stages, the method's own ones, the unlearning, the total."""
    return {**timings.seconds, **outcome.unlearned.timings_s, "unlearning": outcome.unlearned.cost.seconds,
            "total": timings.total()}


def run_peaks(timings: Timings, outcome: Outcome) -> dict:
    """Peak resident memory (MB) of each stage of a run: the flow's and the method's own."""
    return {**timings.peak_mb, **outcome.unlearned.peaks_mb}


@task(name="register", cache_policy=NO_CACHE)
def register_outcome(ws: Workspace, outcome: Outcome, *, name: str, tags: dict, timings: dict,
                     parent_version: str | None = None) -> Registration:
    """Log the run to MLflow and register the edit as a new version of `name` over `parent_version` (default: the
    version holding the unedited weights, registered first if `name` has none): the version stores the edit, not
    the weights (`tasks.versions` materialises them). In the caller's transaction, a failure after this task
    deletes what it registered (tracking.register's hooks)."""
    u, data = outcome.unlearned, outcome.ingested
    parent = parent_version or root_version(ws.root, name, outcome.model, u.base_fingerprint)
    version_tags = {STORAGE_TAG: EDIT, "parent_version": parent,
                    "base_fingerprint": u.base_fingerprint, "edit_id": u.edit_id, "method": u.method,
                    "compose": str(u.params.get("compose") or ""), "forget_digest": data.forget.digest,
                    "retain_digest": data.retain.digest, "model_dir": outcome.edited.model_dir,
                    "fingerprint": outcome.edited.fingerprint, **{k: str(v) for k, v in tags.items()}}
    artifacts = {"edit": Path(u.edit_dir), "plots": Path(outcome.plots)}
    if outcome.audit:
        artifacts["influence"] = Path(outcome.audit.path)
    numbers = {k: v for k, v in u.as_json().items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return register(ws.root, run_name=f"unlearn-{u.method}-{u.edit_id}", model_name=name,
                    params={**u.params, "method": u.method, "layers_chosen": list(u.layers),
                            "modules": list(u.modules), "model_dir": outcome.model},
                    metrics={"before": outcome.before, "after": outcome.after,
                             **{f"quantized.{q}": m for q, m in outcome.quantized.items() if isinstance(m, dict)},
                             "timing": {**timings, **u.timings_s, "unlearning": u.cost.seconds},
                             "unlearning": numbers},
                    datasets=[_input(data.forget), _input(data.retain)], artifacts=artifacts, model_dir=None,
                    version_source="edit", tags=version_tags)


def _input(dataset) -> dict:
    return {"name": dataset.name, "role": dataset.role, "digest": dataset.digest, "path": dataset.path}


@task(name="commit", cache_policy=NO_CACHE)
def commit(ws: Workspace, rows: dict, also=None) -> None:
    """The commit point: every catalog row of the run in one DuckDB transaction (`also(con)` writes more)."""
    record_run(ws.catalog(), rows, also=also)


def write_report(outcome: Outcome, timings: dict) -> None:
    """The plots (layer scores, influence) and a Markdown report, under lake/plots/<edit id>/."""
    plots, u = Path(outcome.plots), outcome.unlearned
    plots.mkdir(parents=True, exist_ok=True)
    if u.layer_scores:
        layer_scores_plot(list(u.layer_scores), list(u.layers), plots / "layer_scores.png")
    if outcome.audit:
        influence_plot(outcome.audit.read(), plots / "influence.png")
    lines = [f"# {u.method} edit {u.edit_id}", "", f"Modules: {', '.join(u.modules)}."]
    if u.stats:
        lines.append(f"Layers {list(u.layers) or 'none (the LM head alone)'}; retain statistics "
                     f"{'from the cache' if u.stats.cache_hit else 'computed'}.")
    if outcome.audit:
        lines.append("Influence is exact leave-one-out for each module with everything else held fixed (keys, "
                     "targets, specificity weights, layer choice, c = w_forget / s).")
    lines += ["", "| metric | before | after |", "|---|---|---|"]
    for key in outcome.before:
        if isinstance(outcome.before[key], int | float) or isinstance(outcome.after.get(key), int | float):
            lines.append(f"| {key} | {fmt(outcome.before[key])} | {fmt(outcome.after.get(key))} |")
    attacked = {**outcome.quantized, **outcome.attacks}
    if attacked:
        lines += ["", "Robustness: the forget metric each attack gives back (after the attack minus after the edit; "
                  "quantization rounds the weights, the others read around the edit).", "",
                  "| attack | recovery |", "|---|---|"]
        lines += [f"| {name} | {fmt(got.get('recovery'))} |" for name, got in attacked.items()]
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in {**timings, **u.timings_s}.items()]
    (plots / "report.md").write_text("\n".join(lines) + "\n")


def publish(result: dict) -> None:
    """A Markdown summary and a metrics table for the Prefect UI."""
    before, after = result["metrics"]["before"], result["metrics"]["after"]
    rows = [{"metric": k, "before": fmt(before.get(k)), "after": fmt(after.get(k))} for k in before
            if isinstance(before.get(k), int | float)]
    create_table_artifact(table=rows, key="unlearning-metrics", description="Metrics before and after the edit")
    create_markdown_artifact(
        key="unlearning-summary",
        markdown=(f"# Edit {result['edit_id']}\n\nModules: {', '.join(result['modules'])}\n\n"
                  f"MLflow: {result['mlflow']['model_name']} version {result['mlflow']['version']}\n\n"
                  f"Unlearning ({result['method']}) took {result['timings_s']['unlearning']:.2f} s."),
        description="GROM unlearning summary")
