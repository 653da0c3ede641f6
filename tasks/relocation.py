"""A workspace that was copied or moved works on its own: the absolute paths its databases hold are rewritten.

MLflow stores absolute artifact locations (the experiment's, each run's, each model version's source) and grom's
catalog stores the folders of models, edits, key shards and cached statistics. Copied with `cp -a`, a workspace
would keep reading, and MLflow would keep writing, into the original. On every command the experiment's artifact
location is compared with this workspace's `mlartifacts` folder; when they differ, every path under the old root
is rewritten to the same path under the new one (paths outside the workspace, like a user's own files, are left
alone).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

from tasks.catalog import Catalog
from tasks.tracking import EXPERIMENT

log = logging.getLogger("grom.workspace")

# (table, column) of MLflow's SQLite schema that hold locations
MLFLOW_LOCATIONS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                    ("logged_models", "artifact_location"), ("model_versions", "source"),
                    ("model_versions", "storage_location"), ("model_version_tags", "value"), ("tags", "value"),
                    ("datasets", "dataset_source"))
CATALOG_LOCATIONS = (("runs", "model_dir"), ("runs", "base_model_dir"), ("edits", "edit_dir"),
                     ("key_shards", "path"), ("stats_cache", "path"), ("services", "retain_path"))


def previous_root(root: Path) -> Path | None:
    """The root this workspace's MLflow database was created under, when it is not `root` (else None)."""
    db = root / "mlflow.db"
    if not db.is_file():
        return None
    con = sqlite3.connect(db)
    try:
        row = con.execute("SELECT artifact_location FROM experiments WHERE name = ?", [EXPERIMENT]).fetchone()
    except sqlite3.DatabaseError:
        return None  # not created yet (or not an MLflow database): nothing to relocate
    finally:
        con.close()
    if not row or not str(row[0]).startswith("file:"):
        return None
    old = Path(unquote(urlparse(row[0]).path)).parent
    return None if old == root else old


def relocate(root: Path) -> Path | None:
    """Rewrite the paths under the previous root of a copied or moved workspace; returns that root (or None)."""
    old = previous_root(root)
    if old is None:
        return None
    pairs = [(old.as_uri() + "/", root.as_uri() + "/"), (str(old) + "/", str(root) + "/")]
    changed = 0
    con = sqlite3.connect(root / "mlflow.db")
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        with con:
            for table, column in MLFLOW_LOCATIONS:
                if table not in tables:
                    continue
                for before, after in pairs:
                    changed += con.execute(f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) '
                                           f'WHERE instr("{column}", ?) > 0', [before, after, before]).rowcount
            # the experiment's own location has no trailing slash
            con.execute("UPDATE experiments SET artifact_location = ? WHERE name = ?",
                        [(root / "mlartifacts").as_uri(), EXPERIMENT])
    finally:
        con.close()
    if (root / "catalog.duckdb").is_file():
        before, after = pairs[1]
        with Catalog(root / "catalog.duckdb").transaction() as db:
            for table, column in CATALOG_LOCATIONS:
                changed += db.execute(f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) '
                                      f'WHERE starts_with("{column}", ?)', [before, after, before]).fetchone()[0]
    log.warning("this workspace was copied or moved from %s: its recorded paths now point into %s (%d rewritten)",
                old, root, changed)
    return old
