"""`grom audit REQUEST_OR_EDIT_ID`: what one edit changed, for the people who must answer for it.

The report holds the edited modules, each forget example's exact leave-one-out influence on each module (with the
request it came from; its text only while that text has not been purged), the metrics before and after, the
quantization check, the gate decision and the model versions. It is written as Markdown and JSON under
<workspace>/audits/ and logged to the MLflow run that made the edit (artifact folder `audit`).

The influence values are exact leave-one-out changes of each module's delta with everything else held fixed (the
keys, targets, specificity weights, layer choice and c = w_forget / s). `refit=N` checks them against reality: the
method is run again without each of the N most influential examples (whose text is still there) and the real
change of every module's delta is reported beside the predicted one.
"""

from __future__ import annotations

import json
from pathlib import Path

from flows.formatting import fmt, md_cell, quantization_columns
from flows.workspace import Workspace
from grom_core.errors import DataError
from tasks.catalog import Catalog
from tasks.requests import get_request
from tasks.tracking import client

EXACTNESS = ("Influence is exact leave-one-out for each module with everything else held fixed: the keys, the targets, "
             "the specificity weights, the layer choice and c = w_forget / s. A real refit also moves those (see the "
             "refit check, `grom audit ID --refit N`).")


def audit(identifier: str, home: str | None = None, log_to_mlflow: bool = True, refit: int = 0) -> dict:
    ws = Workspace.resolve(home)
    catalog = ws.catalog()
    edit_id = _edit_of(catalog, identifier)
    edits = catalog.query("SELECT * FROM edits WHERE edit_id = ?", [edit_id])
    if not edits:
        raise DataError(f"no edit or request '{identifier}' in this workspace; a request id is a number (`grom "
                        f"request list`), an edit id is a 16-character hex string")
    edit = edits[0]
    runs = catalog.query("SELECT * FROM runs WHERE edit_id = ? AND flow <> 'revert' ORDER BY started_at", [edit_id])
    run = runs[-1] if runs else {}
    metrics = json.loads(run["metrics"]) if run.get("metrics") else {}
    requests = catalog.query("SELECT request_id, status, model_version, reason, requester, dataset_digest, purged "
                             "FROM requests WHERE edit_id = ? ORDER BY request_id", [edit_id])
    reverts = catalog.query("SELECT model_version FROM runs WHERE edit_id = ? AND flow = 'revert'", [edit_id])
    report = {
        "edit_id": edit_id, "method": edit["method"], "modules": json.loads(edit["modules"]),
        "layers": json.loads(edit["layers"]), "params": json.loads(edit["params"]),
        "base_fingerprint": edit["base_fingerprint"], "edited_fingerprint": edit["edited_fingerprint"],
        "model": {"name": run.get("model_name"), "version": run.get("model_version"),
                  "parent_version": metrics.get("parent_version"),
                  "reverted_by": [r["model_version"] for r in reverts]},
        "requests": [{k: v for k, v in r.items() if k != "dataset_digest"} for r in requests],
        "metrics": {k: metrics.get(k, {}) for k in ("before", "after")},
        "quantization": metrics.get("quantized", {}),
        "gates": metrics.get("gates"),
        "influence": _influence(catalog, edit_id, requests),
        "mlflow_run_id": run.get("mlflow_run_id"),
    }
    if refit:
        report["refit"] = refit_check(ws, edit, run, report["influence"], refit)
    out = ws.root / "audits"
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{edit_id}.json", out / f"{edit_id}.md"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    md_path.write_text(markdown(report))
    if log_to_mlflow and report["mlflow_run_id"]:
        mlflow_client = client(ws.root)
        for path in (json_path, md_path):
            mlflow_client.log_artifact(report["mlflow_run_id"], str(path), artifact_path="audit")
    return {**report, "report": {"markdown": str(md_path), "json": str(json_path)}}


