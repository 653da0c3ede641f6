"""The typed records that the pipeline's stages hand each other: small, frozen, JSON-able values (paths, digests,
counts, flat metric dicts), never tensors or models.

    ingest -> Ingested -> unlearn -> Unlearned -> apply and save -> Edited -> audit -> Audit
           -> evaluate -> Evaluation (before, after) -> quantization -> {attack: metrics}
           -> Outcome -> register -> Registration -> commit (catalog rows)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from grom_core.errors import ParamsError
from grom_core.fingerprint import data_digest, text_sha256
from grom_core.params import Params

# an example's columns as the lake stores them; `subject` (optional) names what a QA pair is about and is text of the
# example too (a purge nulls it with the rest)
TEXT_COLUMNS = ("question", "answer", "text", "subject")


def text_rows(rows) -> list[dict]:
    """The examples of stored rows (question/answer, with their subject where one is given, or text), without their
    sha256 and empty columns."""
    return [{k: v for k, v in r.items() if k in TEXT_COLUMNS and v is not None} for r in rows]


def example_sha256(row: Mapping) -> str:
    """The sha256 that identifies an example once its text is purged."""
    content = row.get("text") if row.get("text") is not None else f"{row['question']}\n{row['answer']}"
    return text_sha256(content)


def with_sha256(row: Mapping) -> dict:
    return {**row, "sha256": example_sha256(row)}


@dataclass(frozen=True)
class Dataset:
    """One ingested data file, as the lake holds it (Parquet, one row per example with its sha256)."""

    role: str  # forget, retain or request
    name: str
    digest: str  # of the rows' content (data_digest)
    path: str  # the Parquet file in the lake
    source: str  # the file the user gave
    n: int

    def rows(self) -> list[dict]:
        """The examples (question/answer or text), without their sha256."""
        return text_rows(self.rows_with_sha())

    def rows_with_sha(self) -> list[dict]:
        import pyarrow.parquet as pq

        return pq.read_table(self.path).to_pylist()

    def catalog_row(self) -> dict:
        """What the catalog stores: the dataset and its examples (with sha256)."""
        return {"digest": self.digest, "name": self.name, "role": self.role, "source": self.source,
                "examples": self.rows_with_sha()}


@dataclass(frozen=True)
class Ingested:
    forget: Dataset
    retain: Dataset


@dataclass(frozen=True)
class Cost:
    """What the unlearning itself cost, measured in process around the method's entry point."""

    seconds: float
    peak_rss_mb: float
    peak_cuda_mb: float | None = None
    steps: int = 0
    forward_passes: int | None = None


@dataclass(frozen=True)
class StatsUsage:
    """The retain statistics a solve used: module -> cached file and retain positions; which were reused."""

    fingerprint: str
    digest: str
    paths: Mapping[str, str]
    counts: Mapping[str, int]
    reused: tuple[str, ...]

    @property
    def cache_hit(self) -> bool:
        return bool(self.paths) and set(self.reused) == set(self.paths)


@dataclass(frozen=True)
class Unlearned:
    """A method's edit, saved to the workspace, and what it was made from."""

    method: str
    params: Mapping  # the method's parameters (Params.to_dict)
    edit_id: str
    edit_dir: str
    modules: tuple[str, ...]
    base_fingerprint: str
    cost: Cost
    layers: tuple[int, ...] = ()
    layer_scores: tuple[dict, ...] = ()
    records_path: str | None = None  # keys and targets of closed-form solves (for the influence audit)
    stats: StatsUsage | None = None
    key_shards: tuple[dict, ...] = ()
    timings_s: Mapping[str, float] = field(default_factory=dict)  # the method's own stages
    peaks_mb: Mapping[str, float] = field(default_factory=dict)  # their peak resident memory

    def as_json(self) -> dict:
        return {"seconds": self.cost.seconds, "peak_rss_mb": self.cost.peak_rss_mb,
                "peak_cuda_mb": self.cost.peak_cuda_mb, "steps": self.cost.steps,
                "forward_passes": self.cost.forward_passes,
                "cached_stats": self.stats.cache_hit if self.stats else None,
                "stages_s": dict(self.timings_s), "stages_peak_mb": dict(self.peaks_mb)}


@dataclass(frozen=True)
class Edited:
    """The edited model, saved (safetensors), and the fingerprint of its weights."""

    model_dir: str
    fingerprint: str


@dataclass(frozen=True)
class Audit:
    """The influence audit: one Parquet row per (forget example, module)."""

    path: str
    rows: int
    flagged: int

    def read(self) -> list[dict]:
        import pyarrow.parquet as pq

        return pq.read_table(self.path).to_pylist()


@dataclass(frozen=True)
class EvaluationSpec:
    """What a model is evaluated on: a shipped benchmark's split (its files and the retain model's reference) or,
    with no benchmark, the forget and retain data themselves (probability and ROUGE-L, at most max_examples)."""

    benchmark: str | None = None
    split: str | None = None
    splits: Mapping[str, str] = field(default_factory=dict)  # split name -> JSONL path
    reference: str | None = None
    forget: str | None = None  # own data: lake Parquet paths
    retain: str | None = None
    max_examples: int = 200
    prompt_format: str = "qa"  # own data: how its QA pairs become text

    def digest(self) -> str:
        return data_digest([{k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(self).items()}])


