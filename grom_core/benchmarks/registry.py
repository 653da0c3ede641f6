"""The shipped benchmarks: one registry entry per benchmark, and `build` (splits to JSONL, target and retain models).

Each benchmark owns its data (generated, or read from the user's files), its evaluation, the reference file its
metrics compare against and the metric keys it exports; the flows ask this registry and never branch on a name.
Adding a benchmark is one module with `generate`, `training_rows` and `evaluate`, plus one entry here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grom_core.benchmarks import minimuse, minirwku, minitofu, miniwmdp, minizsre
from grom_core.data import as_examples, read_json_object, read_jsonl
from grom_core.errors import DataError
from grom_core.finetune import TrainConfig, example_texts, finetune_pretrained, train_tiny_model
from grom_core.fingerprint import data_digest
from grom_core.gradient.methods import PRETRAINED, RECIPES
from grom_core.metrics.tofu_logs import read_tofu_log, write_reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricKeys:
    """The metric names a benchmark exports (flat keys of its `metrics` dict).

    Attributes:
        forget: the headline forget metric (lower means more forgotten).
        utility: the headline utility metric (higher is better).
        recovery: forget metrics whose rise after quantization means the forgetting came back.
        table: what tables show, most important first (`grom bench` shows the first `shown`).
        shown: how many of `table` a `grom bench` table shows (each also after every quantization attack).
    """

    forget: str
    utility: str
    recovery: tuple[str, ...]
    table: tuple[str, ...]
    shown: int = 3


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its data, its evaluation, its reference file and its metric keys.

    Attributes:
        name: registry name.
        config: its generator and training configuration (a frozen dataclass with `model` and `train`); None for
            a benchmark read from files.
        generate: config -> split name -> rows (None: read from files with `load_files`).
        training_rows: (splits, without forget split or None) -> rows a model is trained on.
        evaluate: (model, tokenizer, splits, forget split, reference, batch_size=, max_new_tokens=) ->
            {"metrics", "per_question", "n"}.
        forget_splits: forget split -> the retain split trained without it.
        default_split: the forget split used when none is named.
        unlearning_inputs: (splits, forget split) -> (forget rows, retain rows) handed to an unlearning method.
        metrics: the metric keys it exports.
        read_reference: path -> the retain model's per-question values a metric compares against (or None).
        write_reference: (path, split, evaluation result) -> path: writes what `read_reference` reads.
        load_files: (folder, forget split, read) -> splits, for a benchmark whose data the user holds (real
            TOFU); `read(path, layout)` reads and checks one file.
        pretrained: a shipped model (grom_core.checkpoints) that is the benchmark's target as it is: nothing is
            trained, `generate(config, model_dir)` reads its knowledge, and the reference is its own evaluation.
        base: a shipped model that the target and retain models are fine-tuned from (full fine-tuning with the
            config's `train` recipe, in `prompt_format`), instead of tiny Llamas trained from scratch.
        prompt_format: how the unlearning inputs' QA pairs become text (grom_core.data.PROMPT_FORMATS).
        trainer: the gradient methods' recipe on this benchmark's model (TrainerParams fields): a pretrained model
            takes TOFU's small learning rate, a tiny one a large one.
        grom_target: what the closed form must do on this benchmark's task (GromParams.target): "suppress" the
            answers (QA and text), or "corrupt" the representations (multiple choice: suppressing the right
            choice's tokens drives accuracy below chance, which gives the answer away). A property of the task,
            not a tuned preset.
    """

    name: str
    config: object | None
    generate: Callable | None
    training_rows: Callable | None
    evaluate: Callable
    forget_splits: dict[str, str]
    default_split: str
    unlearning_inputs: Callable
    metrics: MetricKeys
    read_reference: Callable[[Path], object]
    write_reference: Callable[[Path, str, dict], Path]
    load_files: Callable[..., dict[str, list[dict]]] | None = None
    pretrained: str | None = None
    base: str | None = None
    prompt_format: str = "qa"
    trainer: dict = field(default_factory=dict)
    grom_target: str = "suppress"

    def params_for(self, method: str, gradient: bool) -> dict:
        """What `method` runs with on this benchmark besides its defaults: a gradient method the recipe, the closed
        form the task's target kind; no tuned preset (issue 13: one default everywhere)."""
        values: dict = {}
        if method == "grom" and self.grom_target != "suppress":
            values["target"] = self.grom_target
        if gradient and self.trainer:
            values["trainer"] = dict(self.trainer)
        return values


