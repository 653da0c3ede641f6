"""What `grom benchmark build`, `grom evaluate`, `grom finetune` and `grom tofu-score` do, apart from printing."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from flows.workspace import Workspace
from grom_core.benchmarks.registry import BuiltBenchmark, build, check_split, get_benchmark
from grom_core.data import as_examples
from grom_core.errors import DataError
from grom_core.finetune import TinyModelConfig, TrainConfig, train_model
from grom_core.loading import load_model
from grom_core.metrics.tofu_logs import read_tofu_log, tofu_score
from tasks.datafiles import SUFFIXES, read_benchmark_file, read_examples
from tasks.models import fetch_model

log = logging.getLogger("grom.evaluation")


def sized_config(benchmark: str, authors: int | None, overrides: Mapping[str, object] | None = None):
    """The benchmark's configuration with `authors` entities (for quick runs and tests) and `overrides` (field name
    -> value, from `--config`: its plain fields, and those of a nested part as `part.field`, e.g. `train.epochs`,
    each of its default's type), or None for its own."""
    if authors is None and not overrides:
        return None
    config = get_benchmark(benchmark).config
    if config is None:
        raise DataError(f"{benchmark} has no configuration to set with --authors or --config")
    if authors is not None:
        if "authors" not in {f.name for f in dataclasses.fields(config)}:
            raise DataError(f"{benchmark} has no size to set with --authors")
        config = dataclasses.replace(config, authors=authors)
    settable = _plain_fields(config)
    for part in dataclasses.fields(config):
        if dataclasses.is_dataclass(getattr(config, part.name)):
            settable.update({f"{part.name}.{k}": v for k, v in _plain_fields(getattr(config, part.name)).items()})
    nested: dict[str, dict] = {}
    for name, value in (overrides or {}).items():
        if name not in settable:
            raise DataError(f"{benchmark} has no setting '{name}'; --config can set {', '.join(sorted(settable))}")
        default = settable[name]
        if not (type(value) is type(default) or (type(default) is float and type(value) is int)):
            raise DataError(f"--config {name} must be {type(default).__name__}, like its default {default!r}; "
                            f"got {value!r}")
        part, _, field = name.rpartition(".")
        nested.setdefault(part, {})[field] = value
    plain = nested.pop("", {})
    parts = {part: dataclasses.replace(getattr(config, part), **values) for part, values in nested.items()}
    return dataclasses.replace(config, **plain, **parts)


def _plain_fields(config) -> dict[str, object]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if isinstance(getattr(config, f.name), (bool, int, float, str))}


def build_benchmark(name: str, out: str | None, home: str | None, split: str | None = None,
                    train_models: bool = True, check: bool = True, config: object | None = None) -> BuiltBenchmark:
    """Build a shipped benchmark; with `check`, evaluate both models, save the retain model's per-question values
    as `references/retain-<split>.json` (what Forget Quality and PrivLeak compare against) and log the figures."""
    ws = Workspace.resolve(home)
    root = Path(out) if out else ws.root / "benchmarks"
    start = time.perf_counter()
    built = build(name, root, split=split, train_models=train_models, config=config,
                  resolve_model=lambda model: Path(fetch_model(model, ws.models).model_dir))
    log.info("benchmark %s built in %.1f s: %s", name, time.perf_counter() - start, built.root)
    if train_models and check:
        built.checks = memorisation_check(built)
    return built


def reference_path(built: BuiltBenchmark) -> Path:
    return built.root / "references" / f"retain-{built.split}.json"


def memorisation_check(built: BuiltBenchmark) -> dict:
    """Evaluate the retain model (saving its reference) and the target model against it; returns both metrics.
    A benchmark on a pretrained model has no retain model: the target's own evaluation is the reference."""
    bench = get_benchmark(built.name)
    path = reference_path(built)
    done = path.with_name(f"checks-{built.split}.json")
    models = {role: str(p) for role, p in built.models.items()}
    if path.exists() and done.exists():
        saved = json.loads(done.read_text())
        if saved.get("models") == models:  # same models (content-addressed folders): nothing to redo
            log.info("%s: reusing the memorisation check of %s", built.name, done)
            return saved["metrics"]
    splits = built.load_splits()
    results = {}
    reference_role = "retain" if "retain" in built.models else "target"
    for role in [r for r in ("retain", "target") if r in built.models]:
        start = time.perf_counter()
        model, tokenizer = load_model(built.models[role])
        ref = bench.read_reference(path) if role != reference_role and path.exists() else None
        result = bench.evaluate(model, tokenizer, splits, built.split, ref)
        if role == reference_role:
            bench.write_reference(path, built.split, result)
        results[role] = result["metrics"]
        log.info("%s %s model: %s (%.1f s)", built.name, role, headline(bench, result["metrics"]),
                 time.perf_counter() - start)
    done.write_text(json.dumps({"models": models, "metrics": results}, default=str))
    return results


def headline(bench, metrics: dict, count: int = 4) -> str:
    """The first `count` of the benchmark's table metrics (its most important first), for a one-line summary."""
    shown = [k for k in bench.metrics.table if isinstance(metrics.get(k), float)][:count]
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in shown)


def evaluate_model(model_dir: str, benchmark: str, *, split: str | None = None, reference: str | None = None,
                   save_reference: str | None = None, data_dir: str | None = None, home: str | None = None,
                   max_new_tokens: int = 200, batch_size: int = 32,
                   config: Mapping[str, object] | None = None) -> dict:
    """All metrics of `benchmark` (of its data with `config`'s fields, see `sized_config`) for one model;
    optionally save its per-question values as a reference file."""
    start = time.perf_counter()
    bench = get_benchmark(benchmark)
    split = check_split(bench, split)
    variant = sized_config(benchmark, None, config)  # refused before the model is loaded
    if bench.load_files is not None:  # data the user holds (the real TOFU files)
        if not data_dir:
            raise DataError(f"--benchmark {benchmark} needs --data-dir, the folder holding its evaluation files")
        splits = bench.load_files(data_dir, split, read_benchmark_file, SUFFIXES)
    else:
        splits = build_benchmark(benchmark, None, home, split, train_models=False, config=variant).load_splits()
    ref = bench.read_reference(Path(reference)) if reference else None
    model, tokenizer = load_model(model_dir)
    result = bench.evaluate(model, tokenizer, splits, split, ref, batch_size=batch_size,
                            max_new_tokens=max_new_tokens)
    result.update({"benchmark": benchmark, "split": split, "model_dir": str(model_dir),
                   "seconds": time.perf_counter() - start})
    if save_reference:
        result["reference_file"] = str(bench.write_reference(Path(save_reference), split, result))
    return result


def finetune_command(data: str, out: str, base: str | None, train_config: TrainConfig,
                     model_config: TinyModelConfig) -> dict:
    examples = as_examples(read_examples(data))
    start = time.perf_counter()
    path = train_model(examples, out, base=base, model_config=model_config, train_config=train_config)
    report = json.loads((path / "training.json").read_text())
    return {"model_dir": str(path), "examples": len(examples), "final_loss": report["final_loss"],
            "seconds": time.perf_counter() - start}


def tofu_score_command(model_logs: str, retain_logs: str) -> dict:
    return tofu_score(read_tofu_log(model_logs), read_tofu_log(retain_logs))
