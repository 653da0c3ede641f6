"""Prefect tasks of the unlearning flow: thin wrappers over grom_core plus storage glue.

Tasks exchange the typed records of `tasks.records` (paths, digests, counts, flat metric dicts) and one
`LoadedModel`: the model is loaded once per flow run (`load`) and handed from task to task by reference, never
reloaded. Caching is by content digest (the retain statistics, the evaluation cache), not by Prefect's run-scoped
cache, so no task hashes its inputs (NO_CACHE).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grom_core.adapter import ModelAdapter, get_module, output_head_name, weight_out_in
from grom_core.benchmarks.registry import get_benchmark, read_split
from grom_core.edit import Edit, Undo
from grom_core.errors import DataError, UnsupportedArchitectureError
from grom_core.fingerprint import data_digest, weights_fingerprint
from grom_core.influence import record_influence
from grom_core.loading import load_model
from grom_core.methods import MethodContext, get_method
from grom_core.metrics.muse import FORGET_VERBATIM
from grom_core.profiling import measure
from grom_core.statistics import GramStats
from tasks import lake
from tasks.datafiles import read_examples
from tasks.records import (
    Audit,
    Cost,
    Dataset,
    Edited,
    Evaluation,
    EvaluationSpec,
    Ingested,
    StatsUsage,
    Unlearned,
    text_rows,
    with_sha256,
)

log = logging.getLogger("grom.flow")

OWN_DATA_RECOVERY = ("forget_rougeL_recall", FORGET_VERBATIM, "forget_probability")


def load_for_edit(model_dir: str):
    """Load a model and untie a tied LM head explicitly (logged), so editing the head never edits the embedding.
    A model of an architecture the adapter does not know is returned as loaded (a method may name its modules)."""
    model, tokenizer = load_model(model_dir)
    try:
        adapter = ModelAdapter.for_model(model)
    except UnsupportedArchitectureError:
        return model, tokenizer
    if adapter.untie_lm_head():
        log.warning("the LM head of %s was tied to the input embedding; it is untied for the edit", model_dir)
    return model, tokenizer


class LoadedModel:
    """A model, its tokenizer and the folder it came from, loaded once for a flow run.

    Its weights change in exactly one place, `apply` (called by the task `apply_and_save`), which keeps the
    unedited weights of the modules it touched in `base_weights` ({module: (out, in) tensor on the CPU}; the
    quantization check compares both). Before that step the model holds the folder's weights, after it the
    edited ones."""

    def __init__(self, model_dir: str, model, tokenizer):
        self.model_dir, self.model, self.tokenizer = str(model_dir), model, tokenizer
        self.base_weights: dict = {}
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """The weights fingerprint, hashed once per state: the weights change only in `apply`, which records the
        new one (methods and the quantization attack restore every bit they touch)."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model)
        return self._fingerprint

    def apply(self, edit: Edit) -> Undo:
        """Apply `edit` in place; keep the unedited weights of its modules in `base_weights` and the new
        fingerprint."""
        from grom_core.adapter import get_module

        self.base_weights = {name: weight_out_in(get_module(self.model, name)).detach().to("cpu", copy=True)
                             for name in edit.deltas}
        undo = edit.apply(self.model)
        self._fingerprint = undo.post_fingerprint
        return undo

    def __repr__(self) -> str:  # what Prefect logs for a task parameter
        return f"LoadedModel({self.model_dir!r}{', edited' if self.base_weights else ''})"


@task(name="load-model", cache_policy=NO_CACHE)
def load(model_dir: str) -> LoadedModel:
    """The model of a flow run, loaded for editing (`load_for_edit`): the only load of the run."""
    model, tokenizer = load_for_edit(model_dir)
    return LoadedModel(model_dir, model, tokenizer)


def dataset_record(role: str, rows: list[dict], source: str, lake_root: Path) -> Dataset:
    """Write `rows` (with their sha256) to the lake as Parquet, content-addressed, and describe them."""

    digest = data_digest(rows)
    path = lake.atomic_parquet(lake.rows_table([with_sha256(r) for r in rows]),
                               lake.dataset_path(lake_root, role, digest))
    return Dataset(role=role, name=f"{role}:{Path(source).name}", digest=digest, path=str(path), source=str(source),
                   n=len(rows))