def redact_audits(root: Path, catalog: Catalog, shas: set[str], log_to_mlflow: bool = True) -> int:
    """Remove the text of purged examples (`shas`) from every audit written before the purge (its JSON, its
    Markdown and their copies in the MLflow run); returns the number of audits rewritten."""
    purged_requests = {r["request_id"] for r in catalog.query("SELECT request_id FROM requests WHERE purged")}
    rewritten = 0
    for json_path in sorted((root / "audits").glob("*.json")):
        report = json.loads(json_path.read_text())
        items = [e for e in report.get("influence", []) if e.get("sha256") in shas and not e.get("purged")]
        requests = [r for r in report.get("requests", []) if r["request_id"] in purged_requests and not r["purged"]]
        if not items and not requests:
            continue
        for item in items:
            item["text"], item["purged"] = None, True
        for request in requests:
            request["purged"] = True
        md_path = json_path.with_suffix(".md")
        json_path.write_text(json.dumps(report, indent=1, default=str))
        md_path.write_text(markdown(report))
        if log_to_mlflow and report.get("mlflow_run_id"):
            mlflow_client = client(root)
            for path in (json_path, md_path):  # the same artifact path: the copy is replaced
                mlflow_client.log_artifact(report["mlflow_run_id"], str(path), artifact_path="audit")
        rewritten += 1
    return rewritten


def _edit_of(catalog: Catalog, identifier: str) -> str:
    if identifier.isdigit():
        request = get_request(catalog, int(identifier))
        if not request["edit_id"]:
            raise DataError(f"request {identifier} has not been processed yet (status {request['status']}); run "
                            f"`grom request process` first")
        return request["edit_id"]
    return identifier


def _influence(catalog: Catalog, edit_id: str, requests: list[dict]) -> list[dict]:
    """One row per forget example: its sha256, its request, its text unless purged, and its influence per module
    (the Frobenius norm of the change its removal would make to that module's delta)."""
    rows = catalog.query("SELECT module, example_index, example_sha256, value, flagged FROM influence "
                         "WHERE edit_id = ? ORDER BY example_index, module", [edit_id])
    texts = {r["sha256"]: r for r in catalog.query(
        "SELECT sha256, question, answer, text, purged FROM examples WHERE sha256 IN "
        "(SELECT example_sha256 FROM influence WHERE edit_id = ?)", [edit_id])}
    owners = {}
    for request in requests:
        for r in catalog.query("SELECT sha256 FROM examples WHERE dataset_digest = ?", [request["dataset_digest"]]):
            owners.setdefault(r["sha256"], request["request_id"])
    examples: dict[int, dict] = {}
    for row in rows:
        item = examples.setdefault(row["example_index"], {
            "example_index": row["example_index"], "sha256": row["example_sha256"],
            "request_id": owners.get(row["example_sha256"]), "influence": {}, "flagged": False})
        item["influence"][row["module"]] = row["value"]
        item["flagged"] = item["flagged"] or bool(row["flagged"])
    for item in examples.values():
        text = texts.get(item["sha256"], {})
        item["purged"] = bool(text.get("purged"))
        item["text"] = None if item["purged"] else (text.get("question") or text.get("text"))
        item["total"] = sum(item["influence"].values())
    return sorted(examples.values(), key=lambda e: -e["total"])


def refit_check(ws: Workspace, edit: dict, run: dict, influence: list[dict], n: int) -> list[dict]:
    """Run the edit's method again without each of the `n` most influential forget examples whose text is still
    there; one row per (example, module) with the predicted (audit) and the actual change of the delta."""
    import pyarrow.parquet as pq

    from grom_core.edit import Edit
    from grom_core.fingerprint import weights_fingerprint
    from grom_core.methods import MethodContext, method_params, refit_without
    from tasks.lake import LakeStatsStore, dataset_path
    from tasks.records import text_rows
    from tasks.steps import load_for_edit

    if not influence:
        raise DataError(f"edit {edit['edit_id']} ({edit['method']}) has no influence audit: nothing to check")
    base = run.get("base_model_dir")
    if not base or not (Path(base) / "config.json").is_file():
        base = str(parent_weights(ws, run, edit["edit_id"], base))
    lake = ws.root / "lake"
    tables = {role: pq.read_table(dataset_path(lake, role, run[f"{role}_digest"])).to_pylist()
              for role in ("forget", "retain")}
    rows = {role: text_rows(table) for role, table in tables.items()}
    candidates = [e["example_index"] for e in influence if not e["purged"] and rows["forget"][e["example_index"]]]
    if not candidates:
        raise DataError(f"the forget text of edit {edit['edit_id']} was purged: it cannot be refit (that is what "
                        f"purging means)")
    model, tokenizer = load_for_edit(base)
    if weights_fingerprint(model) != edit["base_fingerprint"]:
        raise DataError(f"the weights in {base} are no longer those edit {edit['edit_id']} was computed on")
    values = {k: v for k, v in json.loads(edit["params"]).items() if k != "method"}
    params = method_params(edit["method"], values)
    found = refit_without(edit["method"], model, tokenizer, rows["forget"], rows["retain"], params,
                          Edit.load(edit["edit_dir"]), candidates[:n], MethodContext(stats_store=LakeStatsStore(lake)))
    predicted = {e["example_index"]: e["influence"] for e in influence}
    for row in found:
        row["predicted"] = predicted[row["example_index"]].get(row["module"])
    return found


