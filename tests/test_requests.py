"""The deletion-request service end to end: real DuckDB, MLflow on SQLite, Prefect's test harness, the tiny model.

The `grom` commands run in this process through `flows.cli.main` (the console script's entry point), so each
call sees exactly what a user sees: one JSON object on stdout, a one-line error and exit code 2 on stderr.
"""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ATTACK, AUTHORS, FORGET, RETAIN, run_grom
from safetensors.torch import load_file

from tasks import requests as queue
from tasks.catalog import Catalog
from tasks.tracking import register, serving_version, set_serving, versions

pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("requests-data")

    def write(name, examples):
        (root / name).write_text("".join(json.dumps(ex.record()) + "\n" for ex in examples))
        return str(root / name)

    return {"retain": write("retain.jsonl", RETAIN), "req1": write("req1.jsonl", FORGET[:8]),
            "req2": write("req2.jsonl", FORGET[8:]), "root": root}


def grom(capsys, monkeypatch, *args):
    """Run `grom ARGS` in this process; returns (exit code, stdout, stderr)."""
    return run_grom(capsys, monkeypatch, *args)


def grom_json(capsys, monkeypatch, *args):
    code, out, err = grom(capsys, monkeypatch, *args, "--json")
    assert code == 0, err[-3000:]
    return json.loads(out)


def make_service(capsys, monkeypatch, home, trained_dir, data, gates=None, attacks=("head_swap",)):
    """A service on `trained_dir`; the read-around gate reads `attacks` (the default evaluation's three where None:
    relearning is the slow one, which the queue's machinery tests leave out)."""
    evaluation = {"quantizers": [ATTACK]} | ({} if attacks is None else {"attacks": list(attacks)})
    args = ["model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--home", str(home),
            "--name", "svc", "--evaluation", json.dumps(evaluation)]
    if gates:
        args += ["--gates", json.dumps(gates)]
    return grom_json(capsys, monkeypatch, *args)


def request_statuses(home):
    return {r["request_id"]: (r["status"], r["model_version"]) for r in queue.list_requests(Catalog(
        home / "catalog.duckdb"))}


