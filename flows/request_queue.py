"""The deletion-request queue's commands: add, list, show and requeue requests.

They read and write the catalog alone, so they load no model stack (torch, transformers, Prefect, MLflow): `grom
request list` answers at once. Processing the queue is `flows.process_requests`; the model versions behind it,
`flows.service`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flows.workspace import Workspace
from grom_core.fingerprint import data_digest
from tasks import requests as queue
from tasks.datafiles import check_overlap, read_examples
from tasks.records import with_sha256

log = logging.getLogger("grom.service")


def add_request(forget: str, *, reason: str | None = None, requester: str | None = None,
                model_name: str | None = None, home: str | None = None) -> dict:
    """Queue a deletion request: the file's examples go into the catalog with their sha256, status pending."""
    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    service = queue.get_service(catalog, model_name)
    rows = read_examples(forget)
    check_overlap(rows, [], forget, None)  # the same example twice: what `grom unlearn` refuses too
    examples = [with_sha256(r) for r in rows]
    dataset = {"digest": data_digest(rows), "name": f"request:{Path(forget).name}", "role": "request",
               "source": str(forget), "examples": examples}
    request_id = queue.add_request(catalog, service.model_name, dataset, reason=reason, requester=requester)
    log.info("request %d queued for %s: %d examples from %s", request_id, service.model_name, len(rows), forget)
    return {"request_id": request_id, "status": queue.PENDING, "model_name": service.model_name,
            "examples": len(rows)}


def list_requests(home: str | None = None, status: str | None = None) -> dict:
    return {"requests": queue.list_requests(Workspace.resolve(home).catalog(), status)}


def show_request(request_id: int, home: str | None = None) -> dict:
    return queue.get_request(Workspace.resolve(home).catalog(), request_id)


def requeue_request(request_id: int, home: str | None = None) -> dict:
    catalog = Workspace.resolve(home).catalog()
    queue.requeue(catalog, request_id)
    return {"request_id": request_id, "status": queue.PENDING}
