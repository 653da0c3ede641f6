"""MLflow on SQLite under the workspace: one run per flow run, its inputs, metrics and artifacts, the edited
model registered as a new version with lineage tags, and the `serving` alias that marks the version in service.

If anything fails after the run started, the run is marked FAILED and any model version it created is deleted,
so the registry never holds a half-registered version. Inside a Prefect transaction (`prefect.transactions.
transaction()`), `register` and `set_serving` also stage their compensation as rollback hooks: if a later step of
the transaction fails (the catalog commit), the version is deleted and the alias moved back, in reverse order.

Tags grom puts on the versions it registers: `grom.kind` (base, unlearn, request, revert), `grom.storage` (full,
edit or same: how the version keeps its weights, see `tasks.versions`), `fingerprint` (of the version's weights),
`model_dir` (a local folder with them), `parent_version` (the version it was computed from), `edit_id`,
`base_fingerprint`, `request_ids`, `promoted`, and on a revert `reverts` and `restores`.

Every run and version `register` creates also carries `grom.commit`: "pending" from the run's first write, turned
to "committed" when the Prefect transaction around it commits (after the catalog commit). A pending registration
whose owner is dead is what `flows.reconcile` may delete; nothing else.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from grom_core.errors import DataError
from tasks.names import safe_name

log = logging.getLogger(__name__)

EXPERIMENT = "grom-unlearning"
SERVING_ALIAS = "serving"
COMMIT_TAG, PENDING, COMMITTED = "grom.commit", "pending", "committed"
MODEL_TAG = "grom.model_name"  # on the run: which registered model it registers into (a run may die before)


@contextmanager
def quiet_registry_events() -> Iterator[None]:
    """MLflow's registry events ("Successfully registered model ...", "Created version ...") are prints to its
    logging stream, not log records: where its logger is above INFO (MLFLOW_LOGGING_LEVEL), what that stream is
    given during the block goes to this module's DEBUG log instead. (Its own on/off switch is not enough:
    `log_model` switches it back on.) Exceptions still propagate."""
    from mlflow.utils import logging_utils

    stream = logging_utils.MLFLOW_LOGGING_STREAM
    if logging.getLogger("mlflow").getEffectiveLevel() <= logging.INFO:
        yield
        return

    def to_debug(text: str) -> None:
        if text.strip():
            log.debug("mlflow: %s", text.strip())

    stream.write = to_debug  # the instance attribute shadows the class's write for the block
    try:
        yield
    finally:
        del stream.write


def configure(root: Path) -> str:
    """Point MLflow at `<root>/mlflow.db` (tracking and registry) with artifacts in `<root>/mlartifacts`."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
    import mlflow

    uri = f"sqlite:///{root / 'mlflow.db'}"
    if mlflow.get_tracking_uri() != uri:
        # MLflow keeps each run's artifact store in a process-wide cache keyed by run id; a copied workspace has
        # the same run ids at other locations, so a process that used another workspace must not reuse them
        from mlflow.tracking._tracking_service import utils as tracking_utils

        cache = getattr(tracking_utils, "_artifact_repos_cache", None)
        if cache is not None:
            cache.clear()
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


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def check_model_name(name: str) -> str:
    """A registered model name grom creates: letters, digits, '_', '.', '-' (it names folders and MLflow paths)."""
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        raise DataError(f"model name {name!r} is not allowed: use letters, digits, '_', '.' and '-' (at most 100, "
                        f"starting with a letter or digit), e.g. grom-{safe_name(name).strip('._-')[:40] or 'model'}")
    return name


def _on_rollback(undo: Callable[[], None]) -> None:
    """Stage `undo` as a rollback hook of the open Prefect transaction (none open: nothing to stage)."""
    from prefect.transactions import get_transaction

    txn = get_transaction()
    if txn is not None:
        txn.stage(None, on_rollback_hooks=[lambda _txn: undo()])


def _on_commit(done: Callable[[], None]) -> None:
    """Stage `done` to run when the open Prefect transaction commits (none open: it never runs)."""
    from prefect.transactions import get_transaction

    txn = get_transaction()
    if txn is not None:
        txn.stage(None, on_commit_hooks=[lambda _txn: done()])


def _flat(prefix: str, metrics: dict) -> dict[str, float]:
    return {f"{prefix}.{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float) and v == v}


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("torch", "transformers", "tokenizers", "safetensors")]