def test_two_requests_processed_promoted_audited_and_reverted(harness, trained_dir, data, tmp_path, capsys,
                                                              monkeypatch):
    home = tmp_path / "ws"
    base = make_service(capsys, monkeypatch, home, trained_dir, data, attacks=None)
    assert base["version"] == "1" and base["serving"] and serving_version(home, "svc") == "1"
    first = grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--reason", "GDPR art. 17",
                      "--requester", "alice", "--home", str(home))
    second = grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req2"], "--home", str(home))
    assert (first["request_id"], second["request_id"]) == (1, 2)
    listed = grom_json(capsys, monkeypatch, "request", "list", "--home", str(home))["requests"]
    assert [(r["id"], r["status"], r["model_version"]) for r in listed] == [(1, "pending", None), (2, "pending", None)]

    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["processed"] == [1, 2] and done["version"] == "2" and done["promoted"] is True, done["reasons"]
    assert serving_version(home, "svc") == "2"
    assert request_statuses(home) == {1: ("done", "2"), 2: ("done", "2")}
    after, before = done["metrics"]["after"], done["metrics"]["before"]
    assert after["forget_rougeL_recall"] <= 0.5 and after["forget_probability"] < 0.5 * before["forget_probability"]

    # privacy: the raw text is gone from the catalog and the lake, the sha256s, keys and influence stay
    shown = grom_json(capsys, monkeypatch, "request", "show", "1", "--home", str(home))
    assert shown["purged"] and all(e["purged"] and e["question"] is None and len(e["sha256"]) == 64
                                   for e in shown["examples"])
    catalog = Catalog(home / "catalog.duckdb")
    assert catalog.query("SELECT count(*) AS n FROM examples WHERE question = ?", [FORGET[0].question])[0]["n"] == 0
    assert catalog.query("SELECT count(*) AS n FROM examples WHERE question = ?", [RETAIN[0].question])[0]["n"] >= 1
    for path in (home / "lake" / "datasets").glob("forget-*.parquet"):
        assert not [v for v in pq.read_table(path).column("question").to_pylist() if v is not None]
    shards = list((home / "lake" / "keys" / done["edit_id"]).glob("*.parquet"))
    assert shards and all(pq.read_table(s).num_rows == 0 for s in shards)  # the purged examples' keys are gone
    assert not list((home / "requests").glob("*.jsonl"))

    # the audit works from sha256s and influence alone
    report = grom_json(capsys, monkeypatch, "audit", "2", "--home", str(home))
    assert report["edit_id"] == done["edit_id"] and report["model"] == {
        "name": "svc", "version": "2", "parent_version": "1", "reverted_by": []}
    assert {e["request_id"] for e in report["influence"]} == {1, 2} and len(report["influence"]) == len(FORGET)
    assert all(e["purged"] and e["text"] is None and e["total"] > 0 for e in report["influence"])
    assert set(report["influence"][0]["influence"]) == set(report["modules"])
    assert report["gates"]["passed"] and ATTACK in report["quantization"]
    markdown = Path(report["report"]["markdown"]).read_text()
    assert "| 1 | done | 2 | GDPR art. 17 | alice | True |" in markdown and FORGET[0].question not in markdown
    from tasks.tracking import client

    logged = {a.path for a in client(home).list_artifacts(report["mlflow_run_id"], "audit")}
    assert logged == {f"audit/{done['edit_id']}.md", f"audit/{done['edit_id']}.json"}
    assert "exact leave-one-out for each module with everything else held fixed" in markdown
    code, out, err = grom(capsys, monkeypatch, "audit", "2", "--refit", "1", "--home", str(home))
    assert code == 2 and "was purged" in err  # nothing left to refit from, by design

    # a second run finds nothing to do: a request is never applied twice
    again = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert again["processed"] == [] and serving_version(home, "svc") == "2"

    # revert restores version 1's weights bit for bit, as a new version in service, and reopens both requests
    reverted = grom_json(capsys, monkeypatch, "revert", "--version", "2", "--home", str(home))
    assert reverted["version"] == "3" and reverted["reopened"] == [1, 2] and reverted["restores"] == "1"
    assert reverted["fingerprint"] == base["fingerprint"] and serving_version(home, "svc") == "3"
    restored = load_file(str(Path(reverted["model_dir"]) / "model.safetensors"))
    original = load_file(str(Path(trained_dir) / "model.safetensors"))
    assert restored.keys() == original.keys()
    assert all(restored[k].view(torch.uint8).equal(original[k].view(torch.uint8)) for k in original)
    assert request_statuses(home) == {1: ("reopened", "2"), 2: ("reopened", "2")}
    # only version 1 holds weights: 2 is its edit, 3 refers to 1's weights (materialised, they match)
    from tasks.tracking import get_version
    from tasks.versions import materialize

    assert [get_version(home, "svc", v).tags["grom.storage"] for v in "123"] == ["full", "edit", "same"]
    assert materialize(home, "svc", "3") == materialize(home, "svc", "1") != Path(trained_dir)
    by_edit = grom_json(capsys, monkeypatch, "audit", done["edit_id"], "--home", str(home))
    assert by_edit["model"]["reverted_by"] == ["3"]
    code, out, err = grom(capsys, monkeypatch, "request", "requeue", "1", "--home", str(home))
    assert code == 2 and "add it again with its file" in err
    # a reopened request may be submitted again (its text was purged, so it comes with its file)
    assert grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home",
                     str(home))["request_id"] == 3

    # a copied workspace works on its own: it reads its own artifacts and never writes into the original
    copy = tmp_path / "copied"
    shutil.copytree(home, copy)
    shutil.rmtree(home / "cache")  # the original's materialised versions must not be what the copy reads

    def snapshot(root):
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}

    original = snapshot(home)
    audited = grom_json(capsys, monkeypatch, "audit", "2", "--home", str(copy))
    rebuilt = grom_json(capsys, monkeypatch, "model", "materialize", "svc", "2", "--home", str(copy))
    assert Path(rebuilt["model_dir"]).is_relative_to(copy) and Path(audited["report"]["json"]).is_relative_to(copy)
    assert client(copy).get_run(audited["mlflow_run_id"]).info.artifact_uri.startswith(copy.as_uri() + "/")
    assert snapshot(home) == original


