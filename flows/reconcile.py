"""Versions that a killed run registered but never committed to the catalog, found and removed before a new run.

A run registers its version in MLflow, then commits its catalog rows: the commit point. A run killed in between
(SIGKILL, power loss) leaves a version the catalog does not know, possibly without its tags (MLflow creates the
version, then tags it), and its MLflow run RUNNING. Every command that registers calls `reconcile` for its model
name first: such a version is deleted (the `serving` alias moved back to its parent first) and its run marked
FAILED. A version is grom's when it or its run carries the `grom.kind` tag (run tags are written when the run
starts); versions other tools registered are left alone, and so are the unedited weights a run registers as the
root of its lineage (they have no catalog row of their own, and the next run reuses them) and the versions of a run
that may still be going (its owner process alive and the version younger than `stale_after_s`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tasks import requests as queue
from tasks.catalog import Catalog
from tasks.tracking import client, serving_version, set_serving, versions

log = logging.getLogger("grom.reconcile")


def reconcile(root: Path, catalog: Catalog, name: str, stale_after_s: float = 6 * 3600) -> list[str]:
    """Delete the uncommitted versions of `name` left by dead grom runs; returns their version numbers."""
    from mlflow.exceptions import MlflowException

    recorded = {r["mlflow_run_id"] for r in catalog.query("SELECT mlflow_run_id FROM runs WHERE model_name = ?",
                                                          [name])}
    mlflow = client(root)
    removed = []
    for version in versions(root, name):
        if version.run_id in recorded:
            continue
        try:
            run = mlflow.get_run(version.run_id) if version.run_id else None
        except MlflowException:
            run = None
        tags = {**(run.data.tags if run else {}), **version.tags}
        if "grom.kind" not in tags:
            continue  # registered by another tool
        if tags["grom.kind"] == "base" and "grom.owner" not in tags:
            continue  # the unedited weights a run registers first (tasks.versions.root_version): no catalog row
        age_s = time.time() - version.creation_timestamp / 1000
        if not queue.owner_gone(tags.get("grom.owner")) and age_s < stale_after_s:
            continue
        if serving_version(root, name) == str(version.version):
            set_serving(root, name, tags.get("parent_version"))
        mlflow.delete_model_version(name, version.version)
        if run is not None and run.info.status == "RUNNING":
            mlflow.set_terminated(run.info.run_id, "FAILED")
        removed.append(str(version.version))
        log.warning("removed version %s of %s: registered by a run that died before recording it", version.version,
                    name)
    return removed
