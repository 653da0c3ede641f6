"""The `grom` command line. Logs go to stderr; with --json exactly one JSON object goes to stdout."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from grom_core.errors import GromError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Retraining-free unlearning: a closed-form edit with exact per-example influence.")
err = Console(stderr=True)
log = logging.getLogger("grom")


@app.callback()
def _root() -> None:
    """Retraining-free unlearning: a closed-form edit with exact per-example influence."""


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False)], force=True)
    logging.getLogger("grom").setLevel(logging.INFO)
    logging.getLogger("grom_core").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _emit(payload: dict, as_json: bool, table: Table | None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
    elif table is not None:
        Console().print(table)


@app.command()
def demo(
    home: Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")] = None,
    authors: Annotated[int, typer.Option(min=4, help="Fictitious authors in the demo data.")] = 20,
    forget_authors: Annotated[int, typer.Option(min=1, help="Authors whose records are forgotten.")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Per-stage library logs.")] = False,
) -> None:
    """Train (or reuse) a tiny model on fictitious authors, forget some of them with GROM, show before/after."""
    from flows.demo import run_demo

    _setup_logging(verbose)
    result = run_demo(home=home, n_authors=authors, n_forget=forget_authors)
    table = Table(title=f"GROM edit {result['edit_id']} (layers {result['layers']})")
    for column in ("metric", "before", "after"):
        table.add_column(column)
    for key in result["metrics"]["before"]:
        table.add_row(key, f"{result['metrics']['before'][key]:.4f}", f"{result['metrics']['after'][key]:.4f}")
    table.caption = f"edit {result['timings_s']['edit']:.2f} s, total {result['timings_s']['total']:.1f} s"
    _emit(result, as_json, table)


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except GromError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
