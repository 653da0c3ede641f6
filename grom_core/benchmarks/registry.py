"""The shipped benchmarks: one registry entry per benchmark, and `build` (splits to JSONL, target and retain models).

Adding a benchmark is one module with `generate`, `training_rows` and `evaluate`, plus one entry here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grom_core.benchmarks import minimuse, minitofu, miniwmdp
from grom_core.data import as_examples
from grom_core.errors import DataError
from grom_core.finetune import example_texts, train_tiny_model
from grom_core.fingerprint import data_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Benchmark:
    """One shipped benchmark.

    Attributes:
        name: registry name.
        config: its generator and training configuration (a frozen dataclass with `model` and `train`).
        generate: config -> split name -> rows.
        training_rows: (splits, without forget split or None) -> rows a model is trained on.
        evaluate: (model, tokenizer, splits, forget split, reference) -> {"metrics", "per_question", "n"}.
        forget_splits: forget split -> the retain split trained without it.
        default_split: the forget split used when none is named.
        unlearning_inputs: forget split -> (forget rows, retain rows) handed to an unlearning method.
        grom_params: GromParams overrides tuned for this benchmark (as MEMIT keeps hyper-parameters per model).
    """

    name: str
    config: object
    generate: Callable
    training_rows: Callable
    evaluate: Callable
    forget_splits: dict[str, str]
    default_split: str
    unlearning_inputs: Callable
    grom_params: dict = field(default_factory=dict)


def _tofu_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    qa = lambda rows: [{"question": r["question"], "answer": r["answer"]} for r in rows]  # noqa: E731
    return qa(splits[split]), qa(splits[minitofu.RETAIN_OF[split]])


def _muse_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    return ([{"text": d["text"]} for d in splits["forget"]] + splits["forget_qa"],
            [{"text": d["text"]} for d in splits["retain"]] + splits["retain_qa"])


def _wmdp_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    return splits["forget_corpus"], splits["retain_corpus"]


def benchmarks() -> dict[str, Benchmark]:
    """The registry (built on call, so that nothing is configured at import time)."""
    return {
        "minitofu": Benchmark("minitofu", minitofu.MiniTofuConfig(), minitofu.generate, minitofu.training_rows,
                              minitofu.evaluate, dict(minitofu.RETAIN_OF), "forget10", _tofu_inputs,
                              # minitofu's facts are shared between authors, so token specificity is low: suppress
                              # every answer token in proportion to it, and ask for a larger drop (measured: forget
                              # ROUGE-L 1.0 -> 0.38, retain probability -9%, Forget Quality 4e-4 -> 7e-4)
                              grom_params={"sharpness": 1.0, "threshold": 0.0, "beta": 80.0}),
        "minimuse": Benchmark("minimuse", minimuse.MiniMuseConfig(), minimuse.generate, minimuse.training_rows,
                              minimuse.evaluate, {"forget": "retain"}, "forget", _muse_inputs),
        "miniwmdp": Benchmark("miniwmdp", miniwmdp.MiniWmdpConfig(), miniwmdp.generate, miniwmdp.training_rows,
                              miniwmdp.evaluate, {"forget": "retain"}, "forget", _wmdp_inputs),
    }


def get_benchmark(name: str, config: object | None = None) -> Benchmark:
    registry = benchmarks()
    if name not in registry:
        raise DataError(f"unknown benchmark '{name}'; shipped benchmarks: {', '.join(sorted(registry))}")
    bench = registry[name]
    if config is not None:
        bench = Benchmark(**{**bench.__dict__, "config": config})
    return bench


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


def read_split(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _digest(bench: Benchmark) -> str:
    config = asdict(bench.config)
    return data_digest([{"benchmark": bench.name, "config": config, "generator_version": 1}])[:12]


def build(name: str, out: str | Path, *, split: str | None = None, config: object | None = None,
          train_models: bool = True) -> BuiltBenchmark:
    """Write every split as JSONL under `out/<name>-<digest>/` and train (or reuse) the target and retain models.

    The digest covers the generator and training configuration, so a changed configuration builds anew; the models
    are cached under `out/models` by a digest of their training data and configuration.
    """
    bench = get_benchmark(name, config)
    split = split or bench.default_split
    if split not in bench.forget_splits:
        raise DataError(f"{name} has no forget split '{split}'; choose one of {sorted(bench.forget_splits)}")
    root = Path(out) / f"{name}-{_digest(bench)}"
    splits = bench.generate(bench.config)
    paths = {}
    (root / "splits").mkdir(parents=True, exist_ok=True)
    for split_name, rows in splits.items():
        path = root / "splits" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', split_name)}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        paths[split_name] = path
    log.info("%s: %d splits written to %s", name, len(paths), root / "splits")
    models: dict[str, Path] = {}
    if train_models:
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
