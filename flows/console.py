"""What every `grom` command shares: logging to stderr, one JSON object or tables on stdout, common options."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from flows.formatting import fmt, quantization_columns
from grom_core.errors import DataError
from grom_core.methods import METHODS

# User text (reasons, requesters, file names, model names) goes into tables, errors and logs as written: no Rich
# markup ("[/bold]" is a name, not a tag), no emoji codes (":x:" stays), no highlighting of numbers in it.
PLAIN = {"markup": False, "emoji": False, "highlight": False}
err = Console(stderr=True, **PLAIN)
UNBOUNDED_WIDTH = 100_000  # characters: wide enough that measuring a table never wraps or cuts a cell

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
HomeOpt = Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")]
ConfigOpt = Annotated[str | None, typer.Option(
    "--config", help='Fields of the benchmark\'s configuration as JSON, e.g. {"shared_names": false} for a minimuse '
                     'whose forget part shares no names with the others: a variant, built apart.')]
MethodOpt = Annotated[str, typer.Option(help="Unlearning method: " + "; ".join(
    f"{m.name} ({m.summary})" for m in METHODS.values()) + ".")]


class Verbosity:
    """How much a command logs, set once per process by `grom -v` (the root callback) before any command runs."""

    detail = False


def setup_logging(stages: bool) -> None:
    """Logging to stderr: a command with long stages (`stages`) logs each stage's summary line (logger "grom");
    the library's own lines (grom_core, tasks) appear with `grom -v` only, where every stage says what it did."""
    verbose = stages and Verbosity.detail
    root = logging.getLogger()
    for handler in root.handlers[:]:
        # removed but not closed (which basicConfig(force=True) would do): a library's handler (absl's, added on
        # import) may hold a stream that is not ours to close
        root.removeHandler(handler)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False, markup=False)])
    logging.getLogger("grom").setLevel(logging.DEBUG if verbose else logging.INFO if stages else logging.WARNING)
    logging.getLogger("grom_core").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("tasks").setLevel(logging.INFO if verbose else logging.WARNING)
    # bitsandbytes and kernels warn, on every quantization, that the Hub's CPU kernels cannot be fetched offline
    for noisy in ("transformers", "httpx", "bitsandbytes", "kernels",
                  *(() if verbose else ("prefect", "mlflow", "alembic"))):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def emit(payload: dict, as_json: bool, *tables: Table | None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
        return
    for table in tables:
        if table is not None:
            table_console(table).print(table)


def table_console(table: Table) -> Console:
    """Where a table goes on stdout: a terminal at its own width (rich wraps the cells to fit), anything else (a
    file, a pipe, a CI log) at the table's natural width, so that no figure is cut short ("0.11…")."""
    console = Console(**PLAIN)
    if console.is_terminal:
        return console
    natural = Console(width=UNBOUNDED_WIDTH, **PLAIN).measure(table).maximum
    return Console(width=max(natural, console.width), **PLAIN)


def metrics_table(title: str, before: dict, after: dict) -> Table:
    table = Table(title=title)
    for column in ("metric", "before", "after"):
        table.add_column(column)
    for key, value in before.items():
        if isinstance(value, int | float) or isinstance(after.get(key), int | float):
            table.add_row(key, fmt(value), fmt(after.get(key)))
    return table


def before_after_table(result: dict) -> Table:
    where = f" on layers {result['layers']}" if result.get("layers") else ""
    table = metrics_table(f"{result['method']} edit {result['edit_id']}{where}", result["metrics"]["before"],
                           result["metrics"]["after"])
    t, u = result["timings_s"], result["unlearning"]
    how = (f"retain statistics {'cached' if result['cached_stats'] else 'computed'}"
           if result.get("cached_stats") is not None else f"{u['steps']} optimizer steps, {result['compose']}")
    table.caption = (f"unlearning {t['unlearning']:.2f} s ({how}), total {t['total']:.1f} s, peak RSS "
                     f"{result['peak_rss_mb']:.0f} MB; MLflow {result['mlflow']['model_name']} "
                     f"v{result['mlflow']['version']}")
    return table


def quantization_table(result: dict) -> Table | None:
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


def key_values(table: Table, payload: dict, key_column: str = "item") -> Table:
    """A two-column table of `payload`: numbers to 4 significant digits, nested values as JSON."""
    table.add_column(key_column)
    table.add_column("value")
    for key, value in payload.items():
        table.add_row(key, fmt(value) if not isinstance(value, dict | list) else json.dumps(value, default=str))
    return table


def _parsed(text: str, option: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{option} is not valid JSON ({exc.msg} at character {exc.pos}): {text}") from exc


def json_objects(text: str | None, option: str) -> list[dict]:
    """An option that holds one JSON object or a list of them, as a list (empty when not given)."""
    if not text:
        return []
    value = _parsed(text, option)
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, dict) for v in values):
        raise DataError(f"{option} must be a JSON object or a list of objects, got {text}")
    return values


def json_option(text: str | None, option: str) -> dict:
    if not text:
        return {}
    value = _parsed(text, option)
    if not isinstance(value, dict):
        raise DataError(f"{option} must be a JSON object, got {text}")
    return value