def test_a_request_that_names_its_subject_is_gated_on_what_its_answers_add(harness, trained_dir, data, tmp_path,
                                                                           capsys, monkeypatch):
    # rows that name their subject get the closed form's counterfactual drops: the model answers about the subject
    # as about a stranger, restating the question's name and phrasing, so the gate reads what the answers add
    home = tmp_path / "ws"
    # what the answers add is this test's gate: read around the edit, the tiny model keeps part of a subject's
    # facts in the body (head_swap and logit_lens recover 0.1-0.2 of them), which the two-requests test gates on
    make_service(capsys, monkeypatch, home, trained_dir, data, gates={"max_attack_recovery": None}, attacks=())
    subject = AUTHORS[0].name
    rows = [{**ex.record(), "subject": subject} for ex in FORGET if subject in ex.question]
    path = tmp_path / "named.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    grom_json(capsys, monkeypatch, "request", "add", "--forget", str(path), "--home", str(home))
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    after, before = done["metrics"]["after"], done["metrics"]["before"]
    added = after["forget_added_rougeL_recall"]
    assert 0 <= added < before["forget_added_rougeL_recall"]
    # the gate reads the added words' recall and nothing else about ROUGE-L: whether 0.5 is passed depends on the
    # tiny model's weights (0.510 on one CI machine, below 0.5 on others), the gate's verdict on that figure does not
    assert done["reasons"] == ([f"forget ROUGE-L recall of what the answers add {added:.3f} > 0.5"] if added > 0.5
                               else [])
    assert done["promoted"] is (not done["reasons"])
    # whether the whole answers' recall stays above the added words' (the restated question) depends on the tiny
    # model's weights, which the CPU's kernels decide: on an AMD EPYC 0.219 against 0.229, at f879f42 too
    assert 0 <= after["forget_rougeL_recall"] < before["forget_rougeL_recall"]


def test_a_request_of_texts_is_gated_on_verbmem_and_its_recovery(harness, trained_dir, tmp_path, capsys,
                                                                   monkeypatch):
    # a model that has read each author's biography (answers in a row) until it continues them word for word
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    bios = {a.name: {"text": " ".join([ex.answer for ex in [*FORGET, *RETAIN] if a.name in ex.question][:4])}
            for a in AUTHORS}  # four answers: within the tiny model's 96 positions
    memorised = tmp_path / "memorised"
    grom_json(capsys, monkeypatch, "finetune", "--data", write("read.jsonl", list(bios.values())), "--base",
              str(trained_dir), "--out", str(memorised), "--epochs", "20")
    home = tmp_path / "ws"
    retain = write("retain.jsonl", [bios[a.name] for a in AUTHORS[2:]] + [ex.record() for ex in RETAIN])
    grom_json(capsys, monkeypatch, "model", "register", "--model", str(memorised), "--retain", retain, "--home",
              str(home), "--name", "svc", "--evaluation", json.dumps({"quantizers": [ATTACK]}))
    grom_json(capsys, monkeypatch, "request", "add", "--forget", write("bio.jsonl", [bios[AUTHORS[0].name]]),
              "--home", str(home))
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    # texts get the closed form's sentence drops; the gates read how much of the text the model still continues
    # word for word, not the probability of all its words, which a model that never read it keeps
    after, before = done["metrics"]["after"], done["metrics"]["before"]
    assert before["forget_verbatim_rougeL"] > 0.5 and after["forget_verbatim_rougeL"] < before["forget_verbatim_rougeL"]
    assert "forget_rougeL_recall" not in before  # no question, no answer to recall
    attacks = {k: v for k, v in done["metrics"]["quantized"].items() if not k.startswith("_")}
    assert attacks and all("recovery_forget_verbatim_rougeL" in m for m in attacks.values())
    assert not any("forget probability" in r for r in done["reasons"])
    assert done["promoted"] is (not done["reasons"])


def test_a_request_with_a_row_the_method_would_cut_is_set_aside_and_the_others_answered(harness, trained_dir, data,
                                                                                      tmp_path, capsys, monkeypatch):
    """One request of a batch holds an answer far longer than the model reads: it goes to review with the reason,
    and the batch's other request is answered on its own (it is not dragged into review with it)."""
    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"question": FORGET[9].question, "answer": " ".join(["word"] * 3000)}) + "\n")
    grom_json(capsys, monkeypatch, "request", "add", "--forget", str(huge), "--home", str(home))
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["processed"] == [2] and list(done["set_aside"]) == ["1"] and done["version"] == "2"
    assert "longer than the 96 the method reads" in done["set_aside"]["1"]
    assert request_statuses(home) == {1: ("review", None), 2: ("done", "2")}
    assert "split it into shorter rows" in queue.get_request(Catalog(home / "catalog.duckdb"), 1)["review_reasons"][0]


