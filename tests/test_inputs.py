"""Bad input and faults, round three (issue 45): each probe that broke grom, reproduced without a model where it
needs none. Every one gets a one-line error naming the problem and the fix, exit code 2, and changes nothing; or,
where the input is legitimate (Excel's CSV, text that looks like markup), it works and the text is shown as written.
"""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_grom

from grom_core.errors import DataError, ParamsError
from tasks import requests as queue
from tasks.catalog import Catalog


def dead_owner() -> str:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return f"{socket.gethostname()}:{dead.stdout.strip()}"


@pytest.fixture()
def service_home(tmp_path):
    """A workspace whose catalog holds a service (the queue's commands read the catalog alone: no model)."""
    home = tmp_path / "ws"
    home.mkdir()
    catalog = Catalog(home / "catalog.duckdb")
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service(model_name="svc", retain_path="unused", retain_digest="0",
                                              params={}, gates={}, evaluation={}))
    return home


def qa_file(path: Path, rows) -> str:
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return str(path)


# -- user text as written ----------------------------------------------------------------------------------------

def test_markup_in_a_reason_and_a_requester_is_shown_as_written(service_home, tmp_path, capsys, monkeypatch):
    forget = qa_file(tmp_path / "f.jsonl", [("Who is Eve?", "A person.")])
    reason, requester = "[link=http://x]GDPR[/link] :x:", "[/bold]eve"
    code, _, err = run_grom(capsys, monkeypatch, "request", "add", "--forget", forget, "--reason", reason,
                            "--requester", requester, "--home", str(service_home))
    assert code == 0, err
    for args, shown in ((("request", "list"), "[link=http://x]GDPR"), (("request", "show", "1"), reason)):
        code, out, err = run_grom(capsys, monkeypatch, *args, "--home", str(service_home))
        assert code == 0, err  # a MarkupError before
        assert requester in out and shown in out and "\u274c" not in out  # the list cuts the reason short
        assert "\x1b]8;" not in out  # no terminal hyperlink


def test_markup_in_an_error_message_is_shown_as_written(service_home, tmp_path, capsys, monkeypatch):
    code, _, err = run_grom(capsys, monkeypatch, "request", "list", "--status", "in[b]valid", "--home",
                            str(service_home))
    assert code == 2 and "in[b]valid" in err and len(err.strip().splitlines()) == 1
    folder = tmp_path / "a["
    folder.mkdir()
    named = qa_file(folder / "x] :x:.jsonl", [("q?", "a."), ("q?", "a.")])
    code, _, err = run_grom(capsys, monkeypatch, "request", "add", "--forget", named, "--home", str(service_home))
    assert code == 2 and "a[/x] :x:.jsonl" in " ".join(err.split()) and "Traceback" not in err


def test_markdown_cells_escape_user_text():
    from rich.console import Console
    from rich.markdown import Markdown

    from flows.formatting import md_cell

    written = "[GDPR](http://x) a|b\nc *x* <b>"
    table = f"| reason | n |\n|---|---|\n| {md_cell(written)} | 1 |\n"
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(Markdown(table))
    shown = console.export_text()
    assert "[GDPR](http://x) a|b c *x* <b>" in shown  # one cell, one line, no link, no emphasis
    assert md_cell("x" * 70, 60) == "x" * 60 + "…"


def test_an_audit_report_keeps_a_requests_reason_in_its_cell():
    from flows.audit import markdown

    report = {"edit_id": "e" * 16, "method": "grom", "layers": [1], "modules": ["m"],
              "model": {"name": "svc", "version": "2", "parent_version": "1", "reverted_by": []},
              "base_fingerprint": "a" * 64, "edited_fingerprint": "b" * 64,
              "requests": [{"request_id": 1, "status": "done", "model_version": "2", "reason": "GDPR | art. 17\n[x](y)",
                            "requester": "*eve*", "purged": False}],
              "gates": {}, "metrics": {"before": {}, "after": {}}, "quantization": {}, "influence": [], "refit": None}
    row = next(line for line in markdown(report).splitlines() if line.startswith("| 1 |"))
    assert row.count(" | ") == 5  # six cells: the reason's "|" and newline did not split or end the row
    assert "GDPR \\| art. 17 \\[x\\]\\(y\\)" in row and "\\*eve\\*" in row