def _tofu_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    """QA pairs, each naming its author as its subject where the row says who it is about (minitofu's rows; TOFU's
    files do not), which gives the closed form its counterfactual drops."""
    def qa(rows):
        return [{"question": r["question"], "answer": r["answer"],
                 **({"subject": r["author"]} if r.get("author") and r["author"] in r["question"] else {})}
                for r in rows]
    return qa(splits[split]), qa(splits[minitofu.RETAIN_OF[split]])


def _muse_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    return ([{"text": d["text"]} for d in splits["forget"]] + splits["forget_qa"],
            [{"text": d["text"]} for d in splits["retain"]] + splits["retain_qa"])


def _wmdp_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    return splits["forget_corpus"], splits["retain_corpus"]


def _read_tofu_reference(path: Path):
    ratios = read_tofu_log(path).forget_truth_ratios
    if ratios.size == 0:
        raise DataError(f"{path} holds no per-question forget truth ratios; write it with "
                        f"`grom evaluate --save-reference`")
    return ratios


def _write_tofu_reference(path: Path, split: str, result: dict) -> Path:
    return write_reference(path, result["metrics"], result["per_question"]["forget_truth_ratio"])


def _tofu_chat_evaluate(model, tokenizer, splits, split, reference, *, batch_size: int = 32,
                        max_new_tokens: int = 200):
    return minitofu.evaluate(model, tokenizer, splits, split, reference, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, fmt="chat")


def _rwku_evaluate(model, tokenizer, splits, split, reference, *, batch_size: int = 32, max_new_tokens: int = 0):
    return minirwku.evaluate(model, tokenizer, splits, split, reference, batch_size=batch_size)


def _zsre_evaluate(model, tokenizer, splits, split, reference, *, batch_size: int = 32, max_new_tokens: int = 0):
    return minizsre.evaluate(model, tokenizer, splits, split, reference, batch_size=batch_size)


def _read_json_metrics(path: Path) -> dict:
    metrics = read_json_object(path, "reference file").get("metrics")
    if not isinstance(metrics, dict):
        raise DataError(f"{path} has no metrics; write it with `grom evaluate --save-reference`")
    return metrics


def _read_muse_reference(path: Path) -> float:
    auc = read_json_object(path, "reference file").get("per_question", {}).get("auc")
    if auc is None:
        raise DataError(f"{path} has no per_question.auc; write it with `grom evaluate --save-reference`")
    return float(auc)


def _no_reference(path: Path) -> None:
    return None