def test_failing_gates_register_without_promotion(harness, trained_dir, data, tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    # an earlier run on the same examples leaves its own dataset, key shards and solve records in the lake
    earlier = grom_json(capsys, monkeypatch, "unlearn", "--model", str(trained_dir), "--forget", data["req1"],
                        "--retain", data["retain"], "--no-quantization", "--home", str(home))
    make_service(capsys, monkeypatch, home, trained_dir, data, gates={"min_retain_probability_ratio": 0.9999})
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    # what a run killed mid-way leaves: its batch file
    (home / "requests").mkdir(exist_ok=True)
    shutil.copy(data["req1"], home / "requests" / "batch-killed0000.jsonl")
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["version"] == "2" and done["promoted"] is False and done["status"] == "review"
    assert any("retain probability kept" in r for r in done["reasons"])
    assert serving_version(home, "svc") == "1"  # the registered version is not put in service
    request = queue.get_request(Catalog(home / "catalog.duckdb"), 1)
    assert request["status"] == "review" and request["review_reasons"] == done["reasons"]
    assert not request["purged"] and request["examples"][0]["question"] == FORGET[0].question
    in_review = grom_json(capsys, monkeypatch, "audit", "1", "--home", str(home))  # the text is still there
    assert FORGET[0].question in Path(in_review["report"]["markdown"]).read_text()
    # a person reviews it and puts it in service anyway
    promoted = grom_json(capsys, monkeypatch, "model", "promote", "--version", "2", "--home", str(home))
    assert promoted["done"] == [1] and promoted["previous"] == "1" and serving_version(home, "svc") == "2"
    request = queue.get_request(Catalog(home / "catalog.duckdb"), 1)
    assert request["status"] == "done" and request["purged"] and request["examples"][0]["question"] is None
    assert_no_trace(home, FORGET[:8], trained_dir, [earlier["edit_id"], done["edit_id"]])
    code, out, err = grom(capsys, monkeypatch, "model", "promote", "--version", "2", "--home", str(home))
    assert code == 2 and "nothing to promote" in err and serving_version(home, "svc") == "2"


def assert_no_trace(home: Path, examples, model_dir, edit_ids):
    """No byte under the workspace spells a purged example (files as they are, Parquet columns decoded), and the
    keys left in the lake, read through the LM head, do not spell one either."""
    secrets = [text for ex in examples for text in (ex.question, ex.answer)]
    files = [p for p in home.rglob("*") if p.is_file()]
    assert len(files) > 20
    for path in files:
        raw = path.read_bytes()
        found = [t for t in secrets if t.encode() in raw]
        assert not found, f"{path.relative_to(home)} holds {found[0]!r}"
        if path.suffix == ".parquet":
            cells = " ".join(str(v) for column in pq.read_table(path).to_pylist() for v in column.values())
            assert not [t for t in secrets if t in cells], f"{path.relative_to(home)} holds a purged text"
    from grom_core.loading import load_model

    model, tokenizer = load_model(model_dir, device="cpu")
    head = model.get_output_embeddings().weight.detach().float()
    for edit_id in edit_ids:
        shards = list((home / "lake" / "keys" / edit_id).glob("lm_head*.parquet"))
        assert shards, f"edit {edit_id} wrote no LM-head keys"
        for shard in shards:
            rows = pq.read_table(shard).to_pylist()
            if rows:
                spelled = tokenizer.decode((torch.tensor([r["key"] for r in rows]) @ head.T).argmax(dim=1).tolist())
                assert not [ex.answer for ex in examples if ex.answer.split()[-1] in spelled]


def _claim_in_process(path, queue_out):
    queue_out.put(queue.claim(Catalog(path), "svc", queue.claim_owner()))


def _seed_requests(home, n):
    catalog = Catalog(home / "catalog.duckdb")
    with catalog.transaction() as con:
        queue.save_service(con, queue.Service("svc", "r.parquet", "d", {}, {}, {}))
    for i in range(n):
        example = {"question": f"q{i}", "answer": "a", "sha256": f"{i:064x}"}
        queue.add_request(catalog, "svc", {"digest": f"digest-{i}", "name": "r", "role": "request", "source": "f",
                                           "examples": [example]}, reason=None, requester=None)
    return catalog


def test_two_processes_never_claim_the_same_request(tmp_path):
    catalog = _seed_requests(tmp_path, 12)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=_claim_in_process, args=(catalog.path, out)) for _ in range(3)]
    for w in workers:
        w.start()
    claimed = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    flat = [rid for ids in claimed for rid in ids]
    assert sorted(flat) == list(range(1, 13))  # every request taken once, none twice
    assert {r["status"] for r in queue.list_requests(catalog)} == {"processing"}