@task(name="ingest", cache_policy=NO_CACHE)
def ingest(forget: str, retain: str, lake_root: str) -> Ingested:
    """Read and validate both files, drop retain rows that are also forget rows (warning), digest every example,
    and write both datasets to the lake as Parquet (what MLflow logs as inputs and DuckDB reads)."""
    forget_rows, retain_rows = read_examples(forget), read_examples(retain)
    forget_keys = {json.dumps(r, sort_keys=True) for r in forget_rows}
    kept = [r for r in retain_rows if json.dumps(r, sort_keys=True) not in forget_keys]
    if len(kept) < len(retain_rows):
        log.warning("%d retain examples are also forget examples; they are dropped from retain",
                    len(retain_rows) - len(kept))
    if not kept:
        raise DataError("no retain example is left once the forget examples are removed; give other retain data")
    data = Ingested(forget=dataset_record("forget", forget_rows, forget, Path(lake_root)),
                    retain=dataset_record("retain", kept, retain, Path(lake_root)))
    for d in (data.forget, data.retain):
        log.info("ingest: %s %d examples (digest %s)", d.role, d.n, d.digest[:12])
    return data


def _dask_statistics(model_dir: str, data: Ingested, batch_size: int, max_length: int, lake_root: Path,
                     workers: int, address: str | None, prompt_format: str):
    """A StatsComputer that shards the retain statistics over a Dask cluster."""
    from tasks.distributed import sharded_statistics

    rows = data.retain.rows()

    def compute(modules, fingerprint: str, digest: str) -> dict[str, GramStats]:
        return sharded_statistics(model_dir, rows, list(modules), fingerprint=fingerprint, data_digest=digest,
                                  out_dir=lake_root / "retain_stats" / "shards" / digest[:24],
                                  workers=workers or 2, address=address, batch_size=batch_size,
                                  max_length=max_length, first_id=data.forget.n, prompt_format=prompt_format)

    return compute


@task(name="unlearn", cache_policy=NO_CACHE)
def unlearn(loaded: LoadedModel, data: Ingested, method: str, params: dict, lake_root: str, edits_root: str,
            workers: int = 0, dask_address: str | None = None, prompt_format: str = "qa") -> Unlearned:
    """Run one method of the registry on the model (which every method leaves as it found it); save its edit,
    and for a closed form the records of its solves and the forget keys (Parquet shards). The retain statistics
    are cached in the lake."""
    entry = get_method(method)
    if "trainer" in {f.name for f in dataclasses.fields(entry.params)}:
        from grom_core.gradient.methods import model_kind, with_recipe

        kind = model_kind(loaded.model.config, loaded.model_dir)
        params = with_recipe(params, kind)
        log.info("%s: the %s model recipe %s", method, kind, params["trainer"])
    typed = entry.params.from_dict(params)
    root = Path(lake_root)
    model, tokenizer = loaded.model, loaded.tokenizer
    compute = None
    if workers or dask_address:
        compute = _dask_statistics(loaded.model_dir, data, getattr(typed, "batch_size", 16),
                                   getattr(typed, "max_length", 512), root, workers, dask_address, prompt_format)
    store = lake.LakeStatsStore(root)
    context = MethodContext(stats_store=store, compute_stats=compute, prompt_format=prompt_format)
    with measure() as cost:
        run = entry.run(model, tokenizer, data.forget.rows(), data.retain.rows(), typed, context)
    edit = run.edit
    edit_dir = edit.save(Path(edits_root) / edit.edit_id)
    records_path, shards, stats = None, (), None
    if run.records:
        records_path = str(lake.save_records(root / "records" / f"{edit.edit_id}.safetensors", dict(run.records)))
        shards = tuple(lake.write_key_shard(root, edit.edit_id, rec) for rec in run.records.values())
    if run.retain_stats:
        first = next(iter(run.retain_stats.values()))
        stats = StatsUsage(fingerprint=first.fingerprint, digest=first.data_digest,
                           paths={m: str(store.path(s.fingerprint, s.data_digest, m))
                                  for m, s in run.retain_stats.items()},
                           counts={m: s.count for m, s in run.retain_stats.items()}, reused=tuple(run.reused_stats))
        log.info("retain statistics: %d of %d modules from the cache (model %s)", len(run.reused_stats),
                 len(run.retain_stats), first.fingerprint[:12])
    log.info("unlearn: %s edit %s on %s in %.2f s", method, edit.edit_id, edit.modules, cost.seconds)
    return Unlearned(method=method, params=typed.to_dict(), edit_id=edit.edit_id, edit_dir=str(edit_dir),
                     modules=tuple(edit.modules), base_fingerprint=edit.base_fingerprint,
                     cost=Cost(seconds=cost.seconds, peak_rss_mb=cost.peak_rss_mb, peak_cuda_mb=cost.peak_cuda_mb,
                               steps=run.steps, forward_passes=run.forward_passes),
                     layers=tuple(run.layers), layer_scores=tuple(run.layer_scores), records_path=records_path,
                     stats=stats, key_shards=shards, timings_s=dict(run.timings_s),
                     peaks_mb=dict(run.peaks_mb))


