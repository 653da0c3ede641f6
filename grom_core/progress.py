"""A progress bar for long loops (training epochs, generation), drawn on stderr only where it is a terminal, so logs
and captured output stay free of it; the summary lines of each stage are logged as usual."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[..., None]]:
    """A bar of `total` steps; yields `advance(steps=1, description=None)`, which moves it on (and renames it)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True, markup=False, emoji=False, highlight=False)
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, disable=not console.is_terminal, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(steps: int = 1, description: str | None = None) -> None:
            bar.update(task, advance=steps, **({"description": description} if description else {}))

        yield advance
