"""Deletion requests in the catalog: the queue, its atomic claims, and the services that answer requests.

Life of a request:

    pending --claim--> processing --gates pass--> done (model_version = the version now in service)
                                  \\-gates fail--> review (review_reasons; the version is registered, not promoted)
                                  \\-run fails---> pending (claim released)
    done --grom revert of its version--> reopened

A claim is one UPDATE inside one transaction, and DuckDB lets one process hold the file at a time, so two
processes never take the same request. A claim records its owner (host, pid); a run killed mid-way leaves
`processing` rows that the next run takes back once their owner is dead or the claim is older than `stale_after_s`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from grom_core.errors import DataError
from tasks.catalog import Catalog, insert_dataset, now
from tasks.records import TEXT_COLUMNS, text_rows

PENDING, PROCESSING, DONE, REVIEW, REOPENED = "pending", "processing", "done", "review", "reopened"
STATUSES = (PENDING, PROCESSING, DONE, REVIEW, REOPENED)
ACTIVE = (PENDING, PROCESSING, DONE, REVIEW)  # a request in these states still stands; a new one may not repeat it

COLUMNS = ("request_id", "status", "model_name", "dataset_digest", "n_examples", "reason", "requester", "source",
           "created_at", "updated_at", "claim_owner", "claimed_at", "model_version", "edit_id", "run_id",
           "review_reasons", "purged")


@dataclass(frozen=True)
class Service:
    """A registered model that answers deletion requests: its retain data, the unlearning method and its
    parameters, gates, evaluation, and how its data's QA pairs become text (the requests' and the retain data's)."""

    model_name: str
    retain_path: str
    retain_digest: str
    params: dict
    gates: dict
    evaluation: dict
    prompt_format: str = "qa"
    method: str = "grom"

    def check(self) -> None:
        """The stored settings are ones a run can use (a service registered before a check existed, or a catalog
        edited by hand, may hold NaN parameters or unknown evaluation keys): a one-line error naming the fix,
        before any request is claimed."""
        from grom_core.gates import Gates
        from grom_core.methods import method_params
        from tasks.records import EvaluationSettings

        try:
            method_params(self.method, self.params)
            Gates.from_dict(self.gates)
            EvaluationSettings.from_dict(self.evaluation)
        except DataError as exc:
            raise DataError(f"the service '{self.model_name}' holds settings no run can use ({exc}); register it "
                            f"again with `grom model register --name {self.model_name} ...` and valid settings"
                            ) from exc


def save_service(con, service: Service) -> None:
    con.execute("DELETE FROM services WHERE model_name = ?", [service.model_name])
    con.execute("INSERT INTO services (model_name, retain_path, retain_digest, params, gates, evaluation, created_at, "
                "prompt_format, method) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [service.model_name, service.retain_path, service.retain_digest, json.dumps(service.params),
                 json.dumps(service.gates), json.dumps(service.evaluation), now(), service.prompt_format,
                 service.method])


def get_service(catalog: Catalog, model_name: str | None = None) -> Service:
    """The named service, or the only one; a clear error when there is none or the choice is ambiguous."""
    rows = catalog.query("SELECT * FROM services ORDER BY created_at")
    if model_name is not None:
        rows = [r for r in rows if r["model_name"] == model_name]
    if not rows:
        which = f" named '{model_name}'" if model_name else ""
        raise DataError(f"no model{which} is registered to answer deletion requests in this workspace; run "
                        f"`grom model register --model DIR --retain FILE` first")
    if len(rows) > 1:
        names = ", ".join(r["model_name"] for r in rows)
        raise DataError(f"several models answer requests here ({names}); pick one with --model-name")
    row = rows[0]
    return Service(model_name=row["model_name"], retain_path=row["retain_path"], retain_digest=row["retain_digest"],
                   params=json.loads(row["params"]), gates=json.loads(row["gates"]),
                   evaluation=json.loads(row["evaluation"]), prompt_format=row.get("prompt_format") or "qa",
                   method=row.get("method") or "grom")


def _event(con, request_id: int, status: str, detail: str = "") -> None:
    con.execute("INSERT INTO request_events VALUES (?, ?, ?, ?)", [request_id, now(), status, detail])