@task(name="apply-and-save", cache_policy=NO_CACHE)
def apply_and_save(loaded: LoadedModel, unlearned: Unlearned, models_root: str) -> Edited:
    """Apply the edit to the loaded model in place (`LoadedModel.apply`) and save the result (safetensors) with
    its tokenizer, and the undo beside the edit."""
    edit = Edit.load(unlearned.edit_dir)
    undo = loaded.apply(edit)
    undo.save(Path(unlearned.edit_dir) / "undo.safetensors")
    out = save_model(loaded.model, loaded.tokenizer, Path(models_root) / f"edited-{edit.edit_id}")
    return Edited(model_dir=str(out), fingerprint=undo.post_fingerprint)


def save_model(model, tokenizer, out: Path) -> Path:
    """save_pretrained (safetensors) under a temporary name, then renamed: readers never see half a model."""
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@task(name="influence-audit", cache_policy=NO_CACHE)
def influence_audit(unlearned: Unlearned, data: Ingested, lake_root: str) -> Audit | None:
    """Exact leave-one-out influence of every forget example on every solved module; one Parquet row each.
    None for a method that keeps no solve records (the gradient methods)."""
    if unlearned.records_path is None or unlearned.stats is None:
        return None
    records = lake.load_records(Path(unlearned.records_path))
    sha = [r["sha256"] for r in data.forget.rows_with_sha()]
    rows = []
    for name, rec in records.items():
        gram = GramStats.load(unlearned.stats.paths[name], expect_fingerprint=unlearned.base_fingerprint)
        report = record_influence(rec, gram)
        for i, example in enumerate(report.example_ids.tolist()):
            rows.append({"module": name, "example_index": example, "example_sha256": sha[example],
                         "value": float(report.norms[i]), "min_eig": float(report.min_eig[i]),
                         "flagged": bool(report.flagged[i]), "refit": bool(report.refit[i])})
    path = lake.write_influence(Path(lake_root), unlearned.edit_id, rows)
    flagged = sum(r["flagged"] for r in rows)
    log.info("influence: %d rows (%d examples x %d modules), %d high-leverage", len(rows),
             len({r["example_index"] for r in rows}), len(records), flagged)
    return Audit(path=str(path), rows=len(rows), flagged=flagged)


def evaluate_loaded(model, tokenizer, spec: EvaluationSpec) -> dict:
    """Flat metrics of a loaded model: the benchmark's (from the registry) or, without one, probability and
    ROUGE-L on the forget and retain data themselves."""
    if spec.benchmark:
        bench = get_benchmark(spec.benchmark)
        splits = {name: read_split(Path(path)) for name, path in spec.splits.items()}
        reference = bench.read_reference(Path(spec.reference)) if spec.reference else None
        return bench.evaluate(model, tokenizer, splits, spec.split, reference)["metrics"]
    from grom_core.benchmarks.owndata import evaluate_own

    forget, retain = (_lake_rows(spec.forget), _lake_rows(spec.retain))
    return evaluate_own(model, tokenizer, forget, retain, max_examples=spec.max_examples, fmt=spec.prompt_format)


def recovery_keys(spec: EvaluationSpec) -> tuple[str, ...]:
    """The forget metrics whose rise after quantization means the forgetting came back."""
    return get_benchmark(spec.benchmark).metrics.recovery if spec.benchmark else OWN_DATA_RECOVERY


def _lake_rows(path: str | None) -> list[dict]:
    import pyarrow.parquet as pq

    if path is None:
        raise DataError("an own-data evaluation needs the forget and retain datasets")
    return text_rows(pq.read_table(path).to_pylist())


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate(loaded: LoadedModel, spec: EvaluationSpec, cache_root: str) -> Evaluation:
    """Metrics of the model's current weights, cached by (weights fingerprint, evaluation spec digest): the
    unedited model is evaluated once. The cache file is written under a temporary name and renamed, so a crash
    never leaves a truncated entry; an unreadable entry is recomputed."""
    import time

    model, tokenizer = loaded.model, loaded.tokenizer
    cache = Path(cache_root) / f"{loaded.fingerprint()[:24]}-{spec.digest()[:16]}.json"
    if cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            log.info("evaluate: reusing cached metrics of %r", loaded)
            return Evaluation(metrics=cached["metrics"], seconds=cached["seconds"])
        except (json.JSONDecodeError, KeyError, TypeError):
            log.warning("evaluate: the cached metrics in %s are unreadable; evaluating again", cache)
    start = time.perf_counter()
    result = Evaluation(metrics=evaluate_loaded(model, tokenizer, spec), seconds=time.perf_counter() - start)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text(json.dumps({"metrics": dict(result.metrics), "seconds": result.seconds}))
    tmp.replace(cache)
    return result


