"""What the command line prints on stdout: tables that a file or a CI log keeps whole."""

import os

from rich.table import Table

from flows.console import emit


def test_a_table_written_to_a_file_keeps_every_figure_whole(capsys):
    table = Table(title="wide")
    for i in range(14):
        table.add_column(f"recovery forget rougeL recall {i}")
    figures = [f"{-0.0061234 * (i + 1):.6g}" for i in range(14)]
    table.add_row(*figures)
    table.add_row("keys at answers (same weights as benchmark parameters)", *["x"] * 13)
    emit({"ignored": True}, False, table)
    out = capsys.readouterr().out  # captured: not a terminal, as in a pipe or a CI log
    assert "…" not in out
    assert all(figure in out for figure in figures)
    assert "keys at answers (same weights as benchmark parameters)" in out  # not wrapped over lines
    assert max(len(line) for line in out.splitlines()) > 14 * len("recovery forget rougeL recall 10")


def test_json_is_one_object_and_no_table(capsys):
    table = Table()
    table.add_column("metric")
    emit({"forget_quality": 0.111}, True, table)
    assert capsys.readouterr().out == '{"forget_quality": 0.111}\n'


def test_libraries_are_quiet_unless_verbose_and_the_users_environment_wins(monkeypatch):
    from flows.runtime import QUIET_DEFAULTS, quiet_libraries

    for key in QUIET_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    quiet_libraries(verbose=True)
    assert not any(key in os.environ for key in QUIET_DEFAULTS)
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "DEBUG")
    quiet_libraries(verbose=False)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "ERROR" and os.environ["MLFLOW_LOGGING_LEVEL"] == "DEBUG"