def add_request(catalog: Catalog, model_name: str, dataset: dict, *, reason: str | None, requester: str | None) -> int:
    """Queue one request (status pending) with its examples and their sha256; returns its id.

    Refused when every example is already part of a request that still stands (pending, processing, done,
    review): that would be a duplicate.
    """
    shas = {ex["sha256"] for ex in dataset["examples"]}
    with catalog.transaction() as con:
        covering = con.execute(
            f"""SELECT DISTINCT r.request_id, r.status, e.sha256 FROM requests r
                JOIN examples e ON e.dataset_digest = r.dataset_digest
                WHERE r.model_name = ? AND r.status IN ({', '.join('?' * len(ACTIVE))})""",
            [model_name, *ACTIVE]).fetchall()
        covered = {sha for _, _, sha in covering}
        if shas <= covered:
            ids = sorted({(rid, status) for rid, status, sha in covering if sha in shas})
            listed = ", ".join(f"{rid} ({status})" for rid, status in ids)
            raise DataError(f"duplicate request: every example of {dataset['source']} is already in request "
                            f"{listed}; see `grom request show ID`")
        insert_dataset(con, dataset)
        request_id = con.execute("SELECT nextval('request_ids')").fetchone()[0]
        con.execute("""INSERT INTO requests (request_id, status, model_name, dataset_digest, n_examples, reason,
                       requester, source, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    [request_id, PENDING, model_name, dataset["digest"], len(dataset["examples"]), reason, requester,
                     dataset["source"], now(), now()])
        _event(con, request_id, PENDING, f"added from {dataset['source']}")
    return int(request_id)


def _rows(con, where: str, params: list) -> list[dict]:
    rel = con.execute(f"SELECT {', '.join(COLUMNS)} FROM requests {where}", params)
    out = []
    for row in rel.fetchall():
        item = dict(zip(COLUMNS, row, strict=True))
        item["review_reasons"] = json.loads(item["review_reasons"]) if item["review_reasons"] else []
        out.append(item)
    return out


def list_requests(catalog: Catalog, status: str | None = None) -> list[dict]:
    if status is not None and status not in STATUSES:
        raise DataError(f"unknown status '{status}'; choose one of {', '.join(STATUSES)}")
    with catalog.connect() as con:
        if status:
            return _rows(con, "WHERE status = ? ORDER BY request_id", [status])
        return _rows(con, "ORDER BY request_id", [])


def get_request(catalog: Catalog, request_id: int) -> dict:
    """One request with its history and its examples (text, or only the sha256 once purged)."""
    with catalog.connect() as con:
        found = _rows(con, "WHERE request_id = ?", [request_id])
        if not found:
            total = con.execute("SELECT count(*) FROM requests").fetchone()[0]
            raise DataError(f"no deletion request {request_id} in this workspace ({total} requests); list them "
                            f"with `grom request list`")
        request = found[0]
        events = con.execute("SELECT event_at, status, detail FROM request_events WHERE request_id = ? "
                             "ORDER BY event_at", [request_id]).fetchall()
        request["events"] = [{"at": at, "status": status, "detail": detail} for at, status, detail in events]
        request["examples"] = [
            {"index": i, "sha256": sha, "question": q, "answer": a, "text": t, "subject": s, "purged": p}
            for i, sha, q, a, t, s, p in con.execute(
                """SELECT example_index, sha256, question, answer, text, subject, purged FROM examples
                   WHERE dataset_digest = ? ORDER BY example_index""", [request["dataset_digest"]]).fetchall()]
    return request


def claim_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(owner: str | None) -> bool:
    """True when the claim belongs to a process of this host that no longer runs."""
    if not owner:
        return True
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim(catalog: Catalog, model_name: str, owner: str, stale_after_s: float = 6 * 3600) -> list[int]:
    """Take every pending request of `model_name`, and every stale claim, for `owner`; returns their ids."""
    with catalog.transaction() as con:
        stale = [rid for rid, who, at in con.execute(
            "SELECT request_id, claim_owner, claimed_at FROM requests WHERE model_name = ? AND status = ?",
            [model_name, PROCESSING]).fetchall()
            if owner_gone(who) or at is None or at < now() - timedelta(seconds=stale_after_s)]
        pending = [r[0] for r in con.execute(
            "SELECT request_id FROM requests WHERE model_name = ? AND status = ?", [model_name, PENDING]).fetchall()]
        ids = sorted(pending + stale)
        for rid in ids:
            con.execute("UPDATE requests SET status = ?, claim_owner = ?, claimed_at = ?, updated_at = ? "
                        "WHERE request_id = ?", [PROCESSING, owner, now(), now(), rid])
            _event(con, rid, PROCESSING, f"claimed by {owner}" + (" (stale claim taken back)" if rid in stale else ""))
    return ids


def release(catalog: Catalog, ids: list[int], owner: str, why: str) -> None:
    """Give claimed requests back to the queue (the run failed before answering them)."""
    with catalog.transaction() as con:
        for rid in ids:
            changed = con.execute("UPDATE requests SET status = ?, claim_owner = NULL, updated_at = ? "
                                  "WHERE request_id = ? AND status = ? AND claim_owner = ? RETURNING request_id",
                                  [PENDING, now(), rid, PROCESSING, owner]).fetchall()
            if changed:
                _event(con, rid, PENDING, f"claim released: {why}"[:500])


def finish(con, ids: list[int], *, status: str, version: str | None, edit_id: str | None, run_id: str | None,
           reasons: list[str]) -> None:
    """Mark claimed requests done (answered by `version`) or for review (with the gate failures), inside the
    caller's transaction so that they change together with the run's other rows."""
    for rid in ids:
        con.execute("""UPDATE requests SET status = ?, model_version = ?, edit_id = ?, run_id = ?,
                       review_reasons = ?, claim_owner = NULL, updated_at = ? WHERE request_id = ?""",
                    [status, version, edit_id, run_id, json.dumps(reasons), now(), rid])
        detail = f"version {version}, edit {edit_id}" + (f": {'; '.join(reasons)}" if reasons else "")
        _event(con, rid, status, detail[:500])


def _move(con, model_name: str, version: str, old: str, new: str, detail: str) -> list[int]:
    """Every request of `model_name` answered by `version` and in status `old` goes to `new`; returns their ids."""
    ids = sorted(r[0] for r in con.execute(
        "UPDATE requests SET status = ?, updated_at = ? WHERE model_name = ? AND model_version = ? AND status = ? "
        "RETURNING request_id", [new, now(), model_name, version, old]).fetchall())
    for rid in ids:
        _event(con, rid, new, detail)
    return ids


def approve(con, model_name: str, version: str, who: str) -> list[int]:
    """Requests in review that `version` answered become done: an operator promoted it despite its gates."""
    return _move(con, model_name, version, REVIEW, DONE, f"version {version} promoted by {who} after review")


def reopen(con, model_name: str, version: str, why: str) -> list[int]:
    """Requests answered by `version` of `model_name` go back to reopened (their edit was reverted)."""
    return _move(con, model_name, version, DONE, REOPENED, why)


def requeue(catalog: Catalog, request_id: int) -> None:
    """A request in review or reopened goes back to pending (its text must still be there)."""
    request = get_request(catalog, request_id)
    if request["status"] not in (REVIEW, REOPENED):
        raise DataError(f"request {request_id} is {request['status']}; only requests in review or reopened can be "
                        f"queued again")
    if request["purged"]:
        raise DataError(f"request {request_id}'s text was purged when it was done; add it again with its file "
                        f"(`grom request add --forget FILE`)")
    with catalog.transaction() as con:
        con.execute("UPDATE requests SET status = ?, updated_at = ? WHERE request_id = ?", [PENDING, now(), request_id])
        _event(con, request_id, PENDING, f"queued again (was {request['status']})")


def batch_examples(catalog: Catalog, ids: list[int]) -> list[dict]:
    """The claimed requests' examples in request order, each example once (by sha256), as question/answer (with
    their subject where one was given) or text rows ready to be written to a forget file."""
    columns = ", ".join(f"e.{c}" for c in TEXT_COLUMNS)  # fixed names, not user input
    rows = catalog.query(
        f"""SELECT e.sha256, e.purged, {columns} FROM requests r JOIN examples e ON e.dataset_digest = r.dataset_digest
            WHERE r.request_id IN ({', '.join('?' * len(ids))}) ORDER BY r.request_id, e.example_index""", ids)
    seen, out = set(), []
    for row in rows:
        if row["sha256"] in seen:
            continue
        if row["purged"]:
            raise DataError(f"example {row['sha256'][:12]} of requests {ids} was purged; add the request again with "
                            f"its file (`grom request add`)")
        seen.add(row["sha256"])
        out.append(row)
    return text_rows(out)


def purge_text(con, ids: list[int]) -> int:
    """Drop the raw text of the requests' examples everywhere in the catalog (every dataset holding the same
    example, by sha256); the sha256s, keys and influence stay. Returns the number of example rows purged."""
    if not ids:
        return 0
    marks = ", ".join("?" * len(ids))
    n = con.execute(
        f"""UPDATE examples SET question = NULL, answer = NULL, text = NULL, subject = NULL, purged = TRUE
            WHERE NOT purged AND sha256 IN (SELECT e.sha256 FROM requests r
                JOIN examples e ON e.dataset_digest = r.dataset_digest WHERE r.request_id IN ({marks}))
            RETURNING sha256""", ids).fetchall()
    con.execute(f"UPDATE requests SET purged = TRUE WHERE request_id IN ({marks})", ids)
    for rid in ids:
        _event(con, rid, DONE, "raw forget text purged (sha256 kept)")
    return len(n)


def request_shas(catalog: Catalog, ids: list[int]) -> set[str]:
    with catalog.connect() as con:
        return {r[0] for r in con.execute(
            f"""SELECT e.sha256 FROM requests r JOIN examples e ON e.dataset_digest = r.dataset_digest
                WHERE r.request_id IN ({', '.join('?' * len(ids))})""", ids).fetchall()}


def count(catalog: Catalog) -> int:
    return catalog.query("SELECT count(*) AS n FROM requests")[0]["n"]
