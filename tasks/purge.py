"""Purging forgotten examples from every file of a workspace, whichever run wrote it.

An example is identified by its sha256 (`tasks.records.example_sha256`); once its request is done the text is the
very data the user asked us to delete. What holds it, and what the purge does:

    catalog examples rows        text set to NULL (tasks.requests.purge_text, in the flow's transaction)
    lake/datasets/*.parquet      every column but sha256 set to null on the purged rows (any dataset, any run)
    lake/keys/<edit>/*.parquet   the purged examples' rows removed (LM-head keys decode to the answer text)
    lake/records/<edit>          the purged examples' key and target columns removed
    requests/batch-*.jsonl       a killed run's batch file loses the purged lines (deleted when empty)
    catalog.duckdb               rewritten into a fresh file, so no free page keeps an old row

Kept: the sha256s, the influence figures already computed, the edits themselves (weights deltas) and the user's
own input files, which are theirs. Audits are redacted by `flows.audit.redact_audits`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tasks.catalog import Catalog
from tasks.lake import atomic_parquet, load_records, save_records
from tasks.records import example_sha256

log = logging.getLogger("grom.purge")


@dataclass
class PurgeReport:
    """Counts of what one purge removed (zero everywhere on a workspace with nothing left to purge)."""

    examples: int = 0  # distinct purged sha256s looked for
    dataset_rows: int = 0  # lake dataset rows whose text was nulled
    key_rows: int = 0  # key-shard rows removed
    record_positions: int = 0  # solve-record key columns removed
    batch_lines: int = 0  # lines removed from leftover batch files
    catalog_compacted: bool = False


def purged_shas(catalog: Catalog) -> set[str]:
    """Every sha256 whose text has been purged from the catalog."""
    return {r["sha256"] for r in catalog.query("SELECT DISTINCT sha256 FROM examples WHERE purged")}


def purge_workspace(root: Path, catalog: Catalog, shas: set[str] | None = None, *, compact: bool = True
                    ) -> PurgeReport:
    """Remove the purged examples (`shas`, default: all that the catalog marks purged) from the lake and the
    leftover batch files of `root`, then rewrite the catalog file (`compact`)."""
    shas = purged_shas(catalog) if shas is None else set(shas)
    report = PurgeReport(examples=len(shas))
    if not shas:
        return report
    lake = root / "lake"
    for path in sorted((lake / "datasets").glob("*.parquet")):
        report.dataset_rows += _purge_dataset(path, shas)
    for edit_id, indices in _edit_examples(catalog, shas).items():
        for shard in sorted((lake / "keys" / edit_id).glob("*.parquet")):
            report.key_rows += _drop_key_rows(shard, indices)
        records = lake / "records" / f"{edit_id}.safetensors"
        if records.is_file():
            report.record_positions += _drop_record_columns(records, indices)
    for batch in sorted((root / "requests").glob("batch-*.jsonl")):
        report.batch_lines += _purge_batch(batch, shas)
    if compact:
        compact_catalog(catalog)
        report.catalog_compacted = True
    log.info("purge: %d examples; %d dataset rows, %d key rows, %d record positions, %d batch lines removed",
             report.examples, report.dataset_rows, report.key_rows, report.record_positions, report.batch_lines)
    return report


def _purge_dataset(path: Path, shas: set[str]) -> int:
    table = pq.read_table(path)
    if "sha256" not in table.column_names or not len(table):
        return 0
    hit = pc.fill_null(pc.is_in(table["sha256"], value_set=pa.array(sorted(shas), pa.string())), False)
    texts = [c for c in table.column_names if c != "sha256"]
    holding = functools.reduce(pc.or_, [pc.and_(hit, pc.is_valid(table[c])) for c in texts], pa.scalar(False))
    n = pc.sum(holding).as_py() or 0 if texts else 0
    if not n:
        return 0  # nothing of the purged rows is left here
    for name in texts:
        column = table[name]
        table = table.set_column(table.column_names.index(name), name,
                                 pc.if_else(hit, pa.nulls(len(table), column.type), column))
    atomic_parquet(table, path)
    return int(n)


def _edit_examples(catalog: Catalog, shas: set[str]) -> dict[str, set[int]]:
    """edit id -> indices (its example ids) of the purged examples in the forget data it was computed from."""
    rows = catalog.query(
        """SELECT DISTINCT r.edit_id, e.example_index FROM runs r
            JOIN examples e ON e.dataset_digest = r.forget_digest
            WHERE r.edit_id IS NOT NULL AND list_contains(?, e.sha256)""", [sorted(shas)])
    out: dict[str, set[int]] = {}
    for row in rows:
        out.setdefault(row["edit_id"], set()).add(int(row["example_index"]))
    return out


def _drop_key_rows(shard: Path, indices: set[int]) -> int:
    table = pq.read_table(shard)
    if "example_id" not in table.column_names:
        return 0
    hit = pc.is_in(table["example_id"], value_set=pa.array(sorted(indices), pa.int64()))
    n = pc.sum(hit).as_py() or 0
    if n:
        atomic_parquet(table.filter(pc.invert(hit)), shard)
    return int(n)


def _drop_record_columns(path: Path, indices: set[int]) -> int:
    records = load_records(path)
    removed = 0
    for record in records.values():
        keep = ~torch.isin(record.example_ids, torch.tensor(sorted(indices), dtype=record.example_ids.dtype))
        removed += int((~keep).sum())
        record.keys, record.targets = record.keys[:, keep].contiguous(), record.targets[:, keep].contiguous()
        record.example_ids = record.example_ids[keep].contiguous()
    if removed:
        save_records(path, records)
    return removed


def _purge_batch(path: Path, shas: set[str]) -> int:
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and example_sha256(json.loads(line)) not in shas]
    if len(kept) == len(lines):
        return 0
    if kept:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    else:
        path.unlink()
    return len(lines) - len(kept)


def compact_catalog(catalog: Catalog) -> None:
    """Rewrite the catalog into a fresh file: DuckDB reuses the pages of updated rows but does not clear them, so
    purged text stays on disk in the old file until something overwrites it.

    The copy is renamed over the old file while our connection still holds it (the lock), so no other process
    opens the old file in between: a process waiting for the lock opens the new one.
    """
    path = catalog.path
    fresh = path.with_name(path.name + ".compact")
    fresh.unlink(missing_ok=True)
    with catalog.connect() as con:
        con.execute("CHECKPOINT")  # the write-ahead log is folded in, so closing the old file leaves no WAL behind
        name = con.execute("SELECT current_database()").fetchone()[0]
        quoted_path, quoted_name = str(fresh).replace("'", "''"), name.replace('"', '""')  # DDL takes no parameters
        con.execute(f"ATTACH '{quoted_path}' AS fresh")
        try:
            con.execute(f'COPY FROM DATABASE "{quoted_name}" TO fresh')
        finally:
            con.execute("DETACH fresh")
        os.replace(fresh, path)