# -- numbers and settings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ['{"relative_ridge": NaN}', '{"relative_ridge": Infinity}',
                                  '{"relative_ridge": 1e400}'])
def test_non_finite_parameters_are_refused(text):
    from grom_core.methods import method_params

    with pytest.raises(ParamsError, match="finite"):
        method_params("grom", json.loads(text))
    with pytest.raises(ParamsError, match="finite"):
        method_params("npo", {"beta": json.loads(text)["relative_ridge"]})


def test_non_finite_gates_are_refused():
    from grom_core.gates import Gates

    with pytest.raises(DataError, match="finite"):
        Gates.from_dict({"max_attack_recovery": math.inf})


@pytest.mark.parametrize("settings,match", [({"max_examples": "many"}, "max_examples must be int"),
                                            ({"quantizers": ["bogus"]}, "no 'bogus'"),
                                            ({"attacks": ["peek"]}, "no 'peek'"),
                                            ({"junk": 1}, "no parameter 'junk'"),
                                            ({"max_examples": 0}, "at least 1")])
def test_evaluation_settings_are_checked(settings, match):
    from tasks.records import EvaluationSettings

    with pytest.raises(ParamsError, match=match):
        EvaluationSettings.from_dict(settings)
    assert EvaluationSettings.from_dict({}).attacks == ("head_swap", "logit_lens", "relearn")


def test_a_stored_service_with_unusable_settings_fails_before_any_claim(tmp_path, capsys, monkeypatch):
    """A catalog written before the checks (or by hand) holds NaN: processing says so and claims nothing."""
    from flows.process_requests import process_deletion_requests

    home = tmp_path / "ws"
    home.mkdir()
    catalog = Catalog(home / "catalog.duckdb")
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service(model_name="svc", retain_path="unused", retain_digest="0",
                                              params={"relative_ridge": math.nan}, gates={}, evaluation={}))
    forget = qa_file(tmp_path / "f.jsonl", [("Who is Eve?", "A person.")])
    assert run_grom(capsys, monkeypatch, "request", "add", "--forget", forget, "--home", str(home))[0] == 0
    with pytest.raises(DataError, match="register it again"):
        process_deletion_requests.fn(home=str(home))
    assert [r["status"] for r in queue.list_requests(catalog)] == ["pending"]
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service(model_name="svc", retain_path="unused", retain_digest="0",
                                              params={}, gates={}, evaluation={"junk": 1}))
    with pytest.raises(DataError, match="no parameter 'junk'"):
        process_deletion_requests.fn(home=str(home))


def test_unlearn_refuses_an_unknown_attack_before_any_work(tmp_path, capsys, monkeypatch):
    code, _, err = run_grom(capsys, monkeypatch, "unlearn", "--model", str(tmp_path / "none"), "--forget", "f.jsonl",
                            "--retain", "r.jsonl", "--attacks", "head_swap,peek", "--home", str(tmp_path / "ws"))
    assert code == 2 and "no 'peek'" in err
    code, _, err = run_grom(capsys, monkeypatch, "unlearn", "--model", str(tmp_path / "none"), "--forget", "f.jsonl",
                            "--retain", "r.jsonl", "--quantizers", "q3", "--home", str(tmp_path / "ws"))
    assert code == 2 and "no 'q3'" in err


def test_threads_option_sets_torch_threads(capsys, monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(before)))
    try:
        code, _, err = run_grom(capsys, monkeypatch, "--threads", "1", "benchmark", "list", "--json")
        assert code == 0, err
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


# -- data files --------------------------------------------------------------------------------------------------

def test_the_same_row_twice_in_a_request_is_refused(service_home, tmp_path, capsys, monkeypatch):
    forget = qa_file(tmp_path / "f.jsonl", [("Who is Eve?", "A person."), ("Who is Eve?", "A person.")])
    code, _, err = run_grom(capsys, monkeypatch, "request", "add", "--forget", forget, "--home", str(service_home))
    assert code == 2 and "rows 1 and 2 are the same example" in err
    assert queue.list_requests(Catalog(service_home / "catalog.duckdb")) == []


