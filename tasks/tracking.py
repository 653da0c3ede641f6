"""MLflow on SQLite under the workspace: one run per flow run, its inputs, metrics and artifacts, and the edited
model registered as a new version with lineage tags.

If anything fails after the run started, the run is marked FAILED and any model version it created is deleted,
so the registry never holds a half-registered version.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

EXPERIMENT = "grom-unlearning"


def configure(root: Path) -> str:
    """Point MLflow at `<root>/mlflow.db` (tracking and registry) with artifacts in `<root>/mlartifacts`."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
    import mlflow

    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        mlflow.create_experiment(EXPERIMENT, artifact_location=(root / "mlartifacts").as_uri())
    mlflow.set_experiment(EXPERIMENT)
    return uri


@dataclass
class Registration:
    run_id: str
    model_name: str
    version: str | None


def _flat(prefix: str, metrics: dict) -> dict[str, float]:
    return {f"{prefix}.{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float) and v == v}


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("torch", "transformers", "tokenizers", "safetensors")]


def register(root: Path, *, run_name: str, model_name: str, params: dict, metrics: dict, datasets: list[dict],
             artifacts: dict[str, Path], edited_model_dir: Path | None, tags: dict[str, str]) -> Registration:
    """Log one run and register the edited model; on failure, undo what was created and re-raise.

    Args:
        metrics: {"before": {...}, "after": {...}, ...} flat dicts, logged as "<group>.<name>".
        datasets: [{"name", "role", "digest", "path"}] logged as run inputs (Parquet paths).
        artifacts: artifact sub-folder -> file or folder to log.
        edited_model_dir: a save_pretrained folder; logged with mlflow.transformers and registered.
        tags: set on the run and on the model version (base fingerprint, edit id, request ids...).
    """
    configure(root)
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    version = None
    with mlflow.start_run(run_name=run_name) as run:
        try:
            mlflow.set_tags(tags)
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
            for group, values in metrics.items():
                if isinstance(values, dict):
                    mlflow.log_metrics(_flat(group, values))
            for ds in datasets:
                source = resolve_dataset_source(str(ds["path"]))
                mlflow.log_input(MetaDataset(source=source, name=ds["name"], digest=ds["digest"][:36]),
                                 context=ds["role"])
            for sub, path in artifacts.items():
                path = Path(path)
                if path.is_dir():
                    mlflow.log_artifacts(str(path), artifact_path=sub)
                elif path.is_file():
                    mlflow.log_artifact(str(path), artifact_path=sub)
            if edited_model_dir is not None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                model = AutoModelForCausalLM.from_pretrained(edited_model_dir, local_files_only=True,
                                                             use_safetensors=True)
                tokenizer = AutoTokenizer.from_pretrained(edited_model_dir, local_files_only=True)
                info = mlflow.transformers.log_model(
                    transformers_model={"model": model, "tokenizer": tokenizer}, name="model",
                    task="text-generation", pip_requirements=_pip_requirements(),
                    registered_model_name=model_name)
                version = str(info.registered_model_version)
                for key, value in tags.items():
                    client.set_model_version_tag(model_name, version, key, str(value))
                log.info("registered %s version %s", model_name, version)
        except BaseException:
            if version is not None:
                client.delete_model_version(model_name, version)
            mlflow.end_run(status="FAILED")
            raise
    return Registration(run_id=run.info.run_id, model_name=model_name, version=version)


def delete_registration(root: Path, registration: Registration) -> None:
    """Compensate a registration whose catalog commit failed: delete the version, mark the run FAILED."""
    configure(root)
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if registration.version is not None:
        client.delete_model_version(registration.model_name, registration.version)
    client.set_terminated(registration.run_id, status="FAILED")
