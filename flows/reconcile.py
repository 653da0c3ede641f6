"""Versions that a killed run registered but never committed to the catalog, found and removed before a new run.

A run registers its version in MLflow, then commits its catalog rows: the commit point. Every run and version grom
registers carries `grom.commit` = pending from the run's first write until its transaction commits (then
committed; see `tasks.tracking`). A run killed in between (SIGKILL, power loss) leaves a pending version the
catalog does not know, possibly without its tags (MLflow creates the version, then tags it: the run's own tags,
written when it started, say it is pending), and its MLflow run RUNNING. Every command that registers calls
`reconcile` for its model name first: such a version is deleted (the `serving` alias moved back to its parent
first) and its run marked FAILED. Runs left RUNNING without any version (a start that failed: a full disk) are
closed as FAILED.

Nothing else is deleted: versions other tools registered, the unedited weights a run registers as the root of its
lineage (no catalog row of their own), the versions of a run that may still be going (its owner alive and the
version younger than `stale_after_s`), and above all committed versions the catalog does not record (a catalog
lost or restored from an older backup): those are reported, and `grom catalog rebuild` restores their rows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tasks import requests as queue
from tasks.catalog import Catalog
from tasks.tracking import COMMIT_TAG, EXPERIMENT, MODEL_TAG, PENDING, client, serving_version, set_serving, versions

log = logging.getLogger("grom.reconcile")


def reconcile(root: Path, catalog: Catalog, name: str, stale_after_s: float = 6 * 3600) -> list[str]:
    """Delete the uncommitted versions of `name` left by dead grom runs; returns their version numbers."""
    mlflow = client(root)
    recorded = recorded_runs(catalog, name)
    removed, unknown = [], []
    for version in versions(root, name):
        if version.run_id in recorded:
            continue
        run = _run(mlflow, version.run_id)
        tags = {**(run.data.tags if run else {}), **version.tags}
        if "grom.kind" not in tags:
            continue  # registered by another tool
        if tags["grom.kind"] == "base" and "grom.owner" not in tags:
            continue  # the unedited weights a run registers first (tasks.versions.root_version): no catalog row
        if tags.get(COMMIT_TAG) != PENDING:
            unknown.append(str(version.version))  # committed (or from before the marker): never deleted
            continue
        age_s = time.time() - version.creation_timestamp / 1000
        if not queue.owner_gone(tags.get("grom.owner")) and age_s < stale_after_s:
            continue
        if serving_version(root, name) == str(version.version):
            set_serving(root, name, tags.get("parent_version"))
        mlflow.delete_model_version(name, version.version)
        if run is not None and run.info.status != "FAILED":  # its registration is undone: the run failed
            mlflow.set_terminated(run.info.run_id, "FAILED")
        removed.append(str(version.version))
        log.warning("removed version %s of %s: registered by a run that died before recording it", version.version,
                    name)
    if unknown:
        log.warning("the catalog does not record version(s) %s of %s, which the registry holds as committed: the "
                    "catalog was lost or restored from an older copy; restore it, or run `grom catalog rebuild` to "
                    "restore their rows from the registry (nothing was deleted)", ", ".join(unknown), name)
    close_dead_runs(root, name, stale_after_s)
    return removed


def recorded_runs(catalog: Catalog, name: str) -> set[str]:
    return {r["mlflow_run_id"] for r in catalog.query("SELECT mlflow_run_id FROM runs WHERE model_name = ?", [name])}


def close_dead_runs(root: Path, name: str, stale_after_s: float) -> list[str]:
    """Mark FAILED the RUNNING grom runs registering into `name` whose owner is gone (or that are older than
    `stale_after_s`): what a start that failed half-way (a full disk, a kill before the first version) leaves."""
    mlflow = client(root)
    experiment = mlflow.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    closed, token = [], None
    while True:  # listed page by page and matched here: no filter string is built from a name
        page = mlflow.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        for run in page:
            tags = run.data.tags
            if tags.get(MODEL_TAG) != name or tags.get(COMMIT_TAG) != PENDING:
                continue
            age_s = time.time() - run.info.start_time / 1000
            owner = tags.get("grom.owner")  # a lineage root's run names none: only its age tells
            if (owner and queue.owner_gone(owner)) or age_s >= stale_after_s:
                mlflow.set_terminated(run.info.run_id, "FAILED")
                closed.append(run.info.run_id)
        token = page.token
        if not token:
            break
    if closed:
        log.warning("closed %d run(s) of %s left RUNNING by a process that is gone", len(closed), name)
    return closed


def _run(mlflow, run_id: str | None):
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.get_run(run_id) if run_id else None
    except MlflowException:
        return None