def test_a_folder_or_a_pipe_named_like_data_is_named_for_what_it_is(tmp_path):
    from tasks.datafiles import read_examples

    folder = tmp_path / "x.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match="is a folder"):
        read_examples(folder)
    pipe = tmp_path / "p.jsonl"
    os.mkfifo(pipe)
    with pytest.raises(DataError, match="not a regular file"):
        read_examples(pipe)
    with pytest.raises(DataError, match="does not exist"):
        read_examples(tmp_path / "none.jsonl")


def test_files_with_a_byte_order_mark_are_read(tmp_path):
    from tasks.datafiles import read_examples

    csv_file = tmp_path / "excel.csv"
    csv_file.write_text("question,answer\nWho is Eve?,A person.\n", encoding="utf-8-sig")  # Excel's "CSV UTF-8"
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_text('{"question": "Who is Eve?", "answer": "A person."}\n', encoding="utf-8-sig")
    expected = [{"question": "Who is Eve?", "answer": "A person."}]
    assert read_examples(csv_file) == expected and read_examples(jsonl) == expected


# -- model files -------------------------------------------------------------------------------------------------

def test_a_gguf_file_with_only_its_header_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    code, _, err = run_grom(capsys, monkeypatch, "model", "import-gguf", str(bad), "--out", str(tmp_path / "out"))
    assert code == 2 and "not a complete GGUF file" in err and not (tmp_path / "out").exists()
    taken = tmp_path / "taken"
    taken.write_text("keep")
    code, _, err = run_grom(capsys, monkeypatch, "model", "import-gguf", str(bad), "--out", str(taken))
    assert code == 2 and "exists" in err and taken.read_text() == "keep"


# -- the registry and the catalog --------------------------------------------------------------------------------

def _register_edit(home: Path, tags: dict, committed: bool):
    """A version registered the way the flows do (no weights: an edit's artifact), its transaction committed or
    not (a run killed between the registry and the catalog)."""
    from prefect.transactions import transaction

    from tasks.tracking import register

    edit = home.parent / "edit"
    edit.mkdir(exist_ok=True)
    (edit / "edit.json").write_text("{}")
    kwargs = dict(run_name="run", model_name="svc", params={}, metrics={}, datasets=[], artifacts={"edit": edit},
                  model_dir=None, version_source="edit", tags={"grom.kind": "unlearn", **tags})
    if committed:
        with transaction():
            return register(home, **kwargs)
    return register(home, **kwargs)


def test_reconcile_keeps_committed_versions_a_lost_catalog_does_not_know(tmp_path, caplog):
    from flows.rebuild import rebuild_catalog
    from flows.reconcile import reconcile
    from tasks.tracking import client, versions

    home = tmp_path / "ws"
    home.mkdir()
    kept = _register_edit(home, {"grom.owner": dead_owner(), "fingerprint": "f" * 64}, committed=True)
    orphan = _register_edit(home, {"grom.owner": dead_owner(), "parent_version": kept.version}, committed=False)
    catalog = Catalog(home / "catalog.duckdb")  # a new, empty catalog: the old one was lost
    assert reconcile(home, catalog, "svc") == [orphan.version]  # the dead run's pending version only
    assert [str(v.version) for v in versions(home, "svc")] == [kept.version]
    assert "catalog does not record version(s) 1" in caplog.text and "grom catalog rebuild" in caplog.text
    assert client(home).get_run(orphan.run_id).info.status == "FAILED"
    restored = rebuild_catalog(str(home))
    assert restored["restored"] == [{"model_name": "svc", "version": "1", "flow": "unlearn"}]
    rows = catalog.query("SELECT mlflow_run_id, model_version, edited_fingerprint FROM runs")
    assert rows == [{"mlflow_run_id": kept.run_id, "model_version": "1", "edited_fingerprint": "f" * 64}]
    assert rebuild_catalog(str(home))["restored"] == []  # once


