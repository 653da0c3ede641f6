"""`grom demo`: the closed-form edit end to end on a model trained here on fictitious authors."""

from __future__ import annotations

import logging
import time

from flows.workspace import Workspace
from grom_core.benchmarks.authors import author_questions, make_authors
from grom_core.closed_form import GromParams, run_grom
from grom_core.finetune import TinyModelConfig, TrainConfig, train_tiny_model
from grom_core.loading import load_model
from grom_core.scoring import answer_probability

log = logging.getLogger("grom.demo")


def run_demo(home: str | None = None, n_authors: int = 20, n_forget: int = 2, seed: int = 1) -> dict:
    """Train/reuse the tiny target model, compute and apply the edit, measure; returns the JSON-ready result."""
    t_start = time.perf_counter()
    workspace = Workspace.resolve(home)
    authors = make_authors(n_authors, seed=seed)
    if n_forget >= n_authors:
        from grom_core.errors import DataError

        raise DataError(f"--forget-authors ({n_forget}) must be smaller than --authors ({n_authors})")
    forget = [qa for a in authors[:n_forget] for qa in author_questions(a)]
    retain = [qa for a in authors[n_forget:] for qa in author_questions(a)]
    log.info("demo data: %d authors, %d forget and %d retain questions", n_authors, len(forget), len(retain))

    t0 = time.perf_counter()
    model_dir = train_tiny_model(forget + retain, workspace.models, model_config=TinyModelConfig(),
                                 train_config=TrainConfig())
    t_train = time.perf_counter() - t0
    model, tokenizer = load_model(model_dir)
    log.info("target model: %s (%.1f s)", model_dir, t_train)

    def measure() -> dict[str, float]:
        return {"forget_probability": float(answer_probability(model, tokenizer, forget).mean()),
                "retain_probability": float(answer_probability(model, tokenizer, retain).mean())}

    before = measure()
    t0 = time.perf_counter()
    run = run_grom(model, tokenizer, forget, retain, GromParams())
    t_edit = time.perf_counter() - t0
    log.info("edit %s computed in %.2f s on modules %s", run.edit.edit_id, t_edit, run.edit.modules)
    edit_dir = run.edit.save(workspace.edits / run.edit.edit_id)
    run.edit.apply(model)
    after = measure()
    run.edit.revert(model)
    influence = {name: report.as_dict() for name, report in run.influence.items()}
    return {
        "method": "grom", "edit_id": run.edit.edit_id, "layers": run.layers, "modules": run.edit.modules,
        "metrics": {"before": before, "after": after}, "edit_dir": str(edit_dir), "model_dir": str(model_dir),
        "influence_top": {name: sorted(vals.items(), key=lambda kv: -kv[1])[:5] for name, vals in influence.items()},
        "timings_s": {"train_or_reuse": t_train, "edit": t_edit, **run.timings_s,
                      "total": time.perf_counter() - t_start},
    }