@dataclass(frozen=True)
class EvaluationSettings(Params):
    """How a run checks its edit (a service's `--evaluation`, `grom unlearn --attacks/--quantizers`), checked like a
    method's parameters: unknown keys, wrong types and unknown attack names are refused by name.

    Args:
        max_examples: own data: at most this many forget and this many retain examples are evaluated (a count).
        quantizers: the quantize-dequantize attacks (grom_core.quantization.quantizers; those needing bitsandbytes
            are noted and skipped where it is missing); empty: none.
        attacks: the attacks that read around the edit (grom_core.attacks.ATTACKS); empty: none.
    """

    max_examples: int = 200
    quantizers: tuple[str, ...] = ("fp4", "nf4")
    attacks: tuple[str, ...] = ("head_swap", "logit_lens", "relearn")

    def validate(self) -> None:
        from grom_core.attacks import ATTACKS
        from grom_core.quantization import quantizers

        if self.max_examples < 1:
            raise ParamsError(f"EvaluationSettings.max_examples must be at least 1, got {self.max_examples}")
        for field_name, known in (("quantizers", tuple(quantizers(available=True))), ("attacks", ATTACKS)):
            unknown = [n for n in getattr(self, field_name) if n not in known]
            if unknown:
                raise ParamsError(f"EvaluationSettings.{field_name} has no {', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(known)}")


@dataclass(frozen=True)
class Evaluation:
    metrics: Mapping[str, object]  # flat: metric name -> number (or None where it does not apply)
    seconds: float


@dataclass(frozen=True)
class Outcome:
    """Everything a run computed before registration."""

    model: str
    ingested: Ingested
    unlearned: Unlearned
    edited: Edited
    audit: Audit | None
    before: Mapping
    after: Mapping
    quantized: Mapping
    plots: str
    attacks: Mapping = field(default_factory=dict)  # attack that reads around the edit -> metrics (read_around)

    def metrics(self) -> dict:
        return {"before": dict(self.before), "after": dict(self.after), "quantized": dict(self.quantized),
                "attacks": dict(self.attacks)}

    def catalog_rows(self, registration, *, flow: str, started: datetime, timings: Mapping,
                     extra_metrics: Mapping | None = None) -> dict:
        """What `record_run` writes: datasets, edit, influence, layer scores, key shards, statistics cache entries
        and the runs row."""
        u, data = self.unlearned, self.ingested
        stats = u.stats
        return {
            "datasets": [d.catalog_row() for d in (data.forget, data.retain)],
            "edit": {"edit_id": u.edit_id, "method": u.method, "base_fingerprint": u.base_fingerprint,
                     "edited_fingerprint": self.edited.fingerprint, "modules": list(u.modules),
                     "layers": list(u.layers), "params": dict(u.params), "edit_dir": u.edit_dir},
            "influence": self.audit.read() if self.audit else [],
            "layer_scores": list(u.layer_scores), "key_shards": list(u.key_shards),
            "stats_cache": [{"fingerprint": stats.fingerprint, "retain_digest": stats.digest, "module": m,
                             "path": p, "n_positions": stats.counts[m]} for m, p in stats.paths.items()]
            if stats else [],
            "run": {"run_id": registration.run_id, "flow": flow, "method": u.method,
                    "compose": u.params.get("compose"), "base_fingerprint": u.base_fingerprint,
                    "edited_fingerprint": self.edited.fingerprint, "edit_id": u.edit_id,
                    "forget_digest": data.forget.digest, "retain_digest": data.retain.digest,
                    "mlflow_run_id": registration.run_id, "model_name": registration.model_name,
                    "model_version": registration.version, "model_dir": self.edited.model_dir,
                    "base_model_dir": self.model,
                    "metrics": {**self.metrics(), **(extra_metrics or {})}, "timings": dict(timings),
                    "started_at": started},
        }

    def summary(self, registration, timings: Mapping, workspace: Path, peaks: Mapping | None = None) -> dict:
        """The flow's result (what `--json` prints); `peaks`: each stage's peak resident memory (MB)."""
        u = self.unlearned
        return {
            "method": u.method, "compose": u.params.get("compose"), "edit_id": u.edit_id, "layers": list(u.layers),
            "modules": list(u.modules), "cached_stats": u.stats.cache_hit if u.stats else None,
            "metrics": self.metrics(), "unlearning": u.as_json(), "timings_s": dict(timings),
            "peak_rss_mb": u.cost.peak_rss_mb, "stage_peak_mb": dict(peaks or {}),
            "mlflow": {"run_id": registration.run_id, "model_name": registration.model_name,
                       "version": registration.version},
            "model_dir": self.edited.model_dir, "edited_fingerprint": self.edited.fingerprint, "edit_dir": u.edit_dir,
            "influence": asdict(self.audit) if self.audit else None, "workspace": str(workspace),
        }
