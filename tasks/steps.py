"""Prefect tasks of the unlearning flow: thin wrappers over grom_core plus storage glue.

Tasks exchange small JSON-able manifests (paths, digests, counts), never tensors or models; each task that needs
the model loads it from its directory (safetensors). Caching is by content digest (the statistics cache, the
evaluation cache), not by Prefect's run-scoped cache.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.closed_form import GromParams, edited_modules, prepare, select_layers, solve
from grom_core.edit import Edit
from grom_core.errors import DataError
from grom_core.fingerprint import data_digest, text_sha256, weights_fingerprint
from grom_core.influence import influence_report
from grom_core.loading import load_model
from grom_core.statistics import GramStats
from tasks import lake
from tasks.datafiles import read_examples

log = logging.getLogger("grom.flow")


def load_for_edit(model_dir: str):
    """Load a model and untie a tied LM head explicitly (logged), so editing the head never edits the embedding."""
    model, tokenizer = load_model(model_dir)
    try:
        adapter = ModelAdapter.for_model(model)
    except Exception:
        return model, tokenizer
    if adapter.untie_lm_head():
        log.warning("the LM head of %s was tied to the input embedding; it is untied for the edit", model_dir)
    return model, tokenizer


def params_from(manifest: dict) -> GromParams:
    values = dict(manifest)
    if values.get("layers") is not None:
        values["layers"] = tuple(values["layers"])
    return GromParams(**values)


def example_record(row: dict) -> dict:
    content = row.get("text") if "text" in row else f"{row['question']}\n{row['answer']}"
    return {**row, "sha256": text_sha256(content)}


@task(name="ingest", cache_policy=NO_CACHE)
def ingest(forget: str, retain: str, lake_root: str) -> dict:
    """Read and validate both files, drop retain rows that are also forget rows (warning), digest every example,
    and write both datasets to the lake as Parquet (what MLflow logs as inputs and DuckDB reads)."""
    import pyarrow as pa

    forget_rows, retain_rows = read_examples(forget), read_examples(retain)
    forget_keys = {json.dumps(r, sort_keys=True) for r in forget_rows}
    kept = [r for r in retain_rows if json.dumps(r, sort_keys=True) not in forget_keys]
    if len(kept) < len(retain_rows):
        log.warning("%d retain examples are also forget examples; they are dropped from retain",
                    len(retain_rows) - len(kept))
    if not kept:
        raise DataError("no retain example is left once the forget examples are removed; give other retain data")
    datasets = {}
    for role, rows, source in (("forget", forget_rows, forget), ("retain", kept, retain)):
        records = [example_record(r) for r in rows]
        digest = data_digest(rows)
        path = lake.atomic_parquet(pa.Table.from_pylist(records), lake.dataset_path(Path(lake_root), role, digest))
        datasets[role] = {"role": role, "name": f"{role}:{Path(source).name}", "digest": digest, "path": str(path),
                          "source": str(source), "n": len(rows)}
        log.info("ingest: %s %d examples (digest %s)", role, len(rows), digest[:12])
    return datasets


def read_dataset(manifest: dict) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(manifest["path"]).to_pylist()
    return [{k: v for k, v in r.items() if k in ("question", "answer", "text") and v is not None} for r in rows]


def read_dataset_with_sha(manifest: dict) -> list[dict]:
    """Rows with their sha256, as the catalog stores them."""
    import pyarrow.parquet as pq

    return pq.read_table(manifest["path"]).to_pylist()


@task(name="score-layers", cache_policy=NO_CACHE)
def score_layers(model_dir: str, data: dict, params: dict) -> dict:
    model, tokenizer = load_for_edit(model_dir)
    grom = params_from(params)
    prep = prepare(model, tokenizer, read_dataset(data["forget"]), read_dataset(data["retain"]), grom)
    layers, scores = select_layers(model, prep, grom)
    rows = scores.as_rows() if scores is not None else []
    for row in rows:
        row["chosen"] = row["layer"] in layers
    return {"layers": layers, "scores": rows, "modules": edited_modules(prep.adapter, layers, grom),
            "fingerprint": prep.fingerprint}


@task(name="retain-statistics", cache_policy=NO_CACHE)
def retain_statistics(model_dir: str, data: dict, modules: list[str], base_fingerprint: str, params: dict,
                      lake_root: str, workers: int = 0, dask_address: str | None = None) -> dict:
    """Retain Gram sums per module: from the cache keyed by (fingerprint, retain digest, module), else computed
    (in this process, or sharded over Dask workers) and cached."""
    root, digest = Path(lake_root), data["retain"]["digest"]
    cached = lake.load_cached_stats(root, base_fingerprint, digest, modules)
    missing = [m for m in modules if m not in cached]
    start = time.perf_counter()
    if missing:
        grom = params_from(params)
        rows = read_dataset(data["retain"])
        if workers or dask_address:
            from tasks.distributed import sharded_statistics

            computed = sharded_statistics(model_dir, rows, missing, fingerprint=base_fingerprint, data_digest=digest,
                                          out_dir=root / "retain_stats" / "shards" / digest[:24],
                                          workers=workers or 2, address=dask_address,
                                          batch_size=grom.batch_size, max_length=grom.max_length,
                                          first_id=data["forget"]["n"])
        else:
            from grom_core.closed_form import retain_statistics as compute

            model, tokenizer = load_for_edit(model_dir)
            prep = prepare(model, tokenizer, read_dataset(data["forget"]), rows, grom, fingerprint=base_fingerprint)
            computed = compute(model, prep, missing)
        for name, stats in computed.items():
            stats.save(lake.stats_path(root, base_fingerprint, digest, name))
        cached.update(computed)
    seconds = time.perf_counter() - start
    if cached:
        log.info("retain statistics: reused the cache for %d of %d modules (model %s, retain data %s)",
                 len(cached), len(modules), base_fingerprint[:12], digest[:12])
    if missing:
        log.info("retain statistics: computed %d modules in %.2f s", len(missing), seconds)
    return {"paths": {m: str(lake.stats_path(root, base_fingerprint, digest, m)) for m in modules},
            "counts": {m: cached[m].count for m in modules}, "cache_hit": not missing,
            "cached_modules": sorted(set(modules) - set(missing)), "seconds": seconds}


def _load_stats(paths: dict[str, str], fingerprint_: str) -> dict[str, GramStats]:
    return {m: GramStats.load(p, expect_fingerprint=fingerprint_) for m, p in paths.items()}


@task(name="solve", cache_policy=NO_CACHE)
def solve_edit(model_dir: str, data: dict, layers: dict, stats: dict, params: dict, lake_root: str,
               edits_root: str) -> dict:
    """Targets and closed-form solves; writes the edit, the forget key shards and the solve records."""
    model, tokenizer = load_for_edit(model_dir)
    grom = params_from(params)
    prep = prepare(model, tokenizer, read_dataset(data["forget"]), read_dataset(data["retain"]), grom,
                   fingerprint=layers["fingerprint"])
    gram = _load_stats(stats["paths"], prep.fingerprint)
    from grom_core.layers import LayerScores

    scores = None
    if layers["scores"]:
        import torch

        scores = LayerScores(forget=torch.tensor([r["forget"] for r in layers["scores"]], dtype=torch.float64),
                             retain=torch.tensor([r["retain"] for r in layers["scores"]], dtype=torch.float64))
    edit, records = solve(model, prep, layers["layers"], layers["modules"], gram, grom, scores)
    root = Path(lake_root)
    shards = [lake.write_key_shard(root, edit.edit_id, rec) for rec in records.values()]
    records_path = lake.save_records(root / "records" / f"{edit.edit_id}.safetensors", records)
    edit_dir = edit.save(Path(edits_root) / edit.edit_id)
    log.info("solve: edit %s on %s, %d forget positions", edit.edit_id, edit.modules,
             edit.metadata["forget_positions"])
    return {"edit_id": edit.edit_id, "edit_dir": str(edit_dir), "records": str(records_path), "key_shards": shards,
            "modules": edit.modules, "logit_drop": edit.metadata["logit_drop"]}


@task(name="apply-and-save", cache_policy=NO_CACHE)
def apply_and_save(model_dir: str, solved: dict, models_root: str) -> dict:
    """Apply the edit to a fresh copy of the model and save it (safetensors) with its tokenizer and the undo."""
    model, tokenizer = load_for_edit(model_dir)
    edit = Edit.load(solved["edit_dir"])
    undo = edit.apply(model)
    undo.save(Path(solved["edit_dir"]) / "undo.safetensors")
    out = save_model(model, tokenizer, Path(models_root) / f"edited-{edit.edit_id}")
    return {"model_dir": str(out), "edited_fingerprint": undo.post_fingerprint}


def save_model(model, tokenizer, out: Path) -> Path:
    """save_pretrained (safetensors) under a temporary name, then renamed: readers never see half a model."""
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


@task(name="influence-audit", cache_policy=NO_CACHE)
def influence_audit(solved: dict, stats: dict, base_fingerprint: str, data: dict, params: dict,
                    lake_root: str) -> dict:
    """Exact leave-one-out influence of every forget example on every module; one Parquet row each."""
    grom = params_from(params)
    records = lake.load_records(Path(solved["records"]))
    gram = _load_stats(stats["paths"], base_fingerprint)
    sha = [example_record(r)["sha256"] for r in read_dataset(data["forget"])]
    rows = []
    for name, rec in records.items():
        report = influence_report(rec.keys, rec.targets, gram[name].gram, rec.retain_count, rec.example_ids,
                                  w_forget=grom.w_forget, w_retain=grom.w_retain, ridge=rec.ridge)
        for i, example in enumerate(report.example_ids.tolist()):
            rows.append({"module": name, "example_index": example, "example_sha256": sha[example],
                         "value": float(report.norms[i]), "min_eig": float(report.min_eig[i]),
                         "flagged": bool(report.flagged[i]), "refit": bool(report.refit[i])})
    path = lake.write_influence(Path(lake_root), solved["edit_id"], rows)
    flagged = sum(r["flagged"] for r in rows)
    log.info("influence: %d rows (%d examples x %d modules), %d high-leverage", len(rows),
             len({r["example_index"] for r in rows}), len(records), flagged)
    return {"path": str(path), "rows": len(rows), "flagged": flagged}


def evaluate_loaded(model, tokenizer, spec: dict) -> dict:
    """Metrics of a loaded model for an evaluation spec (see flows.evaluation.evaluate_spec)."""
    from flows.evaluation import evaluate_spec

    rows = None if spec.get("benchmark") else (read_dataset(spec["forget"]), read_dataset(spec["retain"]))
    return evaluate_spec(model, tokenizer, spec, rows)


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate(model_dir: str, spec: dict, cache_root: str) -> dict:
    """Metrics of one model, cached by (weights fingerprint, evaluation spec digest): the unedited model is
    evaluated once."""
    model, tokenizer = load_model(model_dir)
    key = f"{weights_fingerprint(model)[:24]}-{data_digest([spec])[:16]}"
    cache = Path(cache_root) / f"{key}.json"
    if cache.is_file():
        log.info("evaluate: reusing cached metrics of %s", model_dir)
        return json.loads(cache.read_text())
    start = time.perf_counter()
    result = {"metrics": evaluate_loaded(model, tokenizer, spec), "seconds": time.perf_counter() - start}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


RECOVERY_KEYS = ("forget_rougeL_recall", "forget_probability", "forget_accuracy", "verbmem_rougeL_f1")


@task(name="quantization-check", cache_policy=NO_CACHE)
def quantization_check(edited_dir: str, base_dir: str, edit_dir: str, spec: dict, after: dict,
                       names: list[str] | None = None) -> dict:
    """Evaluate the edited model after each quantize-dequantize attack; report recovery and edit survival.

    Returns {quantizer: {metrics..., "recovery_<forget metric>": quantized - unquantized, "codes_changed",
    "norm_survival"}} and, under "_note", what could not run.
    """
    from grom_core.quantization import edit_survival, quantized, quantizers

    specs = quantizers()
    wanted = names or list(specs)
    model, tokenizer = load_model(edited_dir)
    base, _ = load_model(base_dir, device="cpu")
    edit = Edit.load(edit_dir)
    out: dict = {}
    missing = [n for n in wanted if n not in specs]
    if missing:
        out["_note"] = f"not run (bitsandbytes unavailable): {', '.join(missing)}"
    for name in [n for n in wanted if n in specs]:
        start = time.perf_counter()
        with quantized(model, specs[name]) as n_matrices:
            metrics = evaluate_loaded(model, tokenizer, spec)
        for key in RECOVERY_KEYS:
            if isinstance(metrics.get(key), float) and isinstance(after.get(key), float):
                metrics[f"recovery_{key}"] = metrics[key] - after[key]
        survival = [edit_survival(weight_out_in(base.get_submodule(m)).detach(), d.full(), specs[name])
                    for m, d in edit.deltas.items()
                    if specs[name].include_lm_head or m != _head_name(base)]
        if survival:
            metrics["codes_changed"] = sum(s["codes_changed"] for s in survival) / len(survival)
            metrics["norm_survival"] = sum(s["norm_survival"] for s in survival) / len(survival)
        out[name] = metrics
        log.info("quantization %s (%d matrices): %s, %.1f s", name, n_matrices,
                 ", ".join(f"{k} {metrics[k]:+.3f}" for k in metrics if k.startswith("recovery_")),
                 time.perf_counter() - start)
    return out


def _head_name(model) -> str | None:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None)


@task(name="train-gradient", cache_policy=NO_CACHE)
def train_gradient(model_dir: str, data: dict, method: str, compose: str, method_params: dict, trainer: dict,
                   edits_root: str) -> dict:
    """A gradient-based method (GA, GradDiff, NPO, SimNPO, IdkDPO with sum, PCGrad or SAGO); writes the Edit."""
    from grom_core.gradient.methods import METHODS
    from grom_core.gradient.trainer import TrainerParams, unlearn_gradient
    from grom_core.profiling import measure

    if method not in METHODS:
        raise DataError(f"unknown method '{method}'; choose grom or one of {', '.join(sorted(METHODS))}")
    model, tokenizer = load_for_edit(model_dir)
    params = METHODS[method].params(**method_params)
    with measure() as cost:
        run = unlearn_gradient(model, tokenizer, read_dataset(data["forget"]), read_dataset(data["retain"]),
                               method=method, compose=compose, method_params=params,
                               trainer=TrainerParams(**trainer))
    edit_dir = run.edit.save(Path(edits_root) / run.edit.edit_id)
    return {"edit_id": run.edit.edit_id, "edit_dir": str(edit_dir), "modules": run.edit.modules,
            "steps": run.steps, "forward_passes": run.forward_passes, "seconds": cost.seconds,
            "peak_rss_mb": cost.peak_rss_mb, "peak_cuda_mb": cost.peak_cuda_mb,
            "fingerprint": run.edit.base_fingerprint}


def params_manifest(params: GromParams) -> dict:
    values = asdict(replace(params, influence=False))  # the flow runs the audit as its own task
    values["layers"] = list(params.layers) if params.layers is not None else None
    return values
