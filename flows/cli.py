"""The `grom` command line. Logs go to stderr; with --json exactly one JSON object goes to stdout."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from flows.formatting import fmt, quantization_columns
from flows.runtime import configure_process
from grom_core.errors import DataError, GromError
from grom_core.methods import DEFAULT_METHOD, METHODS

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Retraining-free unlearning: a closed-form edit with exact per-example influence.")
err = Console(stderr=True)
log = logging.getLogger("grom")


@app.callback()
def _root() -> None:
    """Retraining-free unlearning: a closed-form edit with exact per-example influence."""


def _setup_logging(verbose: bool) -> None:
    root = logging.getLogger()
    for handler in root.handlers[:]:
        # removed but not closed (which basicConfig(force=True) would do): a library's handler (absl's, added on
        # import) may hold a stream that is not ours to close
        root.removeHandler(handler)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False)])
    logging.getLogger("grom").setLevel(logging.INFO)
    logging.getLogger("grom_core").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("tasks").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _emit(payload: dict, as_json: bool, *tables: Table | None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
        return
    for table in tables:
        if table is not None:
            Console().print(table)


def _metrics_table(title: str, before: dict, after: dict) -> Table:
    table = Table(title=title)
    for column in ("metric", "before", "after"):
        table.add_column(column)
    for key, value in before.items():
        if isinstance(value, int | float) or isinstance(after.get(key), int | float):
            table.add_row(key, fmt(value), fmt(after.get(key)))
    return table


def _before_after_table(result: dict) -> Table:
    where = f" on layers {result['layers']}" if result.get("layers") else ""
    table = _metrics_table(f"{result['method']} edit {result['edit_id']}{where}", result["metrics"]["before"],
                           result["metrics"]["after"])
    t, u = result["timings_s"], result["unlearning"]
    how = (f"retain statistics {'cached' if result['cached_stats'] else 'computed'}"
           if result.get("cached_stats") is not None else f"{u['steps']} optimizer steps, {result['compose']}")
    table.caption = (f"unlearning {t['unlearning']:.2f} s ({how}), total {t['total']:.1f} s, peak RSS "
                     f"{result['peak_rss_mb']:.0f} MB; MLflow {result['mlflow']['model_name']} "
                     f"v{result['mlflow']['version']}")
    return table


def _quantization_table(result: dict) -> Table | None:
    """One row per quantization attack: the forget metric, its recovery, and how much of the edit survived."""
    quantized = {q: m for q, m in result["metrics"].get("quantized", {}).items() if isinstance(m, dict)}
    if not quantized:
        return None
    table = Table(title="after quantize-dequantize (recovery = quantized - unquantized)")
    table.add_column("attack")
    columns = quantization_columns(quantized)
    for column in columns:
        table.add_column(column.replace("_", " "))
    for name, metrics in quantized.items():
        table.add_row(name, *[fmt(metrics.get(c)) for c in columns])
    return table


WorkersOpt = Annotated[int, typer.Option(min=0, help="Shard retain statistics over a local Dask cluster.")]
MethodOpt = Annotated[str, typer.Option(help="Unlearning method: " + "; ".join(
    f"{m.name} ({m.summary})" for m in METHODS.values()) + ".")]
ComposeOpt = Annotated[str | None, typer.Option(help="Gradient composition of a gradient method: sum, pcgrad or sago "
                                                     "(sets its `compose` parameter).")]
ParamsOpt = Annotated[str | None, typer.Option(help='The method\'s parameters as JSON, e.g. {"beta": 60}; unknown '
                                                    'names and wrong types are refused before any work.')]


def _method_params(params: str | None, compose: str | None = None, layers: str | None = None) -> dict:
    """--params JSON, with --compose and --layers folded in (the method's dataclass checks them all)."""
    values = _json_option(params, "--params")
    if compose is not None:
        values["compose"] = compose
    if layers:
        try:
            values["layers"] = [int(x) for x in layers.split(",") if x.strip()]
        except ValueError as exc:
            raise DataError(f"--layers must be comma-separated integers, got '{layers}'") from exc
    return values
DaskOpt = Annotated[str | None, typer.Option(help="Existing Dask scheduler, e.g. tcp://host:8786.")]


@app.command()
def demo(
    home: Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")] = None,
    benchmark: Annotated[str, typer.Option(help="Benchmark to build and unlearn.")] = "minitofu",
    split: Annotated[str | None, typer.Option(help="Forget split (default: the benchmark's, forget10).")] = None,
    authors: Annotated[int | None, typer.Option(min=10, help="minitofu size (default 50 authors).")] = None,
    method: MethodOpt = DEFAULT_METHOD,
    compose: ComposeOpt = None,
    params: ParamsOpt = None,
    quantization: Annotated[bool, typer.Option(help="Run the 4-/8-bit quantization recovery attack.")] = True,
    workers: WorkersOpt = 0,
    dask_address: DaskOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Build a benchmark (minitofu; models cached), unlearn its forget split through the whole flow (GROM by
    default), show before/after."""
    from flows.demo import run_demo

    _setup_logging(True)
    result = run_demo(home=home, benchmark=benchmark, split=split, workers=workers, dask_address=dask_address,
                      authors=authors, method=method, params=_method_params(params, compose),
                      quantization=quantization)
    _emit(result, as_json, _before_after_table(result), _quantization_table(result))


@app.command()
def unlearn(
    model: Annotated[str, typer.Option(help="Model directory (save_pretrained, safetensors), or models:/NAME/VERSION "
                                            "or models:/NAME@serving from the workspace's registry.")],
    forget: Annotated[str, typer.Option(help="Forget data: JSON, JSONL, Parquet or CSV.")],
    retain: Annotated[str, typer.Option(help="Retain data, same formats.")],
    method: MethodOpt = DEFAULT_METHOD,
    compose: ComposeOpt = None,
    params: ParamsOpt = None,
    layers: Annotated[str | None, typer.Option(help="Comma-separated layers to edit (default: automatic).")] = None,
    model_name: Annotated[str | None, typer.Option(help="Registered model name in MLflow.")] = None,
    quantization: Annotated[bool, typer.Option(help="Run the 4-/8-bit quantization recovery attack.")] = False,
    home: Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")] = None,
    workers: WorkersOpt = 0,
    dask_address: DaskOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Unlearn your own forget data from your own model, keeping the retain data, and register the result."""
    from flows.demo import run_unlearn

    values = _method_params(params, compose, layers)
    _setup_logging(True)
    result = run_unlearn(model, forget, retain, home=home, params=values, model_name=model_name, workers=workers,
                         dask_address=dask_address, method=method, quantization=quantization)
    _emit(result, as_json, _before_after_table(result), _quantization_table(result))


benchmark_app = typer.Typer(no_args_is_help=True, help="Shipped benchmarks: build splits and models.")
app.add_typer(benchmark_app, name="benchmark")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
HomeOpt = Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")]


@benchmark_app.command("build")
def benchmark_build(
    name: Annotated[str, typer.Argument(help="minitofu, minimuse or miniwmdp.")],
    out: Annotated[str | None, typer.Option(help="Output folder (default <workspace>/benchmarks).")] = None,
    split: Annotated[str | None, typer.Option(help="Forget split the retain model leaves out.")] = None,
    check: Annotated[bool, typer.Option(help="Evaluate both models and save the retain reference.")] = True,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the benchmark's splits (JSONL) and train its target and retain models (cached)."""
    from flows.evaluation import build_benchmark

    _setup_logging(True)
    built = build_benchmark(name, out, home, split, check=check)
    table = Table(title=f"{name} ({built.split})")
    table.add_column("item")
    table.add_column("path")
    for key, path in {**built.splits, **{f"model: {k}": v for k, v in built.models.items()}}.items():
        table.add_row(key, str(path))
    for role, metrics in built.checks.items():
        for key, value in metrics.items():
            if isinstance(value, float):
                table.add_row(f"{role}: {key}", f"{value:.4g}")
    _emit(built.as_json(), as_json, table)


@app.command()
def evaluate(
    model: Annotated[str, typer.Option(help="Model directory (save_pretrained, safetensors).")],
    benchmark: Annotated[str, typer.Option(help="minitofu, minimuse, miniwmdp, or tofu (real files).")],
    split: Annotated[str | None, typer.Option(help="Forget split (default: the benchmark's).")] = None,
    retain_reference: Annotated[str | None, typer.Option(help="Per-question values of the retain model.")] = None,
    save_reference: Annotated[str | None, typer.Option(help="Write this model's per-question values here.")] = None,
    data_dir: Annotated[str | None, typer.Option(help="Folder of the real TOFU files (--benchmark tofu).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Generation length for ROUGE.")] = 200,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """All metrics of a benchmark for one model."""
    from flows.evaluation import evaluate_model

    _setup_logging(True)
    result = evaluate_model(model, benchmark, split=split, reference=retain_reference,
                            save_reference=save_reference, data_dir=data_dir, home=home,
                            max_new_tokens=max_new_tokens, batch_size=batch_size)
    table = Table(title=f"{benchmark} {result['split']}: {model}")
    table.add_column("metric")
    table.add_column("value")
    for key, value in result["metrics"].items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    table.caption = f"n = {result['n']}, {result['seconds']:.1f} s"
    _emit({k: v for k, v in result.items() if k != "per_question"} | {"per_question": result["per_question"]},
          as_json, table)


@app.command()
def finetune(
    data: Annotated[str, typer.Option(help="QA pairs or texts: JSON, JSONL, Parquet or CSV.")],
    out: Annotated[str, typer.Option(help="Output model directory.")],
    base: Annotated[str | None, typer.Option(help="Continue training this local checkpoint.")] = None,
    epochs: Annotated[int, typer.Option(min=1)] = 40,
    lr: Annotated[float, typer.Option(min=0.0)] = 3e-3,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    seed: int = 0,
    hidden_size: Annotated[int, typer.Option(min=8, help="Tiny model width (without --base).")] = 128,
    layers: Annotated[int, typer.Option(min=1, help="Tiny model depth (without --base).")] = 4,
    vocab_size: Annotated[int, typer.Option(min=300, help="BPE vocabulary (without --base).")] = 600,
    as_json: JsonOpt = False,
) -> None:
    """Train a causal LM on QA pairs or raw text (a tiny Llama from scratch, or continue a local checkpoint)."""
    from flows.evaluation import finetune_command
    from grom_core.finetune import TinyModelConfig, TrainConfig

    _setup_logging(True)
    train = TrainConfig(epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    shape = TinyModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_layers=layers)
    result = finetune_command(data, out, base, train, shape)
    table = Table(title="finetune")
    table.add_column("item")
    table.add_column("value")
    for key, value in result.items():
        table.add_row(key, str(value))
    _emit(result, as_json, table)


@app.command("tofu-score")
def tofu_score(
    model_logs: Annotated[str, typer.Argument(help="eval_log_aggregated.json or TOFU_EVAL.json of the model.")],
    retain: Annotated[str, typer.Option(help="The same for the retain model.")],
    as_json: JsonOpt = False,
) -> None:
    """Forget Quality, Model Utility and its nine parts from TOFU evaluation logs."""
    from flows.evaluation import tofu_score_command

    _setup_logging(False)
    result = tofu_score_command(model_logs, retain)
    table = Table(title="TOFU")
    table.add_column("metric")
    table.add_column("value")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    _emit(result, as_json, table)


@app.command()
def bench(
    benchmark: Annotated[str, typer.Option(help="Shipped benchmark.")] = "minitofu",
    split: Annotated[str | None, typer.Option(help="Forget split.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated method[:compose] list; methods: " +
                                              ", ".join(METHODS) + ".")] = ("grom,ga:sum,npo:sum,npo:sago,"
                                                                            "simnpo:sum,simnpo:sago"),
    quantizers: Annotated[str, typer.Option(help="Comma-separated: fp4, nf4, int8, rtn4, fp4_head_kept.")] = "fp4,nf4",
    epochs: Annotated[int, typer.Option(min=1, help="Epochs of the gradient methods (TOFU recipe: 10).")] = 10,
    authors: Annotated[int | None, typer.Option(min=10, help="minitofu size (default 50 authors).")] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every method side by side on one target model: time, memory, quality, and quality after quantization."""
    from flows.bench import run_bench
    from grom_core.gradient.methods import TrainerParams

    _setup_logging(True)
    result = run_bench(home, benchmark, split, tuple(m.strip() for m in methods.split(",") if m.strip()),
                       tuple(q.strip() for q in quantizers.split(",") if q.strip()), TrainerParams(epochs=epochs),
                       authors=authors)
    table = Table(title=f"grom bench: {benchmark} {result['split']}")
    quants, columns = result["quantizers"], result["columns"]
    for column in ("method", "cached", "seconds", "x closed form", "peak MB", *columns,
                   *[f"{q} {k}" for q in quants for k in columns]):
        table.add_column(column)
    for row in result["rows"]:
        cells = [row["label"], fmt(row["cached_stats"]), f"{row['seconds']:.2f}",
                 fmt(row["time_ratio_to_closed_form"]), f"{row['peak_rss_mb']:.0f}",
                 *[fmt(row["metrics"].get(k)) for k in columns]]
        for q in quants:
            cells += [fmt(row["quantized"].get(q, {}).get(k)) for k in columns]
        table.add_row(*cells)
    t = result["throughput"]
    table.caption = (f"key extraction {t['key_extraction_over_forward']:.2f}x a plain forward pass; plot: "
                     f"{result['plot']}")
    _emit(result, as_json, table)


model_app = typer.Typer(no_args_is_help=True, help="Models that answer deletion requests.")
app.add_typer(model_app, name="model")
request_app = typer.Typer(no_args_is_help=True, help="Deletion requests: queue, inspect, process.")
app.add_typer(request_app, name="request")
ModelNameOpt = Annotated[str | None, typer.Option(help="Registered model (default: the workspace's only one).")]


def _key_values(table: Table, payload: dict) -> Table:
    table.add_column("item")
    table.add_column("value")
    for key, value in payload.items():
        table.add_row(key, fmt(value) if not isinstance(value, dict | list) else json.dumps(value, default=str))
    return table


@model_app.command("register")
def model_register(
    model: Annotated[str | None, typer.Option(help="Base model directory (save_pretrained, safetensors).")] = None,
    retain: Annotated[str | None, typer.Option(help="Retain data the edits must keep: JSON, JSONL, Parquet, CSV.")]
    = None,
    name: Annotated[str | None, typer.Option(help="Registered model name (default grom-<folder>).")] = None,
    benchmark: Annotated[str | None, typer.Option(help="Use minitofu's target model, retain split and GROM preset "
                                                       "instead of --model/--retain.")] = None,
    gates: Annotated[str | None, typer.Option(help='Gate thresholds as JSON, e.g. {"max_forget_rougeL_recall": '
                                                   '0.4}.')] = None,
    params: Annotated[str | None, typer.Option(help='GROM parameters as JSON, e.g. {"beta": 80}.')] = None,
    evaluation: Annotated[str | None, typer.Option(help='Evaluation settings as JSON: {"max_examples": 200, '
                                                        '"quantizers": ["fp4", "nf4"]}.')] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a base model; it answers deletion requests, and is put in service if none is yet."""
    from flows.service import register_benchmark_model, register_model

    _setup_logging(True)
    options = {"gates": _json_option(gates, "--gates"), "params": _json_option(params, "--params"),
               "evaluation": _json_option(evaluation, "--evaluation")}
    if benchmark:
        result = register_benchmark_model(benchmark, name=name, home=home, **options)
    elif model and retain:
        result = register_model(model, retain, name=name, home=home, **options)
    else:
        raise GromError("give --model DIR and --retain FILE, or --benchmark minitofu")
    _emit(result, as_json, _key_values(Table(title=f"registered {result['model_name']} v{result['version']}"),
                                       result))


def _json_option(text: str | None, option: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{option} is not valid JSON ({exc.msg} at character {exc.pos}): {text}") from exc
    if not isinstance(value, dict):
        raise DataError(f"{option} must be a JSON object, got {text}")
    return value


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

    _setup_logging(True)
    result = promote_version(version, model_name=model_name, home=home, purge=purge)
    _emit(result, as_json, _key_values(Table(title=f"promoted version {version}"), result))


@request_app.command("requeue")
def request_requeue(
    request_id: Annotated[int, typer.Argument(help="A request in review or reopened.")],
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a request in review (or reopened, text not purged) again; the next run processes it."""
    from flows.service import requeue_request

    _setup_logging(False)
    result = requeue_request(request_id, home)
    _emit(result, as_json, _key_values(Table(title=f"request {request_id}"), result))


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
    from flows.service import add_request

    _setup_logging(True)
    result = add_request(forget, reason=reason, requester=requester, model_name=model_name, home=home)
    _emit({"request_id": result["request_id"], **result}, as_json,
          _key_values(Table(title=f"request {result['request_id']}"), result))


REQUEST_COLUMNS = ("id", "status", "model_version", "n_examples", "requester", "reason", "created_at", "purged")


@request_app.command("list")
def request_list(
    status: Annotated[str | None, typer.Option(help="Only this status.")] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every deletion request with its status and the model version that answered it."""
    from flows.service import list_requests

    _setup_logging(False)
    result = list_requests(home, status)
    for request in result["requests"]:
        request["id"] = request["request_id"]
    table = Table(title="deletion requests")
    for column in REQUEST_COLUMNS:
        table.add_column(column.replace("_", " "))
    for r in result["requests"]:
        table.add_row(*[fmt(r.get(c))[:19] for c in REQUEST_COLUMNS])
    _emit(result, as_json, table)


@request_app.command("show")
def request_show(
    request_id: Annotated[int, typer.Argument(help="Request id.")],
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One request: status, history, and its examples (sha256 only once purged)."""
    from flows.service import show_request

    _setup_logging(False)
    result = show_request(request_id, home)
    summary = Table(title=f"request {request_id}")
    _key_values(summary, {k: v for k, v in result.items() if k not in ("events", "examples")})
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
    _emit(result, as_json, summary, events, examples)


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

    _setup_logging(True)
    ws = Workspace.resolve(home)
    with prefect_environment(ws):
        from flows.requests import process_deletion_requests

        result = process_deletion_requests(home=str(ws.root), model_name=model_name, purge=purge)
    table = Table(title=f"processed requests {result['processed']}")
    _key_values(table, {k: v for k, v in result.items() if k != "metrics"})
    tables = [table]
    if result.get("metrics"):
        tables += [_metrics_table(f"edit {result['edit_id']}: version {result['parent_version']} -> "
                                  f"{result['version']}", result["metrics"]["before"], result["metrics"]["after"]),
                   _quantization_table(result)]
    _emit(result, as_json, *tables)


@app.command()
def audit(
    identifier: Annotated[str, typer.Argument(metavar="REQUEST_OR_EDIT_ID", help="A request id or an edit id.")],
    refit: Annotated[int, typer.Option(min=0, help="Check the influence of the N most influential examples by "
                                                   "running the method again without each.")] = 0,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What an edit changed: modules, per-example influence, metrics, quantization check, versions (Markdown+JSON)."""
    from flows.audit import audit as run_audit

    _setup_logging(False)
    result = run_audit(identifier, home, refit=refit)
    if as_json:
        _emit(result, True)
    else:
        from rich.markdown import Markdown

        Console().print(Markdown(Path(result["report"]["markdown"]).read_text()))
        err.print(f"report: {result['report']['markdown']} and {result['report']['json']}")


@app.command()
def revert(
    version: Annotated[str, typer.Option(help="The version in service whose edit to revert.")],
    model_name: ModelNameOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Restore the weights before an edit bit for bit, register them as a new version in service, reopen requests."""
    from flows.service import revert_version

    _setup_logging(True)
    result = revert_version(version, model_name=model_name, home=home)
    _emit(result, as_json, _key_values(Table(title=f"reverted version {version}"), result))


@app.command()
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

    _setup_logging(True)
    run_serve(home, cron=cron, interval_s=interval, model_name=model_name, port=port)


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2, never a traceback."""
    configure_process()
    try:
        app()
    except GromError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
