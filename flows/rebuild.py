"""`grom catalog rebuild`: the catalog's rows for what the registry holds as committed, after the catalog was lost
or restored from an older copy (what `flows.reconcile` reports instead of deleting).

From each committed grom version the catalog does not record, the run row (flow, method, fingerprints, edit, data
digests, lineage folder) comes back from the version's tags and its MLflow run; its edit row from the edit folder
(the workspace's, or the copy the run logged); a service from the `service` record its registration logged. What
lived only in the catalog cannot come back: the requests and their history, the influence rows, layer scores and
key shards. The rebuild says how many versions answered requests it cannot restore.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

from flows.reconcile import recorded_runs
from flows.workspace import Workspace
from tasks import requests as queue
from tasks.catalog import record_run
from tasks.names import safe_name
from tasks.tracking import COMMIT_TAG, PENDING, client, versions

log = logging.getLogger("grom.rebuild")

FLOWS = {"base": "register", "unlearn": "unlearn", "request": "process-deletion-requests", "revert": "revert"}
SERVICE_ARTIFACT = "service"  # the artifact folder of a `grom model register` run: service.json


def rebuild_catalog(home: str | None = None) -> dict:
    """Insert the rows of every committed grom version the catalog lacks; returns what was restored."""
    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    mlflow = client(ws.root)
    restored, services, unanswered = [], [], []
    for model in mlflow.search_registered_models(max_results=1000):
        name = model.name
        recorded = recorded_runs(catalog, name)
        for version in sorted(versions(ws.root, name), key=lambda v: int(v.version)):
            if not version.run_id or version.run_id in recorded:
                continue
            run = mlflow.get_run(version.run_id)
            tags = {**run.data.tags, **version.tags}
            kind = tags.get("grom.kind")
            if kind not in FLOWS or tags.get(COMMIT_TAG) == PENDING:
                continue  # another tool's, or a dead run's pending one (reconcile's to remove)
            if kind == "base" and "grom.owner" not in tags:
                continue  # a lineage's root has no catalog row of its own
            record_run(catalog, _rows(ws, mlflow, run, version, tags, kind))
            restored.append({"model_name": name, "version": str(version.version), "flow": FLOWS[kind]})
            if tags.get("request_ids"):
                unanswered.append(f"{name} v{version.version} (requests {tags['request_ids']})")
            if kind == "base" and _restore_service(ws, catalog, mlflow, run, name):
                services.append(name)
    log.info("catalog rebuilt: %d run(s), %d service(s) restored", len(restored), len(services))
    if unanswered:
        log.warning("requests live only in the catalog and cannot be restored: %s", "; ".join(unanswered))
    return {"restored": restored, "services": services, "requests_not_restored": unanswered}


def _rows(ws: Workspace, mlflow, run, version, tags: dict, kind: str) -> dict:
    started = datetime.fromtimestamp(run.info.start_time / 1000, UTC).replace(tzinfo=None)
    fingerprint = tags.get("fingerprint")
    rows: dict = {"run": {
        "run_id": run.info.run_id, "flow": FLOWS[kind], "method": tags.get("method") or None,
        "compose": tags.get("compose") or None, "base_fingerprint": tags.get("base_fingerprint") or fingerprint,
        "edited_fingerprint": fingerprint, "edit_id": tags.get("edit_id") or tags.get("edit_id_reverted"),
        "forget_digest": tags.get("forget_digest"), "retain_digest": tags.get("retain_digest"),
        "mlflow_run_id": run.info.run_id, "model_name": version.name, "model_version": str(version.version),
        "model_dir": tags.get("model_dir"), "metrics": {"rebuilt_from_registry": True}, "started_at": started}}
    edit_id = tags.get("edit_id")
    if kind in ("unlearn", "request") and edit_id:
        edit_dir = ws.edits / safe_name(edit_id)
        if not (edit_dir / "edit.json").is_file():
            import mlflow as mlflow_module

            edit_dir.parent.mkdir(parents=True, exist_ok=True)
            mlflow_module.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="edit",
                                                       dst_path=str(edit_dir.parent / f".{edit_id}.download"))
            (edit_dir.parent / f".{edit_id}.download" / "edit").rename(edit_dir)
        manifest = json.loads((edit_dir / "edit.json").read_text())
        rows["edit"] = {"edit_id": edit_id, "method": tags.get("method"),
                        "base_fingerprint": manifest["base_fingerprint"], "edited_fingerprint": fingerprint,
                        "modules": [m["name"] for m in manifest["modules"]],
                        "layers": manifest.get("metadata", {}).get("layers", []), "params": manifest["params"],
                        "edit_dir": str(edit_dir)}
    return rows


def _restore_service(ws: Workspace, catalog, mlflow, run, name: str) -> bool:
    """The service a `grom model register` run logged, unless the catalog already has one of that name."""
    if catalog.query("SELECT 1 FROM services WHERE model_name = ?", [name]):
        return False
    if not any(a.path == SERVICE_ARTIFACT for a in mlflow.list_artifacts(run.info.run_id)):
        return False
    import mlflow as mlflow_module

    folder = mlflow_module.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path=SERVICE_ARTIFACT,
                                                        dst_path=str(ws.root / "tmp" / f"service-{run.info.run_id}"))
    record = json.loads((Path(folder) / "service.json").read_text())
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service(**record))
    return True