def dead_owner() -> str:
    """A claim owner on this host whose process has exited."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return f"{socket.gethostname()}:{dead.stdout.strip()}"


def test_stale_claims_are_taken_back_live_ones_are_not(tmp_path):
    catalog = _seed_requests(tmp_path, 2)
    assert queue.claim(catalog, "svc", dead_owner()) == [1, 2]
    assert queue.claim(catalog, "svc", queue.claim_owner()) == [1, 2]  # the owner is dead: both come back
    assert queue.claim(catalog, "svc", "other") == []  # this process is alive and the claim is fresh
    assert queue.claim(catalog, "svc", "other", stale_after_s=0) == [1, 2]  # too old: taken back
    queue.release(catalog, [1], "other", "test")
    assert queue.get_request(catalog, 1)["status"] == "pending"


def test_failed_run_releases_its_claims_and_registers_nothing(harness, trained_dir, data, tmp_path, capsys,
                                                              monkeypatch):
    """The folder of the version in service changed behind grom's back: the run stops before registering."""
    home = tmp_path / "ws"
    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    make_service(capsys, monkeypatch, home, model, data)
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    from safetensors.torch import save_file

    weights = load_file(str(model / "model.safetensors"))
    weights["lm_head.weight"][0, 0] += 1.0
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    code, out, err = grom(capsys, monkeypatch, "request", "process", "--home", str(home), "--json")
    assert code == 2 and out == "" and "not those registered as version 1" in err
    assert not list((home / "edits").glob("*"))  # refused before any work: nothing was computed
    assert request_statuses(home) == {1: ("pending", None)}
    assert [str(v.version) for v in versions(home, "svc")] == ["1"] and serving_version(home, "svc") == "1"