def test_runs_left_running_by_a_failed_start_are_closed(tmp_path):
    from flows.reconcile import reconcile
    from tasks.tracking import EXPERIMENT, client, configure

    home = tmp_path / "ws"
    home.mkdir()
    configure(home)
    mlflow = client(home)
    experiment = mlflow.get_experiment_by_name(EXPERIMENT).experiment_id
    tags = {"grom.commit": "pending", "grom.model_name": "svc", "grom.kind": "base"}
    dead = mlflow.create_run(experiment, tags={**tags, "grom.owner": dead_owner()})  # the disk filled up here
    alive = mlflow.create_run(experiment, tags={**tags, "grom.owner": queue.claim_owner()})
    other = mlflow.create_run(experiment, tags={**tags, "grom.owner": dead_owner(), "grom.model_name": "other"})
    reconcile(home, Catalog(home / "catalog.duckdb"), "svc")
    status = {r: mlflow.get_run(r.info.run_id).info.status for r in (dead, alive, other)}
    assert (status[dead], status[alive], status[other]) == ("FAILED", "RUNNING", "RUNNING")


def test_materialize_into_an_existing_file_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    home.mkdir()
    _register_edit(home, {"grom.owner": dead_owner()}, committed=True)
    taken = tmp_path / "weights.bin"
    taken.write_text("keep")
    code, _, err = run_grom(capsys, monkeypatch, "model", "materialize", "svc", "1", "--out", str(taken), "--home",
                            str(home))
    assert code == 2 and "is a file" in err and taken.read_text() == "keep"


def test_a_full_disk_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import errno
    import sqlite3

    from flows import cli

    def full_registry(*args, **kwargs):
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as exc:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full [SQL: INSERT ...]") from exc

    assert cli.disk_full(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
    assert cli.disk_full(ValueError("other")) is None
    monkeypatch.setattr("flows.request_queue.add_request", full_registry)
    code, _, err = run_grom(capsys, monkeypatch, "request", "add", "--forget", "f.jsonl", "--home",
                            str(tmp_path / "ws"))
    assert code == 2 and "the disk is full" in err and "Traceback" not in err


# -- the model kind's recipe -------------------------------------------------------------------------------------

def test_a_gradient_method_takes_its_model_kinds_recipe(tmp_path, tokenizer):
    from transformers import LlamaConfig

    from grom_core.finetune import TinyModelConfig, build_tiny_llama
    from grom_core.gradient.methods import FROM_SCRATCH, PRETRAINED, RECIPES, NPOParams, model_kind, with_recipe

    tiny = build_tiny_llama(tokenizer, TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1,
                                                       num_heads=2))
    tiny.save_pretrained(tmp_path / "tiny")
    from transformers import AutoConfig

    assert model_kind(AutoConfig.from_pretrained(tmp_path / "tiny")) == FROM_SCRATCH  # the flag is saved
    assert model_kind(LlamaConfig()) == PRETRAINED
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "training.json").write_text(json.dumps({"model": {"vocab_size": 400}}))
    assert model_kind(LlamaConfig(), str(tmp_path / "old")) == FROM_SCRATCH  # a tiny model saved before the flag
    pretrained = NPOParams.from_dict(with_recipe({"trainer": {"epochs": 2}}, PRETRAINED)).trainer
    assert pretrained.lr == RECIPES[PRETRAINED]["lr"] == 1e-5 and pretrained.epochs == 2
    assert NPOParams.from_dict(with_recipe({}, FROM_SCRATCH)).trainer.lr == NPOParams().trainer.lr
    assert NPOParams.from_dict(with_recipe({"trainer": {"lr": 3e-4}}, PRETRAINED)).trainer.lr == 3e-4


# -- deployments -------------------------------------------------------------------------------------------------

def test_no_flow_module_shadows_a_top_level_module():
    """Prefect's deploy loader puts flows/ on sys.path: a flows/queue.py there was the standard library's queue
    for torch, and a flows/requests.py would be the requests package for MLflow."""
    import pkgutil

    taken = set(sys.stdlib_module_names) | {m.name for m in pkgutil.iter_modules()
                                            if not Path(m.module_finder.path).resolve().is_relative_to(
                                                Path(__file__).resolve().parents[1])}
    flows = Path(__file__).resolve().parents[1] / "flows"
    clashes = sorted(p.stem for p in flows.glob("*.py") if p.stem != "__init__" and p.stem in taken)
    assert clashes == []
