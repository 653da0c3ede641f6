"""The `process-deletion-requests` flow: reconcile -> claim pending requests -> unlearn them in one edit on the
version in service -> evaluate, attack with quantization and read around the edit -> gates -> register (promoted
or not) -> mark the requests done or for review, in one catalog transaction -> purge their raw text.

Crash safety: the catalog transaction is the commit point. A version registered by a run that died before it
(MLflow has it, the catalog does not) is an orphan: the next run moves the alias back and deletes it, and takes
the dead run's claims back, so a request is applied exactly once, by the version that answers it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import uuid
from pathlib import Path

from prefect import flow
from prefect.transactions import transaction

from flows.audit import redact_audits
from flows.reconcile import reconcile
from flows.runtime import kill_point
from flows.unlearn import commit, compute, register_outcome, run_timings
from flows.workspace import Workspace
from grom_core.errors import DataError, FingerprintMismatchError
from grom_core.gates import Gates
from grom_core.profiling import Timings
from tasks import requests as queue
from tasks import steps
from tasks.catalog import Catalog, now
from tasks.purge import PurgeReport, purge_workspace, purged_shas
from tasks.records import EvaluationSettings
from tasks.tracking import get_version, serving_version, set_serving
from tasks.versions import version_model_dir

log = logging.getLogger("grom.requests")


@flow(name="process-deletion-requests")
def process_deletion_requests(home: str | None = None, model_name: str | None = None, purge: bool = True,
                              stale_after_s: float = 6 * 3600) -> dict:
    """Answer every pending deletion request of a service model with one edit.

    Args:
        home: workspace folder (default ./.grom or GROM_HOME).
        model_name: the registered model whose requests to process (default: the workspace's only service).
        purge: once requests are done, drop their raw text from the catalog and the lake (sha256s, keys and
            influence stay).
        stale_after_s: a claim older than this is taken back even if its owner may still run on another host.

    Returns {"processed": [ids], "version": N or None, "promoted": bool, "reasons": [gate failures], ...}.
    """
    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    service = queue.get_service(catalog, model_name)
    service.check()  # before a claim: settings no run can use must not hand the requests back forever
    name = service.model_name
    removed = reconcile(ws.root, catalog, name, stale_after_s)
    owner = queue.claim_owner()
    ids = queue.claim(catalog, name, owner, stale_after_s)
    if not ids:
        log.info("no pending deletion request for %s", name)
        return {"processed": [], "version": None, "promoted": False, "reasons": [], "orphans_removed": removed}
    log.info("claimed requests %s for %s", ids, name)
    batch = ws.root / "requests" / f"batch-{uuid.uuid4().hex[:12]}.jsonl"
    try:
        return _answer(ws, catalog, service, ids, owner, batch, purge) | {"orphans_removed": removed}
    except BaseException as exc:
        queue.release(catalog, ids, owner, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        batch.unlink(missing_ok=True)  # a copy of text the catalog holds (or has purged)


def _answer(ws: Workspace, catalog: Catalog, service: queue.Service, ids: list[int], owner: str, batch: Path,
            purge: bool) -> dict:
    name, started, timings = service.model_name, now(), Timings(log, after_stage=kill_point)
    parent = serving_version(ws.root, name)
    if parent is None:
        raise DataError(f"'{name}' has no version in service (alias 'serving'); register one with "
                        f"`grom model register` or revert to one with `grom revert`")
    loaded = timings.run("load", steps.load, str(version_model_dir(ws.root, name, parent)))
    check_version_weights(ws.root, name, parent, loaded)  # before any work: a changed folder costs nothing
    set_aside = set_aside_oversized(catalog, service, ids, loaded)
    ids = [rid for rid in ids if rid not in set_aside]
    if not ids:
        return {"processed": [], "version": None, "promoted": False, "reasons": [], "set_aside": set_aside,
                "model_name": name}
    batch.parent.mkdir(parents=True, exist_ok=True)
    batch.write_text("".join(json.dumps(row) + "\n" for row in queue.batch_examples(catalog, ids)))
    settings = EvaluationSettings.from_dict(service.evaluation)
    outcome = compute(timings, ws, model=loaded, forget=str(batch), retain=service.retain_path,
                      method=service.method, params=service.params, evaluation=None,
                      quantizers=list(settings.quantizers), max_examples=settings.max_examples,
                      prompt_format=service.prompt_format, attacks=list(settings.attacks))
    reasons = Gates.from_dict(service.gates).check(outcome.before, outcome.after, outcome.quantized,
                                                   outcome.attacks)
    promoted = not reasons
    tags = {"grom.kind": "request", "grom.owner": owner, "parent_version": parent, "promoted": str(promoted).lower(),
            "request_ids": ",".join(map(str, ids))}
    status = queue.DONE if promoted else queue.REVIEW
    edit_id = outcome.unlearned.edit_id
    purged = 0

    def answer(con) -> None:
        nonlocal purged
        queue.finish(con, ids, status=status, version=registration.version, edit_id=edit_id,
                     run_id=registration.run_id, reasons=reasons)
        if promoted and purge:
            purged = queue.purge_text(con, ids)

    with transaction():  # a failure in here deletes the version and moves the alias back (rollback hooks)
        registration = timings.run("register", register_outcome, ws, outcome, name=name, tags=tags,
                                   timings=timings.seconds, parent_version=parent)
        if promoted:
            set_serving(ws.root, name, registration.version)
        stage_timings = run_timings(timings, outcome)
        rows = outcome.catalog_rows(registration, flow="process-deletion-requests", started=started,
                                    timings=stage_timings,
                                    extra_metrics={"gates": {"passed": promoted, "reasons": reasons,
                                                             "thresholds": service.gates},
                                                   "parent_version": parent, "request_ids": ids})
        commit(ws, rows, also=answer)
    swept = purge_traces(ws, catalog) if promoted and purge else None
    log.info("requests %s -> %s version %s (%s)%s", ids, name, registration.version,
             "promoted" if promoted else "not promoted", f": {'; '.join(reasons)}" if reasons else "")
    return {"processed": ids, "set_aside": set_aside, "version": registration.version, "promoted": promoted,
            "reasons": reasons,
            "status": status, "parent_version": parent, "edit_id": edit_id, "model_name": name,
            "metrics": outcome.metrics(), "purged_examples": purged,
            "purge": dataclasses.asdict(swept) if swept else None, "model_dir": outcome.edited.model_dir,
            "seconds": timings.total()}


def set_aside_oversized(catalog: Catalog, service: queue.Service, ids: list[int], loaded: steps.LoadedModel
                        ) -> dict[int, str]:
    """Requests holding a row longer than the method reads (its `max_length`, at most the model's positions) go to
    review with the reason, and the others are answered without them: such a row would be cut, so the edit would
    forget its first tokens only, and its hundreds of positions would take the edit's retain budget from every
    other request of the batch. Returns {request id: reason}."""
    from grom_core.data import as_examples, encode
    from grom_core.methods import method_params

    typed = method_params(service.method, service.params)
    limit = getattr(typed, "max_length", None) or getattr(getattr(typed, "trainer", None), "max_length", None)
    positions = getattr(loaded.model.config, "max_position_embeddings", None)
    limit = min(v for v in (limit, positions) if v) if (limit or positions) else None
    if limit is None:
        return {}
    out: dict[int, str] = {}
    for rid in ids:
        for number, example in enumerate(as_examples(queue.batch_examples(catalog, [rid])), start=1):
            n = len(encode(loaded.tokenizer, example, max_length=sys.maxsize, fmt=service.prompt_format).input_ids)
            if n > limit:
                out[rid] = (f"row {number} is {n} tokens, longer than the {limit} the method reads (max_length): "
                            f"split it into shorter rows and add it again")
                break
    if out:
        with catalog.transaction() as con:
            for rid, why in out.items():
                queue.finish(con, [rid], status=queue.REVIEW, version=None, edit_id=None, run_id=None, reasons=[why])
        log.warning("requests %s set aside for review: %s", sorted(out), "; ".join(out.values()))
    return out


def purge_traces(ws: Workspace, catalog: Catalog) -> PurgeReport:
    """Every copy of the purged examples' text, whichever run wrote it: the lake, leftover batch files, audits and
    their MLflow copies, and the catalog file's free pages (see tasks.purge)."""
    shas = purged_shas(catalog)
    audits = redact_audits(ws.root, catalog, shas)
    report = purge_workspace(ws.root, catalog, shas)
    log.info("purge: %d audits redacted", audits)
    return report


def check_version_weights(root: Path, name: str, version: str, loaded: steps.LoadedModel) -> None:
    """The loaded weights are those registered as `version` (its fingerprint tag), or a clear error."""
    expected = get_version(root, name, version).tags.get("fingerprint")
    if expected and loaded.fingerprint() != expected:
        raise FingerprintMismatchError(f"the weights in {loaded.model_dir} are not those registered as version "
                                       f"{version} of '{name}'; restore the folder (or delete it: the version is "
                                       f"materialised from the registry then) or register the model again")