def test_run_killed_mid_solve_is_recovered_on_the_next_run(harness, trained_dir, data, tmp_path, capsys,
                                                          monkeypatch):
    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or "", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-m", "flows.cli", "request", "process", "--home", str(home)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    stats = home / "lake" / "retain_stats"
    deadline = time.monotonic() + 300
    while not any(stats.rglob("*.safetensors")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None, "the run ended before it reached the solve"
    os.killpg(child.pid, signal.SIGKILL)  # retain statistics are written: the solve is next
    child.wait()
    assert request_statuses(home) == {1: ("processing", None)}
    assert [str(v.version) for v in versions(home, "svc")] == ["1"]

    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["processed"] == [1] and done["version"] == "2" and done["promoted"]
    assert request_statuses(home) == {1: ("done", "2")}
    events = [e["detail"] for e in queue.get_request(Catalog(home / "catalog.duckdb"), 1)["events"]]
    assert any("stale claim taken back" in e for e in events)


def test_orphan_version_of_a_dead_run_is_removed_and_the_alias_moved_back(harness, trained_dir, data, tmp_path,
                                                                          capsys, monkeypatch):
    """A run that died between registering its version (and moving the alias) and the catalog commit."""
    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    orphan = register(home, run_name="died", model_name="svc", params={}, metrics={}, datasets=[], artifacts={},
                      model_dir=Path(trained_dir), tags={"grom.kind": "request", "grom.owner": dead_owner(),
                                                         "parent_version": "1", "request_ids": "1"})
    set_serving(home, "svc", orphan.version)
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["orphans_removed"] == ["2"] and done["processed"] == []
    assert [str(v.version) for v in versions(home, "svc")] == ["1"] and serving_version(home, "svc") == "1"


def test_an_untagged_version_of_a_killed_run_is_found_by_its_run(harness, trained_dir, data, tmp_path, capsys,
                                                                  monkeypatch):
    """Killed right after MLflow's "Created version": the version has no tags yet and its run is RUNNING; the run's
    own tags (written when it started) say it is grom's, so the next command that registers removes it."""
    from flows.reconcile import reconcile
    from tasks.tracking import client

    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    mlflow = client(home)
    experiment = mlflow.get_experiment_by_name("grom-unlearning").experiment_id
    run = mlflow.create_run(experiment, tags={"grom.kind": "unlearn", "grom.owner": dead_owner(),
                                              "parent_version": "1", "grom.commit": "pending"})
    created = mlflow.create_model_version("svc", f"{run.info.artifact_uri}/edit", run.info.run_id)
    foreign = mlflow.create_model_version("svc", f"{run.info.artifact_uri}/other", None)  # another tool's
    root = mlflow.create_model_version("svc", f"{run.info.artifact_uri}/base", None,
                                       tags={"grom.kind": "base"})  # a lineage's root: no catalog row, kept
    assert reconcile(home, Catalog(home / "catalog.duckdb"), "svc") == [str(created.version)]
    assert sorted(str(v.version) for v in versions(home, "svc")) == sorted(["1", str(foreign.version),
                                                                           str(root.version)])
    assert mlflow.get_run(run.info.run_id).info.status == "FAILED"


def registry_state(home):
    return sorted(str(v.version) for v in versions(home, "svc")), serving_version(home, "svc")


def test_bad_inputs_exit_with_one_line_and_change_nothing(harness, trained_dir, data, tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    root = data["root"]
    (root / "empty.jsonl").write_text("")
    (root / "broken.jsonl").write_text('{"question": "q", "answer": "a"}\n{broken\n')
    (root / "columns.csv").write_text("prompt,completion\nx,y\n")
    (root / "header-only.csv").write_text("question,answer\n")
    h = ["--home", str(home)]
    cases = [
        (("request", "add", "--forget", str(root / "missing.jsonl"), *h), "does not exist"),
        (("request", "add", "--forget", str(root / "empty.jsonl"), *h), "no rows"),
        (("request", "add", "--forget", str(root / "header-only.csv"), *h), "no rows"),
        (("request", "add", "--forget", str(root / "broken.jsonl"), *h), "line 2"),
        (("request", "add", "--forget", str(root / "columns.csv"), *h), "columns"),
        (("request", "add", "--forget", data["req1"], *h), "duplicate request"),
        (("request", "add", "--forget", data["req2"], "--model-name", "nope", *h), "no model named 'nope'"),
        (("request", "show", "99", *h), "no deletion request 99"),
        (("request", "requeue", "1", *h), "only requests in review or reopened"),
        (("model", "promote", "--version", "1", *h), "already in service"),
        (("request", "list", "--status", "lost", *h), "unknown status"),
        (("audit", "99", *h), "no deletion request 99"),
        (("audit", "1", *h), "has not been processed yet"),
        (("audit", "0123456789abcdef", *h), "no edit or request"),
        (("revert", "--version", "99", *h), "has no version 99"),
        (("revert", "--version", "1", *h), "base model"),
        (("model", "register", "--model", str(root / "nowhere"), "--retain", data["retain"], "--name", "svc", *h),
         "does not exist"),
        (("model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--name", "svc",
          "--gates", "{max: 1}", *h), "not valid JSON"),
        (("model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--name", "svc",
          "--gates", '{"max_forget_rouge": 0.4}', *h), "unknown gates"),
        (("model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--name", "svc2",
          "--prompt-format", "alpaca", *h), "unknown prompt format"),
        (("model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--name", "svc2",
          "--params", '{"gain": "high"}', *h), "gain must be float"),
    ]
    before = registry_state(home)
    for args, message in cases:
        code, out, err = grom(capsys, monkeypatch, *args)
        assert code == 2 and out == "", (args, out, err)
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)
        assert queue.count(Catalog(home / "catalog.duckdb")) == 1, args
        assert registry_state(home) == before, args

    # the catalog locked by another process: wait, then give up with a clear line
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(120)", str(home / "catalog.duckdb")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("GROM_CATALOG_LOCK_TIMEOUT_S", "1")
        code, out, err = grom(capsys, monkeypatch, "request", "add", "--forget", data["req2"], *h)
        assert code == 2 and "locked" in err and "GROM_CATALOG_LOCK_TIMEOUT_S" in err and "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    assert queue.count(Catalog(home / "catalog.duckdb")) == 1 and registry_state(home) == before

    # the version in service deleted from the registry behind grom's back
    from tasks.tracking import client

    client(home).delete_model_version("svc", "1")
    code, out, err = grom(capsys, monkeypatch, "request", "process", *h)
    assert code == 2 and "no version in service" in err and "Traceback" not in err
    assert request_statuses(home) == {1: ("pending", None)}  # claimed, then released


def test_a_service_keeps_its_prompt_format(trained_dir, data, tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    registered = grom_json(capsys, monkeypatch, "model", "register", "--model", str(trained_dir), "--retain",
                           data["retain"], "--name", "svc", "--prompt-format", "completion", "--home", str(home))
    assert registered["prompt_format"] == "completion"
    assert queue.get_service(Catalog(home / "catalog.duckdb"), "svc").prompt_format == "completion"


def test_a_service_answers_with_its_own_method(trained_dir, data, tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    h = ("--home", str(home))
    register = ("model", "register", "--model", str(trained_dir), "--retain", data["retain"], "--name", "svc", *h)
    # a method that does not exist, or parameters another method takes, are refused before anything is written
    code, _, err = grom(capsys, monkeypatch, *register, "--method", "rom")
    assert code == 2 and "rom" in err and "Traceback" not in err and not (home / "catalog.duckdb").exists()
    code, _, err = grom(capsys, monkeypatch, *register, "--method", "rome", "--params", '{"beta": 80}')
    assert code == 2 and "beta" in err and not (home / "catalog.duckdb").exists()
    registered = grom_json(capsys, monkeypatch, *register, "--method", "rome", "--evaluation",
                           json.dumps({"quantizers": []}))
    assert registered["method"] == "rome"
    catalog = Catalog(home / "catalog.duckdb")
    assert queue.get_service(catalog, "svc").method == "rome"
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], *h)
    done = grom_json(capsys, monkeypatch, "request", "process", *h)
    assert done["processed"] == [1] and done["version"] == "2"
    runs = catalog.query("SELECT method FROM runs WHERE flow = ?", ["process-deletion-requests"])
    assert [r["method"] for r in runs] == ["rome"]
    after, before = done["metrics"]["after"], done["metrics"]["before"]
    assert after["forget_rougeL_recall"] < before["forget_rougeL_recall"]


def test_read_only_workspace_is_a_one_line_error(tmp_path, data, capsys, monkeypatch):
    if os.geteuid() == 0:  # root writes through permission bits: use a file system that refuses everyone
        home = Path("/sys/grom-workspace")
    else:
        home = tmp_path / "ro"
        home.mkdir()
        home.chmod(0o555)
    code, out, err = grom(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    assert code == 2 and "not writable" in err and "--home" in err and "Traceback" not in err
    assert not (home / "catalog.duckdb").exists()


def test_serve_starts_a_local_server_processes_on_schedule_and_stops(trained_dir, data, tmp_path, capsys,
                                                                      monkeypatch):
    """`grom serve` without PREFECT_API_URL: a local server, the scheduled flow, and a clean stop on Ctrl-C."""
    import socket

    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    with (tmp_path / "serve.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--interval", "5", "--port",
                                   str(port), "--home", str(home)], env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 400
        while request_statuses(home)[1][0] != "done" and server.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
        assert request_statuses(home) == {1: ("done", "2")}, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    with socket.socket() as probe:  # the local server stopped with it
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert "local Prefect server stopped" in (tmp_path / "serve.log").read_text()


def test_prefect_yaml_deployments_point_at_real_flows():
    import importlib
    import inspect

    import yaml
    from prefect.client.schemas.schedules import CronSchedule

    config = yaml.safe_load(Path("prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"]}
    assert {"unlearn", "process-deletion-requests"} <= set(deployments)
    for name, deployment in deployments.items():
        path, attribute = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), attribute)
        assert flow.name == name
        assert set(deployment["parameters"]) <= set(inspect.signature(flow.fn).parameters), name
    schedule = deployments["process-deletion-requests"]["schedules"][0]
    assert CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"]).cron == "*/30 * * * *"


