"""What `grom benchmark build`, `grom evaluate`, `grom finetune` and `grom tofu-score` do, apart from printing."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from flows.workspace import Workspace
from grom_core.benchmarks.registry import BuiltBenchmark, build, get_benchmark
from grom_core.data import as_examples, read_json_object
from grom_core.errors import DataError
from grom_core.finetune import TinyModelConfig, TrainConfig, train_model
from grom_core.loading import load_model
from grom_core.metrics.tofu_logs import read_tofu_log, tofu_score, write_reference
from tasks.datafiles import read_examples, tofu_splits_from_dir

log = logging.getLogger("grom.evaluation")


def build_benchmark(name: str, out: str | None, home: str | None, split: str | None = None,
                    train_models: bool = True, check: bool = True, config: object | None = None) -> BuiltBenchmark:
    """Build a shipped benchmark; with `check`, evaluate both models, save the retain model's per-question values
    as `references/retain-<split>.json` (what Forget Quality and PrivLeak compare against) and log the figures."""
    root = Path(out) if out else Workspace.resolve(home).root / "benchmarks"
    start = time.perf_counter()
    built = build(name, root, split=split, train_models=train_models, config=config)
    log.info("benchmark %s built in %.1f s: %s", name, time.perf_counter() - start, built.root)
    if train_models and check:
        built.checks = memorisation_check(built)
    return built


def reference_path(built: BuiltBenchmark) -> Path:
    return built.root / "references" / f"retain-{built.split}.json"


def memorisation_check(built: BuiltBenchmark) -> dict:
    """Evaluate the retain model (saving its reference) and the target model against it; returns both metrics."""
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
    for role in ("retain", "target"):
        start = time.perf_counter()
        model, tokenizer = load_model(built.models[role])
        ref = read_reference(built.name, path) if role == "target" and path.exists() else None
        result = bench.evaluate(model, tokenizer, splits, built.split, ref)
        if role == "retain":
            save_reference_file(built.name, built.split, result, path)
        results[role] = result["metrics"]
        log.info("%s %s model: %s (%.1f s)", built.name, role, _headline(result["metrics"]),
                 time.perf_counter() - start)
    done.write_text(json.dumps({"models": models, "metrics": results}, default=str))
    return results


def _headline(metrics: dict) -> str:
    keys = ("forget_rougeL_recall", "forget_quality", "model_utility", "verbmem_rougeL_f1", "knowmem_forget_rougeL_f1",
            "privleak", "forget_accuracy", "retain_accuracy")
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), float))


def read_reference(benchmark: str, path: str | Path):
    """The retain model's per-question values a metric compares against (TOFU truth ratios, MUSE AUC)."""
    path = Path(path)
    if benchmark in ("minitofu", "tofu"):
        ratios = read_tofu_log(path).forget_truth_ratios
        if ratios.size == 0:
            raise DataError(f"{path} holds no per-question forget truth ratios; write it with "
                            f"`grom evaluate --save-reference`")
        return ratios
    data = read_json_object(path, "reference file")
    if benchmark == "minimuse":
        auc = data.get("per_question", {}).get("auc")
        if auc is None:
            raise DataError(f"{path} has no per_question.auc; write it with `grom evaluate --save-reference`")
        return float(auc)
    return None


def evaluate_model(model_dir: str, benchmark: str, *, split: str | None = None, reference: str | None = None,
                   save_reference: str | None = None, data_dir: str | None = None, home: str | None = None,
                   max_new_tokens: int = 200, batch_size: int = 32) -> dict:
    """All metrics of `benchmark` for one model; optionally save its per-question values as a reference file."""
    start = time.perf_counter()
    if benchmark == "tofu":  # the real TOFU files of a local folder
        if not data_dir:
            raise DataError("--benchmark tofu needs --data-dir, the folder holding the TOFU evaluation files")
        split = split or "forget10"
        splits = tofu_splits_from_dir(data_dir, split)
        from grom_core.benchmarks import minitofu

        evaluate, kwargs = minitofu.evaluate, {"max_new_tokens": max_new_tokens, "batch_size": batch_size}
    else:
        bench = get_benchmark(benchmark)
        split = split or bench.default_split
        if split not in bench.forget_splits:
            raise DataError(f"{benchmark} has no forget split '{split}'; choose one of {sorted(bench.forget_splits)}")
        splits = build_benchmark(benchmark, None, home, split, train_models=False).load_splits()
        evaluate = bench.evaluate
        kwargs = {"batch_size": batch_size}
        if benchmark == "minitofu":
            kwargs["max_new_tokens"] = max_new_tokens
    ref = read_reference(benchmark, reference) if reference else None
    model, tokenizer = load_model(model_dir)
    result = evaluate(model, tokenizer, splits, split, ref, **kwargs)
    result.update({"benchmark": benchmark, "split": split, "model_dir": str(model_dir),
                   "seconds": time.perf_counter() - start})
    if save_reference:
        result["reference_file"] = str(save_reference_file(benchmark, split, result, save_reference))
    return result


def evaluate_spec(model, tokenizer, spec: dict, own_rows: tuple[list[dict], list[dict]] | None = None) -> dict:
    """Metrics of a loaded model: a shipped benchmark's (spec = {"benchmark", "split", "splits", "reference"}) or,
    with `own_rows` = (forget rows, retain rows), probability and ROUGE-L on the user's own data."""
    if spec.get("benchmark"):
        from grom_core.benchmarks.registry import read_split

        bench = get_benchmark(spec["benchmark"])
        splits = {name: read_split(Path(path)) for name, path in spec["splits"].items()}
        reference = read_reference(spec["benchmark"], spec["reference"]) if spec.get("reference") else None
        return bench.evaluate(model, tokenizer, splits, spec["split"], reference)["metrics"]
    from grom_core.benchmarks.owndata import evaluate_own

    forget, retain = own_rows
    return evaluate_own(model, tokenizer, forget, retain, max_examples=spec.get("max_examples", 200))


def save_reference_file(benchmark: str, split: str, result: dict, path: str | Path) -> Path:
    if benchmark in ("minitofu", "tofu"):
        return write_reference(path, result["metrics"], result["per_question"]["forget_truth_ratio"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": benchmark, "split": split, "metrics": result["metrics"],
                                "per_question": result["per_question"]}, indent=1))
    return path


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