@task(name="quantization-check", cache_policy=NO_CACHE)
def quantization_check(loaded: LoadedModel, unlearned: Unlearned, spec: EvaluationSpec, after: dict,
                       names: list[str] | None = None) -> dict:
    """Evaluate the edited model (`loaded` after `apply_and_save`) after each quantize-dequantize attack; report
    recovery and edit survival (the unedited weights from `loaded.base_weights`).

    Returns {quantizer: {metrics..., "recovery_<forget metric>": quantized - unquantized, "recovery" (the
    headline one), "codes_changed", "norm_survival"}} and, under "_note", what could not run.
    """
    import time

    from grom_core.attacks import headline_recovery
    from grom_core.quantization import edit_survival, quantized, quantizers

    specs = quantizers()
    wanted = names or list(specs)
    model, tokenizer = loaded.model, loaded.tokenizer
    edit = Edit.load(unlearned.edit_dir)
    head = output_head_name(model)
    out: dict = {}
    missing = [n for n in wanted if n not in specs]
    if missing:
        out["_note"] = f"not run (bitsandbytes unavailable): {', '.join(missing)}"
    for name in [n for n in wanted if n in specs]:
        start = time.perf_counter()
        with quantized(model, specs[name]) as n_matrices:
            metrics = evaluate_loaded(model, tokenizer, spec)
        for key in recovery_keys(spec):
            if isinstance(metrics.get(key), float) and isinstance(after.get(key), float):
                metrics[f"recovery_{key}"] = metrics[key] - after[key]
        metrics["recovery"] = headline_recovery(metrics, recovery_keys(spec))
        survival = [edit_survival(loaded.base_weights[m], d, specs[name], head=m == head)
                    for m, d in edit.deltas.items() if specs[name].include_lm_head or m != head]
        if survival:
            metrics["codes_changed"] = sum(s["codes_changed"] for s in survival) / len(survival)
            metrics["norm_survival"] = sum(s["norm_survival"] for s in survival) / len(survival)
        out[name] = metrics
        log.debug("quantization %s (%d matrices): %s, %.1f s", name, n_matrices,
                 ", ".join(f"{k} {metrics[k]:+.3f}" for k in metrics if k.startswith("recovery_")),
                 time.perf_counter() - start)
    return out


READING_ATTACKS = ("head_swap", "logit_lens", "relearn")  # the flow's default attacks that read around the edit


@task(name="read-around-attacks", cache_policy=NO_CACHE)
def read_around(loaded: LoadedModel, data: Ingested, spec: EvaluationSpec, after: dict,
                names: list[str] | None = None) -> dict:
    """Evaluate the edited model (`loaded` after `apply_and_save`) under each attack that reads around the edit
    (grom_core.attacks: the base head on its hidden states, the logit lens, relearning from half the forget facts):
    {attack: {metrics..., "recovery_<forget metric>", "recovery"}}. The base head is the unedited model's
    (`loaded.base_weights`, or the head as it is where the edit left it alone); the relearning attack steps at the
    benchmark's gradient recipe's learning rate, on own data at TOFU's for pretrained models (1e-5)."""
    from grom_core.attacks import AttackKit, RelearnRecipe
    from grom_core.data import as_examples

    model, tokenizer = loaded.model, loaded.tokenizer
    head = output_head_name(model)
    base_head = loaded.base_weights.get(head)
    if base_head is None:
        base_head = weight_out_in(get_module(model, head)).detach().to("cpu", copy=True)
    lr = get_benchmark(spec.benchmark).trainer.get("lr") if spec.benchmark else None
    prompt = get_benchmark(spec.benchmark).prompt_format if spec.benchmark else spec.prompt_format
    kit = AttackKit(base_head=base_head, forget=as_examples(data.forget.rows()), retain=as_examples(data.retain.rows()),
                    evaluate=lambda: evaluate_loaded(model, tokenizer, spec), recovery=recovery_keys(spec),
                    prompt_format=prompt, recipe=RelearnRecipe(**({"lr": float(lr)} if lr else {})))
    out = {}
    for name in READING_ATTACKS if names is None else names:
        out[name] = kit.run(name, model, tokenizer, after)
        recovery = out[name].get("recovery")
        log.info("attack %s: recovery %s", name, f"{recovery:+.3f}" if isinstance(recovery, float) else recovery)
    return out