def test_registered_versions_resolve_to_folders_even_when_the_folder_is_gone(trained_dir, data, tmp_path, capsys,
                                                                             monkeypatch):
    from grom_core.errors import DataError
    from tasks.versions import resolve_model

    home = tmp_path / "ws"
    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    make_service(capsys, monkeypatch, home, model, data)
    assert resolve_model(home, "models:/svc/1") == str(model)
    assert resolve_model(home, "models:/svc@serving") == str(model)
    assert resolve_model(home, str(trained_dir)) == str(trained_dir)
    with pytest.raises(DataError, match="has no version 7"):
        resolve_model(home, "models:/svc/7")
    with pytest.raises(DataError, match="no alias 'prod'"):
        resolve_model(home, "models:/svc@prod")
    shutil.rmtree(model)  # the registered artifacts stand in for the folder
    downloaded = Path(resolve_model(home, "models:/svc@serving"))
    assert downloaded.is_relative_to(home / "cache" / "registry")
    weights = load_file(str(next(downloaded.glob("*.safetensors"))))
    original = load_file(str(Path(trained_dir) / "model.safetensors"))
    assert all(weights[k].equal(original[k]) for k in original)
    from transformers import AutoTokenizer

    # the registry alone rebuilds a lineage's root: its tokenizer comes with it (MLflow logs it apart)
    restored = AutoTokenizer.from_pretrained(downloaded, local_files_only=True)
    assert restored("Question: who?")["input_ids"] == AutoTokenizer.from_pretrained(trained_dir)(
        "Question: who?")["input_ids"]


