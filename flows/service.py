"""The deletion-request service around the flows: register the model in service, queue requests, revert a
version. What `grom model register`, `grom request add|list|show` and `grom revert` do, apart from printing.

Every command checks its inputs before it writes anything, and writes the catalog in one transaction after the
registry, undoing the registry step when that transaction fails: a failed command leaves both as they were.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path

from prefect.transactions import transaction

from flows.rebuild import SERVICE_ARTIFACT
from flows.reconcile import reconcile
from flows.workspace import Workspace
from grom_core.data import prompt_format as data_prompt_format
from grom_core.edit import Edit, Undo
from grom_core.errors import DataError, FingerprintMismatchError
from grom_core.fingerprint import data_digest, weights_fingerprint
from grom_core.gates import Gates
from grom_core.loading import check_model_dir
from grom_core.methods import DEFAULT_METHOD
from tasks import requests as queue
from tasks.catalog import now, record_run
from tasks.datafiles import read_examples
from tasks.lake import atomic_parquet, rows_table
from tasks.names import safe_name
from tasks.records import EvaluationSettings
from tasks.steps import load_for_edit
from tasks.tracking import Registration, check_model_name, get_version, register, serving_version, set_serving
from tasks.versions import FULL, SAME, STORAGE_TAG, materialize, storage, version_model_dir

log = logging.getLogger("grom.service")

def register_model(model: str, retain: str, *, name: str | None = None, home: str | None = None,
                   params: dict | None = None, gates: dict | None = None, evaluation: dict | None = None,
                   prompt_format: str = "qa", method: str = DEFAULT_METHOD) -> dict:
    """Register a base model in MLflow as a service that answers deletion requests with `method` (a name in
    grom_core.methods.METHODS) and its `params`.

    The retain data is copied into the lake (Parquet) so later runs do not depend on the file staying put. When
    the registered model has no version in service yet, the `serving` alias points at the new version.
    """
    ws = Workspace.resolve(home)
    from flows.preflight import preflight

    params = preflight(model, None, retain, method, params).to_dict()
    prompt_format = data_prompt_format(prompt_format).name
    gates = asdict(Gates.from_dict(gates or {}))
    evaluation = EvaluationSettings.from_dict(evaluation).to_dict()
    name = check_model_name(name or f"grom-{safe_name(Path(model).resolve().name)}")
    catalog = ws.catalog()
    reconcile(ws.root, catalog, name)  # what a killed run registered under this name and never recorded
    rows = read_examples(retain)
    digest = data_digest(rows)

    retain_path = atomic_parquet(rows_table(rows), ws.root / "lake" / "services" / safe_name(name) /
                                  f"retain-{digest[:24]}.parquet")
    model_path = check_model_dir(model).resolve()
    loaded, _ = load_for_edit(str(model_path))
    fingerprint = weights_fingerprint(loaded)
    del loaded
    previous = serving_version(ws.root, name)
    promoted = previous is None
    service = queue.Service(model_name=name, retain_path=str(retain_path), retain_digest=digest, params=params,
                            gates=gates, evaluation=evaluation, prompt_format=prompt_format, method=method)
    # a failed catalog commit deletes the version and moves the alias back; the service's record goes into the
    # registry too, so that `grom catalog rebuild` can restore it (flows.rebuild)
    with tempfile.TemporaryDirectory() as tmp, transaction():
        record = Path(tmp) / "service.json"
        record.write_text(json.dumps(asdict(service), indent=1))
        registration = register(ws.root, run_name=f"register-{name}", model_name=name,
                                params={"model_dir": str(model_path), "retain": str(retain)}, metrics={},
                                datasets=[], artifacts={SERVICE_ARTIFACT: record}, model_dir=model_path,
                                tags={"grom.kind": "base", STORAGE_TAG: FULL, "grom.owner": queue.claim_owner(),
                                      "fingerprint": fingerprint, "model_dir": str(model_path)})
        if promoted:
            set_serving(ws.root, name, registration.version)
        record_run(catalog, _run_row(registration, "register", fingerprint, str(model_path)),
                   also=lambda con: queue.save_service(con, service))
    return {"model_name": name, "version": registration.version, "serving": promoted,
            "serving_version": registration.version if promoted else previous, "fingerprint": fingerprint,
            "retain": str(retain_path), "retain_examples": len(rows), "gates": gates, "evaluation": evaluation,
            "prompt_format": prompt_format, "method": method,
            "mlflow_run_id": registration.run_id}


def register_benchmark_model(benchmark: str, *, name: str | None = None, home: str | None = None,
                             params: dict | None = None, gates: dict | None = None,
                             evaluation: dict | None = None, authors: int | None = None,
                             method: str = DEFAULT_METHOD) -> dict:
    """The demo service: a shipped benchmark's target model (built and cached like `grom demo` does) with the
    retain split of its default forget split, answering requests with `method`.

    The method runs with its default parameters unless `params` names others, as on every benchmark (they hold
    no tuned presets)."""
    from flows.evaluation import build_benchmark, sized_config

    built = build_benchmark(benchmark, None, home, None, config=sized_config(benchmark, authors))
    _, retain = built.unlearning_files()
    return register_model(str(built.models["target"]), str(retain), name=name or f"grom-{benchmark}", home=home,
                          params=params, gates=gates, evaluation=evaluation, method=method)


def _run_row(registration: Registration, flow: str, fingerprint: str, model_dir: str, **extra) -> dict:
    return {"run": {"run_id": registration.run_id, "flow": flow, "method": None, "base_fingerprint": fingerprint,
                    "edited_fingerprint": fingerprint, "forget_digest": None, "retain_digest": None,
                    "mlflow_run_id": registration.run_id, "model_name": registration.model_name,
                    "model_version": registration.version, "model_dir": model_dir, "started_at": now(), **extra}}


def promote_version(version: str, *, model_name: str | None = None, home: str | None = None,
                    purge: bool = True) -> dict:
    """Put a version that failed its gates in service after human review, and mark its requests done."""
    import getpass

    from flows.process_requests import purge_traces

    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    name = queue.get_service(catalog, model_name).model_name
    tags = get_version(ws.root, name, version).tags
    serving = serving_version(ws.root, name)
    kind, parent = tags.get("grom.kind"), tags.get("parent_version")
    if str(version) == serving and kind != "request":
        raise DataError(f"version {version} of '{name}' is already in service")
    # version == serving: a promotion interrupted after the alias moved; running it again finishes it
    if str(version) != serving and (kind != "request" or parent != serving):
        raise DataError(f"version {version} of '{name}' was not computed from the version in service ({serving}); "
                        f"promoting it would drop what happened since: queue its requests again with "
                        f"`grom request requeue ID`")
    with transaction():  # a failed catalog commit moves the alias back
        set_serving(ws.root, name, str(version))
        with catalog.transaction() as con:
            approved = queue.approve(con, name, str(version), getpass.getuser())
            if not approved:
                raise DataError(f"version {version} of '{name}' answers no request in review; nothing to promote")
            if purge:
                queue.purge_text(con, approved)
    if purge:
        purge_traces(ws, catalog)
    log.info("version %s of %s promoted after review; requests %s done", version, name, approved)
    return {"version": str(version), "previous": parent, "done": approved, "model_name": name}


def revert_version(version: str, *, model_name: str | None = None, home: str | None = None) -> dict:
    """Undo the edit of `version` (the version in service) bit for bit, register the restored weights as a new
    version (a reference to the parent's weights, which they equal: no copy), move the alias to it, and reopen the
    requests `version` answered."""
    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    name = queue.get_service(catalog, model_name).model_name
    reconcile(ws.root, catalog, name)
    tags = get_version(ws.root, name, version).tags
    serving = serving_version(ws.root, name)
    if str(version) != serving:
        raise DataError(f"version {version} of '{name}' is not in service (version {serving} is); only the version "
                        f"in service can be reverted exactly, so revert {serving} first")
    if not tags.get("edit_id") or not tags.get("parent_version"):
        raise DataError(f"version {version} of '{name}' is a base model, not an edit: there is nothing to revert")
    parent = tags["parent_version"]
    parent_fingerprint = get_version(ws.root, name, parent).tags.get("fingerprint")
    edit_dir = ws.edits / safe_name(tags["edit_id"])  # a tag is text anyone with registry access can set
    if not (edit_dir / "undo.safetensors").is_file():
        raise DataError(f"{edit_dir} has no undo.safetensors; the edit of version {version} cannot be reverted "
                        f"exactly from this workspace")
    model, _ = load_for_edit(str(version_model_dir(ws.root, name, version)))
    edit = Edit.load(edit_dir)
    edit.revert(model, Undo.load(edit_dir / "undo.safetensors"))  # verifies the base fingerprint bit for bit
    fingerprint = weights_fingerprint(model)
    del model
    if parent_fingerprint and fingerprint != parent_fingerprint:
        raise DataError(f"reverting edit {edit.edit_id} gave weights {fingerprint[:12]}, not those of version "
                        f"{parent} ({parent_fingerprint[:12]}); the edit does not belong to that parent")
    # the restored weights are the parent's, bit for bit: the new version refers to them instead of a copy
    out = version_model_dir(ws.root, name, parent)
    reopened: list[int] = []

    def reopen(con) -> None:
        reopened.extend(queue.reopen(con, name, str(version), f"version {version} reverted by version "
                                                               f"{registration.version}"))

    lineage = {"reverts": str(version), "restores": parent, "edit_id_reverted": edit.edit_id,
               "fingerprint": fingerprint}
    with tempfile.TemporaryDirectory() as tmp, transaction():  # a failed commit: alias back, version deleted
        record = Path(tmp) / "lineage.json"
        record.write_text(json.dumps(lineage, indent=2))
        registration = register(ws.root, run_name=f"revert-{name}-v{version}", model_name=name,
                                params={"reverts": version, "edit_id": edit.edit_id}, metrics={}, datasets=[],
                                artifacts={"lineage": record}, model_dir=None, version_source="lineage",
                                tags={"grom.kind": "revert", STORAGE_TAG: SAME, "grom.owner": queue.claim_owner(),
                                      "model_dir": str(out), "parent_version": str(version), **lineage})
        set_serving(ws.root, name, registration.version)
        record_run(catalog, _run_row(registration, "revert", fingerprint, str(out), edit_id=edit.edit_id),
                   also=reopen)
    log.info("version %s of %s reverted: version %s restores version %s; reopened requests %s", version, name,
             registration.version, parent, reopened)
    return {"version": registration.version, "reopened": reopened, "reverted": str(version), "restores": parent,
            "fingerprint": fingerprint, "model_dir": str(out), "model_name": name}


def materialize_version(name: str, version: str, *, home: str | None = None, out: str | None = None) -> dict:
    """The weights of `version` of `name` as a folder (see `tasks.versions.materialize`), checked against the
    version's fingerprint; with `out`, also copied there (a new folder)."""
    import shutil

    ws = Workspace.resolve(home)
    tags = get_version(ws.root, name, version).tags
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise DataError(f"{out} is a file; give --out a new folder")
    if out is not None and Path(out).exists() and any(Path(out).iterdir()):
        raise DataError(f"{out} exists and is not empty; give a new folder to --out")
    path = materialize(ws.root, name, version)
    model, _ = load_for_edit(str(path))
    fingerprint = weights_fingerprint(model)
    del model
    if tags.get("fingerprint") and fingerprint != tags["fingerprint"]:
        raise FingerprintMismatchError(f"{path} holds weights {fingerprint[:12]}, not those registered as version "
                                       f"{version} of '{name}' ({tags['fingerprint'][:12]}); delete the folder "
                                       f"and materialise it again")
    if out is not None:
        shutil.copytree(path, out, dirs_exist_ok=True)
        path = Path(out)
    return {"model_name": name, "version": str(version), "storage": storage(tags), "model_dir": str(path),
            "fingerprint": fingerprint, "parent_version": tags.get("parent_version") or tags.get("restores")}