def register(root: Path, *, run_name: str, model_name: str, params: dict, metrics: dict, datasets: list[dict],
             artifacts: dict[str, Path], model_dir: Path | None, tags: dict[str, str],
             version_source: str | None = None) -> Registration:
    """Log one run and register a model version; on failure, undo what was created and re-raise.

    Args:
        metrics: {"before": {...}, "after": {...}, ...} flat dicts, logged as "<group>.<name>".
        datasets: [{"name", "role", "digest", "path"}] logged as run inputs (Parquet paths).
        artifacts: artifact sub-folder -> file or folder to log.
        model_dir: a save_pretrained folder, logged with mlflow.transformers and registered with full weights.
        version_source: instead of `model_dir`, the artifact sub-folder of this run that the version points at (an
            edit: `tasks.versions` materialises its weights from its parent on demand).
        tags: set on the run and on the model version (base fingerprint, edit id, request ids...).
    """
    configure(root)
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    version = None
    tags = {**tags, COMMIT_TAG: PENDING}
    with (mlflow.start_run(run_name=run_name, tags={COMMIT_TAG: PENDING, MODEL_TAG: model_name}) as run,
          quiet_registry_events()):
        try:
            mlflow.set_tags(tags)
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
            for group, values in metrics.items():
                if isinstance(values, dict):
                    mlflow.log_metrics(_flat(group, values))
            for ds in datasets:
                with warnings.catch_warnings():
                    # MLflow registers its local-file source class twice and warns that a path "can be
                    # interpreted in multiple ways" (both ways are LocalArtifactDatasetSource)
                    warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
                    source = resolve_dataset_source(str(ds["path"]))
                mlflow.log_input(MetaDataset(source=source, name=ds["name"], digest=ds["digest"][:36]),
                                 context=ds["role"])
            for sub, path in artifacts.items():
                path = Path(path)
                if path.is_dir():
                    mlflow.log_artifacts(str(path), artifact_path=sub)
                elif path.is_file():
                    mlflow.log_artifact(str(path), artifact_path=sub)
            if model_dir is not None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True)
                tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
                info = mlflow.transformers.log_model(
                    transformers_model={"model": model, "tokenizer": tokenizer}, name="model",
                    task="text-generation", pip_requirements=_pip_requirements(),
                    registered_model_name=model_name)
                version = str(info.registered_model_version)
                for key, value in tags.items():
                    client.set_model_version_tag(model_name, version, key, str(value))
            elif version_source is not None:
                _ensure_registered_model(client, model_name)
                version = str(client.create_model_version(
                    model_name, source=f"{run.info.artifact_uri}/{version_source}", run_id=run.info.run_id,
                    tags={k: str(v) for k, v in tags.items()}).version)
            if version is not None:
                log.info("registered %s version %s", model_name, version)
        except BaseException:
            if version is not None:
                client.delete_model_version(model_name, version)
            mlflow.end_run(status="FAILED")
            raise
    registration = Registration(run_id=run.info.run_id, model_name=model_name, version=version)
    _on_rollback(lambda: delete_registration(root, registration))
    _on_commit(lambda: mark_committed(root, registration))
    return registration


def mark_committed(root: Path, registration: Registration) -> None:
    """Record in the registry that the catalog committed this registration (reconcile never deletes it then). A
    failure here is logged, not raised: the catalog already holds the run, which is what reconcile reads first."""
    try:
        mlflow_client = client(root)
        mlflow_client.set_tag(registration.run_id, COMMIT_TAG, COMMITTED)
        if registration.version is not None:
            mlflow_client.set_model_version_tag(registration.model_name, registration.version, COMMIT_TAG,
                                                COMMITTED)
    except Exception as exc:  # noqa: BLE001 - the commit already happened; this is bookkeeping
        log.warning("could not mark run %s committed in the registry (%s); the catalog records it",
                    registration.run_id, exc)


def _ensure_registered_model(mlflow_client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def delete_registration(root: Path, registration: Registration) -> None:
    """Compensate a registration whose catalog commit failed: delete the version, mark the run FAILED."""
    configure(root)
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if registration.version is not None:
        client.delete_model_version(registration.model_name, registration.version)
    client.set_terminated(registration.run_id, status="FAILED")


def client(root: Path):
    configure(root)
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def serving_version(root: Path, name: str) -> str | None:
    """The version the `serving` alias points at, or None (no alias, or no such registered model)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client(root).get_model_version_by_alias(name, SERVING_ALIAS).version)
    except MlflowException:
        return None


def set_serving(root: Path, name: str, version: str | None) -> None:
    """Point the `serving` alias at `version` (None removes it); in a transaction, a rollback moves it back."""
    previous = serving_version(root, name)
    _move_alias(root, name, version)
    if previous != (str(version) if version is not None else None):
        _on_rollback(lambda: _move_alias(root, name, previous))


def _move_alias(root: Path, name: str, version: str | None) -> None:
    mlflow_client = client(root)
    if version is None:
        mlflow_client.delete_registered_model_alias(name, SERVING_ALIAS)
    else:
        mlflow_client.set_registered_model_alias(name, SERVING_ALIAS, str(version))
    log.info("alias %s of %s -> %s", SERVING_ALIAS, name, version)


def get_version(root: Path, name: str, version: str):
    """The ModelVersion, or a clear error naming the versions that do exist."""
    from mlflow.exceptions import MlflowException

    mlflow_client = client(root)
    try:
        return mlflow_client.get_model_version(name, str(version))
    except MlflowException as exc:
        existing = sorted(int(v.version) for v in versions(root, name))
        raise DataError(f"registered model '{name}' has no version {version} (it has {existing or 'none'}); "
                        f"list them with `grom request list` or in the MLflow UI") from exc


def versions(root: Path, name: str) -> list:
    """Every version of `name`. Listed page by page and matched here, so no filter string is built from a name
    (a quote in it would change the query)."""
    mlflow_client = client(root)
    found, token = [], None
    while True:
        page = mlflow_client.search_model_versions(max_results=1000, page_token=token)
        found += [v for v in page if v.name == name]
        token = page.token
        if not token:
            return found