def _write_json_reference(path: Path, split: str, result: dict) -> Path:
    """The evaluation's metrics and per-question values as JSON (what `_read_muse_reference` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"split": split, "metrics": result["metrics"],
                                "per_question": result["per_question"]}, indent=1))
    return path


def _muse_evaluate(model, tokenizer, splits, split, reference, *, batch_size: int = 16, max_new_tokens: int = 0):
    return minimuse.evaluate(model, tokenizer, splits, split, reference, batch_size=batch_size)


def _wmdp_evaluate(model, tokenizer, splits, split, reference, *, batch_size: int = 32, max_new_tokens: int = 0):
    return miniwmdp.evaluate(model, tokenizer, splits, split, reference, batch_size=batch_size)


TOFU_METRICS = MetricKeys(forget="forget_rougeL_recall", utility="model_utility",
                          recovery=("forget_rougeL_recall", "forget_probability"),
                          table=("forget_rougeL_recall", "forget_quality", "model_utility", "tofu_final",
                                 "forget_probability", "forget_extraction_strength", "forget_truth_ratio",
                                 "forget_paraphrased_nll", "forget_perturbed_nll", "retain_rougeL_recall",
                                 "retain_probability"))
MUSE_METRICS = MetricKeys(forget="verbmem_rougeL_f1", utility="utility_preservation_rougeL_f1",
                          recovery=("verbmem_rougeL_f1", "knowmem_forget_rougeL_f1"),
                          table=("verbmem_rougeL_f1", "knowmem_forget_rougeL_f1", "utility_preservation_rougeL_f1",
                                 "muse_final", "privleak", "mia_auc"))
RWKU_METRICS = MetricKeys(forget="forget_accuracy", utility="neighbor_accuracy",
                          recovery=("forget_fb_accuracy", "forget_qa_accuracy", "forget_adv_accuracy"),
                          table=("forget_fb_accuracy", "forget_qa_accuracy", "forget_adv_accuracy",
                                 "neighbor_fb_accuracy", "neighbor_qa_accuracy", "utility_world_facts_accuracy",
                                 "utility_real_authors_accuracy", "utility_perplexity", "mia_auc"))
ZSRE_METRICS = MetricKeys(forget="rewrite_accuracy", utility="specificity",
                          recovery=("rewrite_accuracy", "paraphrase_accuracy"),
                          table=("efficacy", "generalization", "specificity", "fluency", "rewrite_accuracy",
                                 "paraphrase_accuracy"), shown=4)
WMDP_METRICS = MetricKeys(forget="forget_accuracy", utility="retain_accuracy", recovery=("forget_accuracy",),
                          table=("forget_accuracy", "retain_accuracy", "wmdp_final", "chance_accuracy"))


# The gradient methods' recipe on a pretrained model (TOFU's, lr 1e-5 for 10 epochs, in batches that fit a forget
# set of 3-30 examples), and the full fine-tuning that puts a benchmark's data into a shipped model (AdamW).
PRETRAINED_RECIPE = RECIPES[PRETRAINED]
FINETUNE_RECIPE = TrainConfig(epochs=8, lr=3e-4, batch_size=8, warmup_steps=5)

# Adding a benchmark: one module (generate, training_rows, evaluate) plus one entry here.
BENCHMARKS: dict[str, Benchmark] = {
    "minitofu": Benchmark("minitofu", minitofu.MiniTofuConfig(), minitofu.generate, minitofu.training_rows,
                          minitofu.evaluate, dict(minitofu.RETAIN_OF), "forget10", _tofu_inputs, TOFU_METRICS,
                          _read_tofu_reference, _write_tofu_reference),
    # TOFU's protocol on a real chat model: SmolLM2-135M-Instruct fine-tuned on 20 authors x 10 questions through
    # its chat template (about 8 minutes a model on 2 cores); forget10 and forget05 are 2 and 1 authors; 60
    # questions of each utility set
    "minitofu-smollm2": Benchmark(
        "minitofu-smollm2", minitofu.MiniTofuConfig(
            authors=20, questions=10, retain_eval_questions=60, utility_questions=60, train=FINETUNE_RECIPE),
        minitofu.generate, minitofu.author_rows,
        _tofu_chat_evaluate, dict(minitofu.RETAIN_OF), "forget10", _tofu_inputs, TOFU_METRICS,
        _read_tofu_reference, _write_tofu_reference, base="smollm2", prompt_format="chat",
        trainer=PRETRAINED_RECIPE),
    "tofu": Benchmark("tofu", None, None, None, minitofu.evaluate, dict(minitofu.RETAIN_OF), "forget10",
                      _tofu_inputs, TOFU_METRICS, _read_tofu_reference, _write_tofu_reference,
                      load_files=minitofu.tofu_splits_from_files),
    "minimuse": Benchmark("minimuse", minimuse.MiniMuseConfig(), minimuse.generate, minimuse.training_rows,
                          _muse_evaluate, {"forget": "retain"}, "forget", _muse_inputs, MUSE_METRICS,
                          _read_muse_reference, _write_json_reference),
    # minimuse's articles, passages and their questions fine-tuned into SmolLM2-135M-Instruct (the target on forget
    # and retain, the retain model on retain), with minitofu-smollm2's recipe
    "minimuse-smollm2": Benchmark(
        "minimuse-smollm2", minimuse.MiniMuseConfig(train=FINETUNE_RECIPE),
        minimuse.generate, minimuse.training_rows, _muse_evaluate, {"forget": "retain"}, "forget", _muse_inputs,
        MUSE_METRICS, _read_muse_reference, _write_json_reference, base="smollm2",
        trainer=PRETRAINED_RECIPE),
    "miniwmdp": Benchmark("miniwmdp", miniwmdp.MiniWmdpConfig(), miniwmdp.generate, miniwmdp.training_rows,
                          _wmdp_evaluate, {"forget": "retain"}, "forget", _wmdp_inputs, WMDP_METRICS,
                          _no_reference, _write_json_reference, grom_target="corrupt"),
    "minirwku": Benchmark("minirwku", minirwku.MiniRwkuConfig(), minirwku.generate, None, _rwku_evaluate,
                          {split: "retain_corpus" for split in minirwku.TARGETS}, "forget05",
                          minirwku.unlearning_inputs, RWKU_METRICS, _read_json_metrics, _write_json_reference,
                          pretrained="smollm2", prompt_format="completion",
                          trainer=PRETRAINED_RECIPE),
    "minizsre": Benchmark("minizsre", minizsre.MiniZsreConfig(), minizsre.generate, None, _zsre_evaluate,
                          {split: "retain_facts" for split in minizsre.SPLITS}, "edit10", minizsre.unlearning_inputs,
                          ZSRE_METRICS, _read_json_metrics, _write_json_reference, pretrained="smollm2",
                          prompt_format="completion",
                          trainer=PRETRAINED_RECIPE),
}


def benchmarks() -> dict[str, Benchmark]:
    """The registry."""
    return BENCHMARKS


def get_benchmark(name: str, config: object | None = None) -> Benchmark:
    registry = benchmarks()
    if name not in registry:
        raise DataError(f"unknown benchmark '{name}'; benchmarks: {', '.join(registry)}")
    bench = registry[name]
    if config is not None:
        bench = dataclasses.replace(bench, config=config)
    return bench


def check_split(bench: Benchmark, split: str | None) -> str:
    split = split or bench.default_split
    if split not in bench.forget_splits:
        raise DataError(f"{bench.name} has no forget split '{split}'; choose one of {sorted(bench.forget_splits)}")
    return split


@dataclass
class BuiltBenchmark:
    """Where a built benchmark lives: split name -> JSONL path, and the target and retain model directories."""

    name: str
    root: Path
    split: str
    splits: dict[str, Path]
    models: dict[str, Path]
    checks: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"benchmark": self.name, "split": self.split, "root": str(self.root),
                "splits": {k: str(v) for k, v in self.splits.items()},
                "models": {k: str(v) for k, v in self.models.items()}, "checks": self.checks}

    def load_splits(self) -> dict[str, list[dict]]:
        return {name: read_split(path) for name, path in self.splits.items()}

    def unlearning_inputs(self) -> tuple[list[dict], list[dict]]:
        """(forget rows, retain rows) an unlearning method gets for this build's forget split."""
        return get_benchmark(self.name).unlearning_inputs(self.load_splits(), self.split)

    def unlearning_files(self) -> tuple[Path, Path]:
        """The unlearning inputs as JSONL files (what `grom unlearn` and the flows read)."""
        paths = []
        for role, rows in zip(("forget", "retain"), self.unlearning_inputs(), strict=True):
            path = self.root / "unlearning" / f"{self.split}-{role}.jsonl"
            write_jsonl(path, rows)
            paths.append(path)
        return paths[0], paths[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write rows as JSON lines, leaving an identical file untouched (its mtime too)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def read_split(path: Path) -> list[dict]:
    return read_jsonl(path)


def _digest(bench: Benchmark, model_dir: Path | None = None) -> str:
    config = asdict(bench.config)
    model = model_dir.name if model_dir is not None else None  # a content-addressed folder name
    return data_digest([{"benchmark": bench.name, "config": config, "generator_version": 1, "model": model}])[:12]


def _write_splits(root: Path, splits: dict[str, list[dict]]) -> dict[str, Path]:
    return {name: write_jsonl(root / "splits" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.jsonl", rows)
            for name, rows in splits.items()}


def build(name: str, out: str | Path, *, split: str | None = None, config: object | None = None,
          train_models: bool = True, resolve_model: Callable[[str], Path] | None = None) -> BuiltBenchmark:
    """Write every split as JSONL under `out/<name>-<digest>/` and train (or reuse) the target and retain models.

    The digest covers the generator and training configuration, so a changed configuration builds anew; the models
    are cached under `out/models` by a digest of their training data and configuration. A benchmark with a `base`
    model fine-tunes it (from `resolve_model(base)`) into the target and retain models instead of training tiny
    ones. A benchmark on a
    `pretrained` model gets that model from `resolve_model(name)` (a folder) and trains nothing; its splits depend
    on what the model knows, so they are built once per model and reused (`splits/done.json` marks a complete
    build).
    """
    bench = get_benchmark(name, config)
    split = check_split(bench, split)
    if bench.generate is None:
        raise DataError(f"{name} is read from files, not built: give the folder holding its files (--data-dir)")
    if bench.pretrained is not None:
        if resolve_model is None:
            raise DataError(f"{name} is built on the shipped model '{bench.pretrained}': pass resolve_model")
        model_dir = Path(resolve_model(bench.pretrained))
        root = Path(out) / f"{name}-{_digest(bench, model_dir)}"
        done = root / "splits" / "done.json"
        if done.is_file():
            paths = {n: root / "splits" / f for n, f in json.loads(done.read_text())["splits"].items()}
            log.info("%s: reusing the splits in %s", name, root / "splits")
        else:
            log.info("%s: probing what %s knows", name, model_dir.name)
            paths = _write_splits(root, bench.generate(bench.config, model_dir))
            done.write_text(json.dumps({"splits": {n: p.name for n, p in paths.items()}}))
        return BuiltBenchmark(name=name, root=root, split=split, splits=paths, models={"target": model_dir})
    if bench.base is not None and resolve_model is None:
        raise DataError(f"{name} is fine-tuned from the shipped model '{bench.base}': pass resolve_model")
    base_dir = Path(resolve_model(bench.base)) if bench.base is not None else None
    root = Path(out) / f"{name}-{_digest(bench, base_dir)}"
    splits = bench.generate(bench.config)
    paths = _write_splits(root, splits)
    log.info("%s: %d splits written to %s", name, len(paths), root / "splits")
    models: dict[str, Path] = {}
    if train_models and base_dir is not None:
        for role, without in (("target", None), ("retain", split)):
            rows = as_examples(bench.training_rows(splits, without))
            log.info("%s: %s model, %s fine-tuned on %d examples", name, role, bench.base, len(rows))
            models[role] = finetune_pretrained(rows, base_dir, Path(out) / "models", train_config=bench.config.train,
                                               fmt=bench.prompt_format)
    elif train_models:
        target_rows = as_examples(bench.training_rows(splits, None))
        texts = example_texts(target_rows)  # one tokenizer for both models, trained on everything
        cfg = bench.config
        log.info("%s: target model on %d examples", name, len(target_rows))
        models["target"] = train_tiny_model(target_rows, Path(out) / "models", model_config=cfg.model,
                                            train_config=cfg.train, tokenizer_texts=texts)
        retain_rows = as_examples(bench.training_rows(splits, split))
        log.info("%s: retain model (without %s) on %d examples", name, split, len(retain_rows))
        models["retain"] = train_tiny_model(retain_rows, Path(out) / "models", model_config=cfg.model,
                                            train_config=cfg.train, tokenizer_texts=texts)
    return BuiltBenchmark(name=name, root=root, split=split, splits=paths, models=models)
