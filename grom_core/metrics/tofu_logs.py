"""Reading TOFU evaluation logs, so that our numbers can stand beside published ones.

Two layouts are understood:
- the original TOFU repository's `eval_log_aggregated.json`: a dict keyed by `eval_log.json` (retain),
  `eval_log_forget.json`, `eval_real_author_wo_options.json`, `eval_real_world_wo_options.json`, each holding
  per-question dicts (`avg_gt_loss`, `avg_paraphrased_loss`, `average_perturb_loss`, `rougeL_recall`, ...);
- open-unlearning's `TOFU_EVAL.json`: one entry per metric with `agg_value` and `value_by_index`. `grom evaluate
  --save-reference` writes this layout too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grom_core.data import read_json_object
from grom_core.errors import DataError
from grom_core.metrics.tofu import SetScores, forget_quality, model_utility

ORIGINAL_FILES = {
    "eval_log.json": "retain",
    "eval_log_forget.json": "forget",
    "eval_real_author_wo_options.json": "real_authors",
    "eval_real_world_wo_options.json": "world_facts",
}
ORIGINAL_FIELDS = ("avg_gt_loss", "avg_paraphrased_loss", "average_perturb_loss", "rougeL_recall")

# open-unlearning metric name -> our flat name
OPEN_UNLEARNING_NAMES = {
    "forget_Q_A_Prob": "forget_probability",
    "forget_Q_A_ROUGE": "forget_rougeL_recall",
    "forget_truth_ratio": "forget_truth_ratio",
    "retain_Q_A_Prob": "retain_probability",
    "retain_Q_A_ROUGE": "retain_rougeL_recall",
    "retain_Truth_Ratio": "retain_truth_ratio",
    "ra_Q_A_Prob_normalised": "real_authors_probability",
    "ra_Q_A_ROUGE": "real_authors_rougeL_recall",
    "ra_Truth_Ratio": "real_authors_truth_ratio",
    "wf_Q_A_Prob_normalised": "world_facts_probability",
    "wf_Q_A_ROUGE": "world_facts_rougeL_recall",
    "wf_Truth_Ratio": "world_facts_truth_ratio",
}


@dataclass
class TofuLog:
    """What one log says about one model: flat aggregate metrics and the per-question forget truth ratios."""

    layout: str
    metrics: dict[str, float]
    forget_truth_ratios: np.ndarray


def _by_index(values: dict) -> list:
    return [values[k] for k in sorted(values, key=lambda k: int(k))]


def set_scores_from_original(name: str, block: dict) -> SetScores:
    missing = [f for f in ORIGINAL_FIELDS if f not in block]
    if missing:
        raise DataError(f"TOFU log section for '{name}' lacks {missing}; expected per-question dicts "
                        f"{list(ORIGINAL_FIELDS)}")
    generated = [g[1] if isinstance(g, list) and len(g) > 1 else "" for g in _by_index(block.get("generated_text", {}))]
    return SetScores(name=name, gt_nll=np.array(_by_index(block["avg_gt_loss"]), dtype=np.float64),
                     paraphrased_nll=np.array(_by_index(block["avg_paraphrased_loss"]), dtype=np.float64),
                     perturbed_nll=np.array(_by_index(block["average_perturb_loss"]), dtype=np.float64),
                     rougeL_recall=np.array(_by_index(block["rougeL_recall"]), dtype=np.float64),
                     generated=generated)


def _read_original(data: dict) -> TofuLog:
    metrics: dict[str, float] = {}
    ratios = np.array([])
    for file_name, set_name in ORIGINAL_FILES.items():
        if file_name not in data:
            continue
        scores = set_scores_from_original(set_name, data[file_name])
        metrics.update(scores.aggregate())
        if set_name == "forget":
            ratios = scores.truth_ratios()
    return TofuLog(layout="tofu", metrics=metrics, forget_truth_ratios=ratios)


def _read_open_unlearning(data: dict) -> TofuLog:
    metrics = {ours: float(data[theirs]["agg_value"]) for theirs, ours in OPEN_UNLEARNING_NAMES.items()
               if theirs in data and isinstance(data[theirs], dict) and "agg_value" in data[theirs]}
    ratios = np.array([])
    if "forget_truth_ratio" in data:
        by_index = data["forget_truth_ratio"].get("value_by_index", {})
        ratios = np.array([v["score"] for v in _by_index(by_index) if v.get("score") is not None], dtype=np.float64)
    return TofuLog(layout="open-unlearning", metrics=metrics, forget_truth_ratios=ratios)


def read_tofu_log(path: str | Path) -> TofuLog:
    """Read either layout; a file in neither gets an error that lists what was expected."""
    data = read_json_object(path, "TOFU log")
    if any(name in data for name in ORIGINAL_FILES):
        return _read_original(data)
    if any(name in data for name in OPEN_UNLEARNING_NAMES):
        return _read_open_unlearning(data)
    raise DataError(f"{path} is neither a TOFU eval_log_aggregated.json (keys {list(ORIGINAL_FILES)}) nor an "
                    f"open-unlearning TOFU_EVAL.json (keys such as {list(OPEN_UNLEARNING_NAMES)[:4]})")


def tofu_score(model_log: TofuLog, retain_log: TofuLog) -> dict:
    """Forget Quality (with n), Model Utility and the parts, from two logs (a model's and the retain model's)."""
    out = dict(model_log.metrics)
    parts = {k: v for k, v in out.items() if not k.startswith("forget_")}
    if len(parts) >= 9:
        out["model_utility"] = model_utility(parts)
    if model_log.forget_truth_ratios.size == 0 or retain_log.forget_truth_ratios.size == 0:
        raise DataError("Forget Quality needs per-question forget truth ratios in both logs; one of them has none")
    out.update(forget_quality(model_log.forget_truth_ratios, retain_log.forget_truth_ratios).as_dict())
    return out


def write_reference(path: str | Path, metrics: dict, forget_truth_ratios: np.ndarray) -> Path:
    """Write per-question forget truth ratios and aggregates in open-unlearning's TOFU_EVAL.json layout."""
    ours_to_theirs = {v: k for k, v in OPEN_UNLEARNING_NAMES.items()}
    data = {ours_to_theirs[k]: {"agg_value": v} for k, v in metrics.items() if k in ours_to_theirs}
    data.setdefault("forget_truth_ratio", {})["value_by_index"] = {
        str(i): {"score": float(r)} for i, r in enumerate(np.asarray(forget_truth_ratios).tolist())}
    if "model_utility" in metrics:
        data["model_utility"] = {"agg_value": metrics["model_utility"]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path