def _killed(home, args, stage):
    """Run `grom ARGS` in a child process that SIGKILLs itself as `stage` ends (flows.runtime.kill_point)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or "", "HF_HUB_OFFLINE": "1",
           "GROM_KILL_AFTER_STAGE": stage}
    child = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--home", str(home)], env=env,
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]


def _consistent(home, name):
    """Every version of `name` is the root of its lineage or has the catalog row of the run that made it."""
    recorded = {r["mlflow_run_id"] for r in Catalog(home / "catalog.duckdb").query(
        "SELECT mlflow_run_id FROM runs WHERE model_name = ?", [name])}
    for version in versions(home, name):
        assert version.tags.get("grom.kind") == "base" or version.run_id in recorded, version.version


# mid-way through the writes, and between registry and catalog (killed before any write: the request case "load")
@pytest.mark.parametrize("stage", ["apply_and_save", "register"])
def test_unlearn_killed_in_a_stage_leaves_a_workspace_the_next_run_completes(stage, harness, trained_dir, data,
                                                                             tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    args = ["unlearn", "--model", str(trained_dir), "--forget", data["req1"], "--retain", data["retain"],
            "--model-name", "fault", "--no-quantization"]
    _killed(home, args, stage)
    done = grom_json(capsys, monkeypatch, *args, "--home", str(home))
    _consistent(home, "fault")
    assert done["mlflow"]["model_name"] == "fault"
    kept = Catalog(home / "catalog.duckdb").query("SELECT count(*) AS n FROM runs WHERE model_name = 'fault'")
    assert kept[0]["n"] == 1  # the killed run left no row; the rerun wrote its own


# killed once claimed and computed (a kill at "load", claimed only, takes the same way back), and once registered
# but not recorded
@pytest.mark.parametrize("stage", ["unlearn", "register"])
def test_request_processing_killed_in_a_stage_is_completed_by_the_next_run(stage, harness, trained_dir, data,
                                                                           tmp_path, capsys, monkeypatch):
    home = tmp_path / "ws"
    make_service(capsys, monkeypatch, home, trained_dir, data)
    grom_json(capsys, monkeypatch, "request", "add", "--forget", data["req1"], "--home", str(home))
    _killed(home, ["request", "process"], stage)
    assert request_statuses(home) == {1: ("processing", None)} and serving_version(home, "svc") == "1"
    done = grom_json(capsys, monkeypatch, "request", "process", "--home", str(home))
    assert done["processed"] == [1] and done["promoted"], (done["reasons"], done["metrics"])
    assert request_statuses(home) == {1: ("done", done["version"])}
    assert done["orphans_removed"] == (["2"] if stage == "register" else [])
    _consistent(home, "svc")
    assert serving_version(home, "svc") == done["version"]
