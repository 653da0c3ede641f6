"""The DuckDB catalog: datasets, examples, edits, influence, layer scores, key shards, statistics cache, runs,
deletion requests and the services that answer them.

DuckDB lets one process at a time open the file; grom opens it for short transactions only, and a process that
finds it locked waits up to GROM_CATALOG_LOCK_TIMEOUT_S seconds (default 30) before giving up with a clear error.
A flow run writes all its rows in one transaction at the end (`record_run`), so a failed run leaves no orphan rows.
SQL is always parameterised.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import duckdb

from grom_core.errors import GromError

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS datasets (
        digest VARCHAR PRIMARY KEY, name VARCHAR, role VARCHAR, n_examples INTEGER, source VARCHAR,
        created_at TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS examples (
        dataset_digest VARCHAR, example_index INTEGER, sha256 VARCHAR, question VARCHAR, answer VARCHAR,
        text VARCHAR, purged BOOLEAN DEFAULT FALSE, PRIMARY KEY (dataset_digest, example_index))""",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id VARCHAR PRIMARY KEY, flow VARCHAR, method VARCHAR, compose VARCHAR, base_fingerprint VARCHAR,
        edited_fingerprint VARCHAR, edit_id VARCHAR, forget_digest VARCHAR, retain_digest VARCHAR,
        mlflow_run_id VARCHAR, model_name VARCHAR, model_version VARCHAR, model_dir VARCHAR, metrics JSON,
        timings JSON, started_at TIMESTAMP, finished_at TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS edits (
        edit_id VARCHAR PRIMARY KEY, method VARCHAR, base_fingerprint VARCHAR, edited_fingerprint VARCHAR,
        modules JSON, layers JSON, params JSON, edit_dir VARCHAR, created_at TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS influence (
        edit_id VARCHAR, module VARCHAR, example_index INTEGER, example_sha256 VARCHAR, value DOUBLE,
        min_eig DOUBLE, flagged BOOLEAN, refit BOOLEAN)""",
    """CREATE TABLE IF NOT EXISTS layer_scores (
        edit_id VARCHAR, layer INTEGER, forget DOUBLE, retain DOUBLE, score DOUBLE, chosen BOOLEAN)""",
    """CREATE TABLE IF NOT EXISTS key_shards (
        edit_id VARCHAR, module VARCHAR, path VARCHAR, n_rows INTEGER, dim INTEGER)""",
    """CREATE TABLE IF NOT EXISTS stats_cache (
        fingerprint VARCHAR, retain_digest VARCHAR, module VARCHAR, path VARCHAR, n_positions BIGINT,
        created_at TIMESTAMP, PRIMARY KEY (fingerprint, retain_digest, module))""",
    "CREATE SEQUENCE IF NOT EXISTS request_ids START 1",
    """CREATE TABLE IF NOT EXISTS requests (
        request_id INTEGER PRIMARY KEY, status VARCHAR, model_name VARCHAR, dataset_digest VARCHAR,
        n_examples INTEGER, reason VARCHAR, requester VARCHAR, source VARCHAR, created_at TIMESTAMP,
        updated_at TIMESTAMP, claim_owner VARCHAR, claimed_at TIMESTAMP, model_version VARCHAR, edit_id VARCHAR,
        run_id VARCHAR, review_reasons JSON, purged BOOLEAN DEFAULT FALSE)""",
    """CREATE TABLE IF NOT EXISTS request_events (
        request_id INTEGER, event_at TIMESTAMP, status VARCHAR, detail VARCHAR)""",
    # the model a run started from (a local folder): the lineage an audit's refit check reloads
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS base_model_dir VARCHAR",
    """CREATE TABLE IF NOT EXISTS services (
        model_name VARCHAR PRIMARY KEY, retain_path VARCHAR, retain_digest VARCHAR, params JSON, gates JSON,
        evaluation JSON, created_at TIMESTAMP)""",
    # how a service's data becomes text (grom_core.data.PROMPT_FORMATS)
    "ALTER TABLE services ADD COLUMN IF NOT EXISTS prompt_format VARCHAR DEFAULT 'qa'",
    # the unlearning method that answers a service's requests (grom_core.methods.METHODS)
    "ALTER TABLE services ADD COLUMN IF NOT EXISTS method VARCHAR DEFAULT 'grom'",
    # what a QA pair is about (tasks.records.TEXT_COLUMNS): the closed form's counterfactual drops read it
    "ALTER TABLE examples ADD COLUMN IF NOT EXISTS subject VARCHAR",
]

LOCK_TIMEOUT_ENV = "GROM_CATALOG_LOCK_TIMEOUT_S"


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Catalog:
    """A DuckDB file under the workspace. Use `with Catalog(path).connect() as con:`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        """Open the file, waiting while another process holds its lock (grom's own holds last milliseconds)."""
        timeout = float(os.environ.get(LOCK_TIMEOUT_ENV, "30"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only and self.path.exists())
            except duckdb.IOException as exc:
                first = str(exc).splitlines()[0]
                if "lock" not in first.lower() or time.monotonic() >= deadline:
                    raise GromError(
                        f"the catalog {self.path} is locked or unreadable ({first}); waited {timeout:g} s: stop "
                        f"the other process holding it, raise {LOCK_TIMEOUT_ENV}, or use another --home") from exc
                time.sleep(0.2)

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        con = self._open(read_only)
        try:
            if not read_only:
                for statement in SCHEMA:
                    con.execute(statement)
            yield con
        finally:
            con.close()

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """All or nothing: rows written inside are committed together or not at all."""
        with self.connect() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def query(self, sql: str, params: list | None = None) -> list[dict]:
        """Rows of a read query as dicts (parameterised)."""
        with self.connect() as con:
            rel = con.execute(sql, params or [])
            names = [d[0] for d in rel.description]
            return [dict(zip(names, row, strict=True)) for row in rel.fetchall()]


def _insert_many(con, sql: str, rows: list[list]) -> None:
    if rows:  # DuckDB refuses an empty executemany
        con.executemany(sql, rows)


def insert_dataset(con, dataset: dict) -> None:
    """A dataset and its examples (content-addressed: inserting the same dataset twice is a no-op)."""
    if con.execute("SELECT 1 FROM datasets WHERE digest = ?", [dataset["digest"]]).fetchone():
        return
    con.execute("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?)",
                [dataset["digest"], dataset["name"], dataset["role"], len(dataset["examples"]), dataset["source"],
                 now()])
    _insert_many(con, "INSERT INTO examples (dataset_digest, example_index, sha256, question, answer, text, subject, "
                      "purged) VALUES (?, ?, ?, ?, ?, ?, ?, FALSE)",
                 [[dataset["digest"], i, ex["sha256"], ex.get("question"), ex.get("answer"), ex.get("text"),
                   ex.get("subject")] for i, ex in enumerate(dataset["examples"])])


def record_run(catalog: Catalog, run: dict, also=None) -> None:
    """Everything one flow run produced, in one transaction.

    `run` holds: run (the runs row), datasets (list), edit (the edits row), influence, layer_scores, key_shards
    and stats_cache rows (lists of dicts, column names as in SCHEMA). `also(con)`, when given, writes more rows
    (request statuses) inside the same transaction.
    """
    with catalog.transaction() as con:
        for dataset in run.get("datasets", []):
            insert_dataset(con, dataset)
        edit = run.get("edit")
        if edit and not con.execute("SELECT 1 FROM edits WHERE edit_id = ?", [edit["edit_id"]]).fetchone():
            con.execute("INSERT INTO edits VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [edit["edit_id"], edit["method"], edit["base_fingerprint"], edit["edited_fingerprint"],
                         json.dumps(edit["modules"]), json.dumps(edit["layers"]), json.dumps(edit["params"]),
                         edit["edit_dir"], now()])
            _insert_many(con, "INSERT INTO influence VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            [[edit["edit_id"], r["module"], r["example_index"], r["example_sha256"], r["value"],
                              r["min_eig"], r["flagged"], r["refit"]] for r in run.get("influence", [])])
            _insert_many(con, "INSERT INTO layer_scores VALUES (?, ?, ?, ?, ?, ?)",
                            [[edit["edit_id"], r["layer"], r["forget"], r["retain"], r["score"], r["chosen"]]
                             for r in run.get("layer_scores", [])])
            _insert_many(con, "INSERT INTO key_shards VALUES (?, ?, ?, ?, ?)",
                            [[edit["edit_id"], r["module"], r["path"], r["n_rows"], r["dim"]]
                             for r in run.get("key_shards", [])])
        for r in run.get("stats_cache", []):
            con.execute("INSERT OR IGNORE INTO stats_cache VALUES (?, ?, ?, ?, ?, ?)",
                        [r["fingerprint"], r["retain_digest"], r["module"], r["path"], r["n_positions"], now()])
        row = run["run"]
        con.execute("INSERT INTO runs (run_id, flow, method, compose, base_fingerprint, edited_fingerprint, edit_id, "
                    "forget_digest, retain_digest, mlflow_run_id, model_name, model_version, model_dir, metrics, "
                    "timings, started_at, finished_at, base_model_dir) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [row["run_id"], row["flow"], row["method"], row.get("compose"), row["base_fingerprint"],
                     row.get("edited_fingerprint"), row.get("edit_id"), row["forget_digest"], row["retain_digest"],
                     row.get("mlflow_run_id"), row.get("model_name"), row.get("model_version"), row.get("model_dir"),
                     json.dumps(row.get("metrics", {})), json.dumps(row.get("timings", {})), row["started_at"],
                     now(), row.get("base_model_dir")])
        if also is not None:
            also(con)
