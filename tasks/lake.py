"""The Parquet lake and the file caches under the workspace.

    lake/keys/<edit_id>/<module>.parquet      forget keys each module was solved with (one row per position)
    lake/influence/<edit_id>.parquet          per example and module influence
    lake/retain_stats/<fp>/<digest>/<module>  cached retain statistics (safetensors), keyed by content
    lake/records/<edit_id>.safetensors        keys, targets and ids of every solve (for the influence audit)

Every file is written under a temporary name and renamed, so readers never see half a file. Key vectors are stored
as list<float>; DuckDB reads them with `SELECT key::FLOAT[n] FROM 'lake/keys/.../x.parquet'`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import safe_open
from safetensors.torch import save_file

from grom_core.influence import SolveRecord
from grom_core.statistics import GramStats
from tasks.names import safe_name


def atomic_parquet(table: pa.Table, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def rows_table(rows: list[dict]) -> pa.Table:
    """Rows as a table with the union of their columns (missing values null): pyarrow's `from_pylist` takes the
    first row's columns only, which drops the text of a file mixing QA pairs and texts."""
    columns = list(dict.fromkeys(column for row in rows for column in row))
    return pa.table({column: [row.get(column) for row in rows] for column in columns})


def dataset_path(root: Path, role: str, digest: str) -> Path:
    """Where an ingested dataset lives in the lake (content-addressed)."""
    return root / "datasets" / f"{role}-{digest[:24]}.parquet"


def write_key_shard(root: Path, edit_id: str, record: SolveRecord) -> dict:
    """One module's forget keys as Parquet: example_id, position, token_id (the gold next token), module, key."""
    keys = record.keys.T.float().numpy()  # (s, n)
    table = pa.table({
        "example_id": pa.array(record.example_ids.tolist(), pa.int64()),
        "position": pa.array(record.positions.tolist(), pa.int32()),
        "token_id": pa.array(record.tokens.tolist(), pa.int64()),
        "module": pa.array([record.module] * keys.shape[0], pa.string()),
        "key": pa.array(keys.tolist(), pa.list_(pa.float32())),
    })
    path = atomic_parquet(table, root / "keys" / edit_id / f"{safe_name(record.module)}.parquet")
    return {"module": record.module, "path": str(path), "n_rows": keys.shape[0], "dim": keys.shape[1]}


def write_influence(root: Path, edit_id: str, rows: list[dict]) -> Path:
    return atomic_parquet(pa.Table.from_pylist(rows), root / "influence" / f"{edit_id}.parquet")


def stats_path(root: Path, fingerprint: str, retain_digest: str, module: str) -> Path:
    return root / "retain_stats" / fingerprint[:24] / retain_digest[:24] / f"{safe_name(module)}.safetensors"


class LakeStatsStore:
    """The retain-statistics cache in the lake (a `grom_core.statistics.StatsStore`): one safetensors file per
    (model weights fingerprint, stats digest, module). Entries are checked on load: a file whose header names
    another model, other data or another module is ignored."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, fingerprint: str, digest: str, module: str) -> Path:
        return stats_path(self.root, fingerprint, digest, module)

    def load(self, fingerprint: str, data_digest: str, modules) -> dict[str, GramStats]:
        found = {}
        for module in modules:
            path = self.path(fingerprint, data_digest, module)
            if path.is_file():
                stats = GramStats.load(path)
                if (stats.fingerprint, stats.data_digest, stats.module) == (fingerprint, data_digest, module):
                    found[module] = stats
        return found

    def save(self, stats) -> None:
        for name, st in stats.items():
            st.save(self.path(st.fingerprint, st.data_digest, name))


def save_records(path: Path, records: dict[str, SolveRecord]) -> Path:
    """Keys, targets and example ids of every module's solve (float64), plus ridge and counts as metadata."""
    tensors, meta = {}, {}
    for name, rec in records.items():
        tensors[f"{name}::keys"] = rec.keys.contiguous()
        tensors[f"{name}::targets"] = rec.targets.contiguous()
        tensors[f"{name}::example_ids"] = rec.example_ids.contiguous()
        meta[name] = {"ridge": rec.ridge, "retain_count": rec.retain_count, "w_forget": rec.w_forget,
                      "w_retain": rec.w_retain}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"grom": json.dumps(meta)})
    tmp.replace(path)
    return path


def load_records(path: Path) -> dict[str, SolveRecord]:
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["grom"])
        return {name: SolveRecord(module=name, keys=handle.get_tensor(f"{name}::keys"),
                                  targets=handle.get_tensor(f"{name}::targets"),
                                  example_ids=handle.get_tensor(f"{name}::example_ids"),
                                  ridge=info["ridge"], retain_count=info["retain_count"],
                                  w_forget=info["w_forget"], w_retain=info["w_retain"])
                for name, info in meta.items()}
