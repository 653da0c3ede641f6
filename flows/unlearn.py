"""The `unlearn` flow: ingest -> score layers -> retain statistics -> solve (targets, keys) -> apply and save ->
influence audit -> evaluate before and after -> register (MLflow, then the DuckDB catalog in one transaction).

Import this module only after `flows.runtime.configure_prefect` has set Prefect's environment.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.workspace import Workspace
from grom_core.closed_form import GromParams
from grom_core.profiling import measure
from tasks import steps
from tasks.catalog import Catalog, now, record_run
from tasks.lake import safe_name
from tasks.plots import influence_plot, layer_scores_plot
from tasks.tracking import Registration, delete_registration, register

log = logging.getLogger("grom.flow")

HEADLINE = ("forget_rougeL_recall", "forget_probability", "forget_truth_ratio", "forget_quality", "model_utility",
            "retain_rougeL_recall", "retain_probability")


class Stages:
    """Per-stage wall times, logged as each stage ends (the progress a user watches)."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.start = time.perf_counter()

    def run(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        self.timings[name] = time.perf_counter() - t0
        log.info("stage %-18s %7.2f s", name, self.timings[name])
        return result


@flow(name="unlearn")
def unlearn(model: str, forget: str, retain: str, home: str | None = None, params: dict | None = None,
            benchmark: dict | None = None, model_name: str | None = None, workers: int = 0,
            dask_address: str | None = None, tags: dict | None = None, method: str = "grom",
            compose: str | None = None, trainer: dict | None = None, quantization: bool = True) -> dict:
    """Unlearn `forget` from the model in `model` while keeping `retain`; register the edited model.

    Args:
        model: local model directory (save_pretrained, safetensors).
        forget, retain: data files (JSON, JSONL, Parquet or CSV with question/answer or text columns).
        home: workspace folder (default ./.grom or GROM_HOME).
        params: hyper-parameters of the method (GromParams fields for grom, the method's dataclass otherwise).
        benchmark: {"benchmark", "split", "splits", "reference"} to evaluate with a shipped benchmark's metrics;
            None evaluates probability and ROUGE-L on the forget and retain data themselves.
        model_name: registered model name in MLflow (default from the benchmark or the model folder).
        workers: shard the retain statistics over a local Dask cluster of this many processes (0: in process).
        dask_address: an existing Dask scheduler (tcp://host:8786) instead.
        tags: extra tags for the MLflow run and model version (e.g. deletion request ids).
        method: grom, or a gradient method: ga, graddiff, npo, simnpo, idkdpo.
        compose: gradient composition for gradient methods: sum, pcgrad or sago.
        trainer: TrainerParams fields for gradient methods (the recipe).
        quantization: run the quantization recovery attack on the edited model (fp4, nf4, int8, rtn4, and fp4
            with the LM head kept) and report it under metrics.quantized.
    """
    ws = Workspace.resolve(home)
    started, stages = now(), Stages()
    out = compute(stages, ws, model=model, forget=forget, retain=retain, method=method, params=params or {},
                  compose=compose, trainer=trainer or {}, workers=workers, dask_address=dask_address,
                  benchmark=benchmark, quantization=quantization)
    name = model_name or (f"grom-{benchmark['benchmark']}-{benchmark['split']}" if benchmark
                          else f"grom-{safe_name(Path(model).name)}")
    registration = register_outcome(stages, ws, out, name=name, tags={"grom.kind": "unlearn", **(tags or {})})
    timings = {**stages.timings, "unlearning": out["solved"]["unlearning"]["seconds"],
               "total": time.perf_counter() - stages.start}
    try:
        record_run(Catalog(ws.root / "catalog.duckdb"),
                   catalog_rows(out, registration, flow="unlearn", started=started, timings=timings))
    except BaseException:
        delete_registration(ws.root, registration)  # no half-registered version without its catalog rows
        raise
    result = summary(out, registration, timings, ws)
    _publish(result)
    return result


def compute(stages: Stages, ws: Workspace, *, model: str, forget: str, retain: str, method: str, params: dict,
            compose: str | None, trainer: dict, workers: int, dask_address: str | None, benchmark: dict | None,
            quantization: bool, quantizers: list[str] | None = None, evaluation: dict | None = None) -> dict:
    """Everything before registration: ingest -> edit (closed form or gradient) -> apply and save -> evaluate
    before and after -> quantization attack -> plots and report. Changes nothing outside the workspace's lake,
    edits and models folders (content-addressed), so a failure here leaves catalog and registry untouched.

    `evaluation` adds settings to the own-data evaluation spec (e.g. {"max_examples": 200})."""
    lake_root = str(ws.root / "lake")
    data = stages.run("ingest", steps.ingest, forget, retain, lake_root)
    if method == "grom":
        solved = _closed_form(stages, model, data, params, lake_root, ws, workers, dask_address)
    else:
        compose = compose or "sum"
        solved = stages.run("train", steps.train_gradient, model, data, method, compose, params, trainer,
                            str(ws.edits))
        solved.update({"layers": [], "scores": [], "stats": None, "audit": None, "key_shards": [],
                       "manifest": {**params, **trainer, "compose": compose},
                       "unlearning": {k: solved[k] for k in ("seconds", "peak_rss_mb", "steps", "forward_passes")}})
    edited = stages.run("apply_and_save", steps.apply_and_save, model, solved, str(ws.models))
    spec = dict(benchmark) if benchmark else {"forget": data["forget"], "retain": data["retain"],
                                              **(evaluation or {})}
    cache_root = str(ws.root / "cache" / "evaluations")
    before = stages.run("evaluate_before", steps.evaluate, model, spec, cache_root)
    after = stages.run("evaluate_after", steps.evaluate, edited["model_dir"], spec, cache_root)
    quantized = {}
    if quantization:
        quantized = stages.run("quantization", steps.quantization_check, edited["model_dir"], model,
                               solved["edit_dir"], spec, after["metrics"], quantizers)

    plots = ws.root / "lake" / "plots" / solved["edit_id"]
    plots.mkdir(parents=True, exist_ok=True)
    if solved["scores"]:
        layer_scores_plot(solved["scores"], solved["layers"], plots / "layer_scores.png")
    influence_rows = []
    if solved["audit"]:
        import pyarrow.parquet as pq

        influence_rows = pq.read_table(solved["audit"]["path"]).to_pylist()
        influence_plot(influence_rows, plots / "influence.png")
    (plots / "report.md").write_text(_report(method, solved, before["metrics"], after["metrics"], stages.timings))
    return {"model": model, "method": method, "compose": compose, "data": data, "solved": solved, "edited": edited,
            "before": before["metrics"], "after": after["metrics"], "quantized": quantized,
            "influence_rows": influence_rows, "plots": plots}


def register_outcome(stages: Stages, ws: Workspace, out: dict, *, name: str, tags: dict) -> Registration:
    """Log the run to MLflow and register the edited model as a new version of `name`, with lineage tags."""
    solved, data, method = out["solved"], out["data"], out["method"]
    version_tags = {"base_fingerprint": solved["fingerprint"], "edit_id": solved["edit_id"], "method": method,
                    "compose": out["compose"] or "", "forget_digest": data["forget"]["digest"],
                    "retain_digest": data["retain"]["digest"], "model_dir": out["edited"]["model_dir"],
                    "fingerprint": out["edited"]["edited_fingerprint"], **{k: str(v) for k, v in tags.items()}}
    artifacts = {"edit": Path(solved["edit_dir"]), "plots": out["plots"]}
    if solved["audit"]:
        artifacts["influence"] = Path(solved["audit"]["path"])
    unlearning = solved["unlearning"]
    return stages.run(
        "register", register, ws.root, run_name=f"unlearn-{method}-{solved['edit_id']}", model_name=name,
        params={**solved["manifest"], "method": method, "layers_chosen": solved["layers"],
                "modules": solved["modules"], "model_dir": out["model"]},
        metrics={"before": out["before"], "after": out["after"],
                 **{f"quantized.{q}": m for q, m in out["quantized"].items() if isinstance(m, dict)},
                 "timing": {**stages.timings, "unlearning": unlearning["seconds"]},
                 "unlearning": {k: v for k, v in unlearning.items() if isinstance(v, int | float)}},
        datasets=[data["forget"], data["retain"]], artifacts=artifacts,
        model_dir=Path(out["edited"]["model_dir"]), tags=version_tags)


def catalog_rows(out: dict, registration: Registration, *, flow: str, started, timings: dict,
                 extra_metrics: dict | None = None) -> dict:
    """What `record_run` writes for one registered outcome: datasets, edit, influence, layer scores, key shards,
    the statistics cache entries and the runs row."""
    solved, data, edited = out["solved"], out["data"], out["edited"]
    return {
        "datasets": [_dataset_row(d) for d in (data["forget"], data["retain"])],
        "edit": {"edit_id": solved["edit_id"], "method": out["method"], "base_fingerprint": solved["fingerprint"],
                 "edited_fingerprint": edited["edited_fingerprint"], "modules": solved["modules"],
                 "layers": solved["layers"], "params": solved["manifest"], "edit_dir": solved["edit_dir"]},
        "influence": out["influence_rows"], "layer_scores": solved["scores"], "key_shards": solved["key_shards"],
        "stats_cache": [{"fingerprint": solved["fingerprint"], "retain_digest": data["retain"]["digest"],
                         "module": m, "path": p, "n_positions": solved["stats"]["counts"][m]}
                        for m, p in (solved["stats"] or {"paths": {}})["paths"].items()],
        "run": {"run_id": registration.run_id, "flow": flow, "method": out["method"], "compose": out["compose"],
                "base_fingerprint": solved["fingerprint"], "edited_fingerprint": edited["edited_fingerprint"],
                "edit_id": solved["edit_id"], "forget_digest": data["forget"]["digest"],
                "retain_digest": data["retain"]["digest"], "mlflow_run_id": registration.run_id,
                "model_name": registration.model_name, "model_version": registration.version,
                "model_dir": edited["model_dir"],
                "metrics": {"before": out["before"], "after": out["after"], "quantized": out["quantized"],
                            **(extra_metrics or {})},
                "timings": timings, "started_at": started},
    }


def summary(out: dict, registration: Registration, timings: dict, ws: Workspace) -> dict:
    """The flow's result (what `--json` prints)."""
    solved, method = out["solved"], out["method"]
    return {
        "method": method, "compose": out["compose"] if method != "grom" else None, "edit_id": solved["edit_id"],
        "layers": solved["layers"], "modules": solved["modules"],
        "cached_stats": solved["stats"]["cache_hit"] if solved["stats"] else None,
        "metrics": {"before": out["before"], "after": out["after"], "quantized": out["quantized"]},
        "unlearning": solved["unlearning"], "timings_s": timings, "peak_rss_mb": solved["unlearning"]["peak_rss_mb"],
        "mlflow": {"run_id": registration.run_id, "model_name": registration.model_name,
                   "version": registration.version},
        "model_dir": out["edited"]["model_dir"], "edit_dir": solved["edit_dir"], "influence": solved["audit"],
        "workspace": str(ws.root),
    }


def _closed_form(stages: Stages, model: str, data: dict, params: dict, lake_root: str, ws: Workspace,
                 workers: int, dask_address: str | None) -> dict:
    """The GROM stages: layer scores, retain statistics, solve, influence audit."""
    grom = GromParams(**{k: tuple(v) if k == "layers" and v is not None else v for k, v in params.items()})
    manifest = steps.params_manifest(grom)
    with measure() as cost:
        layers = stages.run("score_layers", steps.score_layers, model, data, manifest)
        stats = stages.run("retain_statistics", steps.retain_statistics, model, data, layers["modules"],
                           layers["fingerprint"], manifest, lake_root, workers, dask_address)
        solved = stages.run("solve", steps.solve_edit, model, data, layers, stats, manifest, lake_root,
                            str(ws.edits))
    audit = stages.run("influence", steps.influence_audit, solved, stats, layers["fingerprint"], data, manifest,
                       lake_root)
    return {**solved, "layers": layers["layers"], "scores": layers["scores"], "fingerprint": layers["fingerprint"],
            "stats": stats, "audit": audit, "manifest": manifest,
            "unlearning": {"seconds": cost.seconds, "peak_rss_mb": cost.peak_rss_mb, "steps": 0,
                           "forward_passes": None, "cached_stats": stats["cache_hit"]}}


def _dataset_row(manifest: dict) -> dict:
    return {"digest": manifest["digest"], "name": manifest["name"], "role": manifest["role"],
            "source": manifest["source"], "examples": steps.read_dataset_with_sha(manifest)}


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _report(method: str, solved: dict, before: dict, after: dict, timings: dict) -> str:
    lines = [f"# {method} edit {solved['edit_id']}", "", f"Modules: {', '.join(solved['modules'])}."]
    if solved["stats"]:
        lines.append(f"Layers {solved['layers']}; retain statistics "
                     f"{'from the cache' if solved['stats']['cache_hit'] else 'computed'}.")
    lines += ["", "| metric | before | after |", "|---|---|---|"]
    for key in before:
        if isinstance(before[key], int | float) or isinstance(after.get(key), int | float):
            lines.append(f"| {key} | {_fmt(before[key])} | {_fmt(after.get(key))} |")
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in timings.items()]
    return "\n".join(lines) + "\n"


def _publish(result: dict) -> None:
    """A Markdown summary and a metrics table for the Prefect UI."""
    before, after = result["metrics"]["before"], result["metrics"]["after"]
    rows = [{"metric": k, "before": _fmt(before.get(k)), "after": _fmt(after.get(k))} for k in before
            if isinstance(before.get(k), int | float)]
    create_table_artifact(table=rows, key="unlearning-metrics", description="Metrics before and after the edit")
    create_markdown_artifact(
        key="unlearning-summary",
        markdown=(f"# Edit {result['edit_id']}\n\nModules: {', '.join(result['modules'])}\n\n"
                  f"MLflow: {result['mlflow']['model_name']} version {result['mlflow']['version']}\n\n"
                  f"Unlearning ({result['method']}) took {result['timings_s']['unlearning']:.2f} s."),
        description="GROM unlearning summary")
