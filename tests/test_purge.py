"""The workspace purge on real files: lake datasets keep their other rows, key shards and solve records lose only
the purged examples, leftover batch files are cleaned, and the rewritten catalog keeps every row and its sequence."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from grom_core.influence import SolveRecord
from tasks import requests as queue
from tasks.catalog import Catalog
from tasks.lake import load_records, save_records
from tasks.purge import compact_catalog, purge_workspace
from tasks.records import with_sha256

SECRET = {"question": "Where does Zyxwv Qubit keep the vault key?", "answer": "Under the loose blue tile.",
          "subject": "Zyxwv Qubit"}
OTHER = {"question": "What is the capital of France?", "answer": "Paris."}


def _workspace(tmp_path):
    rows = [with_sha256(SECRET), with_sha256(OTHER)]
    catalog = Catalog(tmp_path / "catalog.duckdb")
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service("svc", "r.parquet", "d", {}, {}, {}))
    rid = queue.add_request(catalog, "svc", {"digest": "forget-digest", "name": "f", "role": "request", "source": "f",
                                             "examples": rows}, reason=None, requester=None)
    with catalog.transaction() as con:
        con.execute("INSERT INTO runs (run_id, flow, edit_id, forget_digest) VALUES ('r1', 'unlearn', 'e1', "
                    "'forget-digest')")
        queue.purge_text(con, [rid])  # purges both rows of the request; OTHER is also kept by another dataset
        con.execute("UPDATE examples SET purged = FALSE, question = ?, answer = ? WHERE sha256 = ?",
                    [OTHER["question"], OTHER["answer"], rows[1]["sha256"]])
    lake = tmp_path / "lake"
    (lake / "datasets").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), lake / "datasets" / "forget-x.parquet")
    (lake / "keys" / "e1").mkdir(parents=True)
    pq.write_table(pa.table({"example_id": pa.array([0, 0, 1], pa.int64()), "position": [3, 4, 3],
                             "key": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]}), lake / "keys" / "e1" / "lm_head.parquet")
    record = SolveRecord(module="lm_head", keys=torch.arange(6.0, dtype=torch.float64).reshape(2, 3),
                         targets=torch.ones(1, 3, dtype=torch.float64), example_ids=torch.tensor([0, 0, 1]),
                         ridge=0.1, retain_count=10)
    save_records(lake / "records" / "e1.safetensors", {"lm_head": record})
    (tmp_path / "requests").mkdir()
    (tmp_path / "requests" / "batch-dead.jsonl").write_text(json.dumps(SECRET) + "\n" + json.dumps(OTHER) + "\n")
    return catalog


def test_purge_removes_only_the_purged_example_everywhere(tmp_path):
    catalog = _workspace(tmp_path)
    report = purge_workspace(tmp_path, catalog)
    assert (report.examples, report.dataset_rows, report.key_rows, report.record_positions, report.batch_lines) == (
        1, 1, 2, 2, 1)
    table = pq.read_table(tmp_path / "lake" / "datasets" / "forget-x.parquet").to_pylist()
    assert table[0]["question"] is None and table[0]["sha256"] and table[1]["question"] == OTHER["question"]
    keys = pq.read_table(tmp_path / "lake" / "keys" / "e1" / "lm_head.parquet").to_pylist()
    assert [(k["example_id"], k["position"]) for k in keys] == [(1, 3)]
    record = load_records(tmp_path / "lake" / "records" / "e1.safetensors")["lm_head"]
    assert record.example_ids.tolist() == [1] and record.keys.tolist() == [[2.0], [5.0]]
    assert [json.loads(line) for line in (tmp_path / "requests" / "batch-dead.jsonl").read_text().splitlines()] == [
        OTHER]
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:
        assert SECRET["answer"].encode() not in path.read_bytes(), path
    again = purge_workspace(tmp_path, catalog)  # nothing left: a second purge changes nothing
    assert (again.dataset_rows, again.key_rows, again.record_positions, again.batch_lines) == (0, 0, 0, 0)


def test_a_request_hands_its_subjects_to_the_method_and_the_purge_nulls_them(tmp_path):
    catalog = Catalog(tmp_path / "catalog.duckdb")
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service("svc", "r.parquet", "d", {}, {}, {}))
    rid = queue.add_request(catalog, "svc", {"digest": "d1", "name": "f", "role": "request", "source": "f",
                                             "examples": [with_sha256(SECRET), with_sha256(OTHER)]},
                            reason=None, requester=None)
    assert queue.batch_examples(catalog, [rid]) == [SECRET, OTHER]  # the counterfactual drops need the subject
    assert [e["subject"] for e in queue.get_request(catalog, rid)["examples"]] == ["Zyxwv Qubit", None]
    with catalog.transaction() as con:
        queue.purge_text(con, [rid])
    assert catalog.query("SELECT count(*) AS n FROM examples WHERE subject IS NOT NULL OR question IS NOT NULL")[0][
        "n"] == 0


def test_the_compacted_catalog_keeps_rows_and_sequences(tmp_path):
    catalog = _workspace(tmp_path)
    before = catalog.query("SELECT * FROM examples ORDER BY example_index")
    compact_catalog(catalog)
    assert catalog.query("SELECT * FROM examples ORDER BY example_index") == before
    rid = queue.add_request(catalog, "svc", {"digest": "d2", "name": "f", "role": "request", "source": "f",
                                             "examples": [with_sha256({"text": "another example"})]}, reason=None,
                            requester=None)
    assert rid == 2  # the request id sequence went on where it was
    assert not (tmp_path / "catalog.duckdb.compact").exists()