def parent_weights(ws: Workspace, run: dict, edit_id: str, folder: str | None) -> Path:
    """The weights an edit started from when the run's folder is gone: its registered parent version,
    materialised (tasks.versions)."""
    from tasks.tracking import get_version
    from tasks.versions import version_model_dir

    parent = None
    if run.get("model_name") and run.get("model_version"):
        parent = get_version(ws.root, run["model_name"], run["model_version"]).tags.get("parent_version")
    if not parent:
        raise DataError(f"the model edit {edit_id} started from is not recorded or its folder {folder} is gone, "
                        f"and its version names no registered parent; a refit needs those weights")
    return version_model_dir(ws.root, run["model_name"], parent)


def markdown(report: dict) -> str:
    model = report["model"]
    lines = [f"# Audit of edit {report['edit_id']}", "",
             f"Method {report['method']} on layers {report['layers']}; modules: {', '.join(report['modules'])}.",
             f"Model {model['name']}: version {model['version']} computed from version {model['parent_version']}"
             + (f", reverted by version(s) {', '.join(map(str, model['reverted_by']))}" if model["reverted_by"]
                else "") + ".",
             f"Weights {report['base_fingerprint'][:12]} -> {report['edited_fingerprint'][:12]}.", ""]
    if report["requests"]:
        lines += ["## Requests", "", "| request | status | version | reason | requester | text purged |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['request_id']} | {r['status']} | {fmt(r['model_version'])} | {md_cell(r['reason'])} | "
                  f"{md_cell(r['requester'])} | {r['purged']} |" for r in report["requests"]]
        lines.append("")
    gates = report["gates"]
    if gates:
        verdict = "passed: the version was promoted" if gates["passed"] else "failed: " + "; ".join(gates["reasons"])
        lines += [f"Gates {verdict}.", ""]
    before, after = report["metrics"]["before"], report["metrics"]["after"]
    lines += ["## Metrics", "", "| metric | before | after |", "|---|---|---|"]
    lines += [f"| {k} | {fmt(before.get(k))} | {fmt(after.get(k))} |" for k in before
              if isinstance(before.get(k), int | float)]
    quant = {k: v for k, v in report["quantization"].items() if isinstance(v, dict)}
    if quant:
        columns = quantization_columns(quant)
        lines += ["", "## Quantization attack", "", "| attack | " + " | ".join(columns) + " |",
                  "|---|" + "---|" * len(columns)]
        lines += [f"| {k} | " + " | ".join(fmt(v.get(c)) for c in columns) + " |" for k, v in quant.items()]
    modules = report["modules"]
    lines += ["", "## Influence of each forget example (leave-one-out, Frobenius norm of the delta change)", "",
              EXACTNESS, "",
              "| example | request | sha256 | text | " + " | ".join(modules) + " | flagged |",
              "|---|---|---|---|" + "---|" * len(modules) + "---|"]
    for e in report["influence"]:
        text = "(purged)" if e["purged"] else md_cell(e["text"], 60)
        lines.append(f"| {e['example_index']} | {fmt(e['request_id'])} | {e['sha256'][:12]} | {text} | "
                     + " | ".join(fmt(e["influence"].get(m)) for m in modules) + f" | {e['flagged']} |")
    if report.get("refit"):
        lines += ["", "## Refit check (the method run again without the example)", "",
                  "| example | module | predicted | actual |", "|---|---|---|---|"]
        lines += [f"| {r['example_index']} | {r['module']} | {fmt(r['predicted'])} | {fmt(r['actual'])} |"
                  for r in report["refit"]]
    return "\n".join(lines) + "\n"

