"""End to end: the unlearn flow under the Prefect test harness, with real DuckDB, Parquet and MLflow on SQLite."""

import json
import shutil
from pathlib import Path

import duckdb
import pytest
import torch
from conftest import FORGET, RETAIN

from flows.demo import run_unlearn
from grom_core.errors import DataError, NonFiniteError, UnsupportedArchitectureError
from grom_core.loading import load_model
from tasks.catalog import Catalog

pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(ex.record()) + "\n" for ex in examples))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {"forget": write_jsonl(root / "forget.jsonl", FORGET), "retain": write_jsonl(root / "retain.jsonl", RETAIN),
            "retain_less": write_jsonl(root / "retain_less.jsonl", RETAIN[:-1]),
            "retain_with_forget": write_jsonl(root / "retain_dup.jsonl", RETAIN + FORGET[:3]),
            "empty": str((root / "empty.jsonl").write_text("") or root / "empty.jsonl"),
            "root": root}


def unlearn(harness, trained_dir, files, home, retain="retain", **kw):
    from flows.unlearn import unlearn as flow

    return flow(model=str(trained_dir), forget=files["forget"], retain=files[retain], home=str(home), **kw)


def registered_versions(home, name):
    from tasks.tracking import versions

    return [v.version for v in versions(home, name)]


@pytest.fixture(scope="module")
def first_run(harness, trained_dir, files, tmp_path_factory):
    home = tmp_path_factory.mktemp("ws")
    return home, unlearn(harness, trained_dir, files, home)


def test_flow_leaves_catalog_rows_parquet_shards_and_a_registered_model(first_run):
    home, result = first_run
    assert result["method"] == "grom" and result["cached_stats"] is False
    assert set(result["metrics"]["before"]) >= {"forget_probability", "retain_probability", "forget_rougeL_recall"}
    assert result["metrics"]["after"]["forget_probability"] < result["metrics"]["before"]["forget_probability"] / 5
    assert set(result["timings_s"]) >= {"ingest", "unlearn", "plan", "retain_statistics", "solve", "scale", "register",
                                        "total"}
    assert set(result["unlearning"]["stages_s"]) >= {"plan", "retain_statistics", "solve", "scale"}
    catalog = Catalog(home / "catalog.duckdb")
    assert catalog.query("SELECT count(*) AS n FROM datasets")[0]["n"] == 2
    examples = catalog.query("SELECT count(*) AS n, count(DISTINCT sha256) AS d FROM examples")[0]
    assert examples["n"] == len(FORGET) + len(RETAIN) and examples["d"] == examples["n"]
    modules = result["modules"]
    influence = catalog.query("SELECT module, count(*) AS n, count(DISTINCT example_index) AS e FROM influence "
                              "GROUP BY module ORDER BY module")
    assert sorted(r["module"] for r in influence) == sorted(modules)
    assert all(r["n"] == r["e"] == len(FORGET) for r in influence)  # one row per forget example and module
    run = catalog.query("SELECT * FROM runs")[0]
    assert run["edit_id"] == result["edit_id"] and run["model_version"] == result["mlflow"]["version"]
    shards = catalog.query("SELECT path, n_rows, dim, module FROM key_shards")
    assert len(shards) == len(modules)
    for shard in shards:  # readable with plain DuckDB SQL, key vectors castable to fixed-size arrays
        got = duckdb.sql(f"SELECT count(*), min(len(key)), max((key::FLOAT[{shard['dim']}])[1]) IS NOT NULL "
                         f"FROM read_parquet('{shard['path']}')").fetchall()[0]
        assert got[0] == shard["n_rows"] and got[1] == shard["dim"] and got[2]
    assert catalog.query("SELECT count(*) AS n FROM layer_scores")[0]["n"] == 4  # every layer scored


def test_registered_artifacts_load_back(first_run):
    import mlflow
    from transformers import AutoModelForCausalLM

    from tasks.tracking import configure

    home, result = first_run
    configure(home)
    name, version = result["mlflow"]["model_name"], result["mlflow"]["version"]
    client = mlflow.tracking.MlflowClient()
    tags = client.get_model_version(name, version).tags
    assert tags["edit_id"] == result["edit_id"] and len(tags["base_fingerprint"]) == 64
    run = client.get_run(result["mlflow"]["run_id"])
    assert {i.dataset.name.split(":")[0] for i in run.inputs.dataset_inputs} == {"forget", "retain"}
    assert run.data.metrics["after.forget_probability"] < run.data.metrics["before.forget_probability"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"edit", "influence", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/layer_scores.png", "plots/influence.png", "plots/report.md"} <= plots
    model = AutoModelForCausalLM.from_pretrained(result["model_dir"])
    assert model.config.model_type == "llama"
    edit_dir = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="edit")
    from grom_core.edit import Edit

    assert Edit.load(edit_dir).edit_id == result["edit_id"]
    # the edited version stores its edit over the version of the unedited weights, which holds the full model
    assert tags["grom.storage"] == "edit" and tags["parent_version"] != version
    parent = client.get_model_version(name, tags["parent_version"]).tags
    assert parent["grom.storage"] == "full" and parent["fingerprint"] == tags["base_fingerprint"]
    pipe = mlflow.transformers.load_model(f"models:/{name}/{tags['parent_version']}")
    out = pipe("Question: Where was the author born?\nAnswer:", max_new_tokens=5, do_sample=False)
    assert isinstance(out[0]["generated_text"], str)


def test_an_edited_version_materialises_bit_for_bit_from_its_parent_and_edit(first_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from flows.service import materialize_version
    from tasks.versions import cache_dir, drop_materialized

    home, result = first_run
    name, version = result["mlflow"]["model_name"], result["mlflow"]["version"]
    saved = load_file(str(Path(result["model_dir"]) / "model.safetensors"))
    # the flow's own folder and the workspace's copy of the edit gone: the registry alone rebuilds the weights
    moved = tmp_path / "moved"
    shutil.move(result["model_dir"], moved / "model")
    shutil.move(home / "edits" / result["edit_id"], moved / "edit")
    drop_materialized(home, name, version)
    try:
        done = materialize_version(name, version, home=str(home), out=str(tmp_path / "copy"))
        assert done["storage"] == "edit" and done["fingerprint"] == result["edited_fingerprint"]
        assert (cache_dir(home, name, version) / "model.safetensors").is_file()
        rebuilt = load_file(str(tmp_path / "copy" / "model.safetensors"))
        assert rebuilt.keys() == saved.keys()
        assert all(rebuilt[k].view(torch.uint8).equal(saved[k].view(torch.uint8)) for k in saved)
        with pytest.raises(DataError, match="not empty"):
            materialize_version(name, version, home=str(home), out=str(tmp_path / "copy"))
        with pytest.raises(DataError, match="has no version 99"):
            materialize_version(name, "99", home=str(home))
        # tampered lineage: weights that do not match the tag are never cached; a loop is named
        from grom_core.errors import FingerprintMismatchError
        from tasks.tracking import client

        registry = client(home)
        tags = registry.get_model_version(name, version).tags
        drop_materialized(home, name, version)
        registry.set_model_version_tag(name, version, "fingerprint", "0" * 64)
        with pytest.raises(FingerprintMismatchError, match="not those registered"):
            materialize_version(name, version, home=str(home))
        assert not cache_dir(home, name, version).exists()
        registry.set_model_version_tag(name, version, "fingerprint", tags["fingerprint"])
        registry.set_model_version_tag(name, version, "parent_version", version)
        with pytest.raises(DataError, match="loop"):
            materialize_version(name, version, home=str(home))
        registry.set_model_version_tag(name, version, "parent_version", tags["parent_version"])
    finally:
        shutil.move(moved / "model", result["model_dir"])
        shutil.move(moved / "edit", home / "edits" / result["edit_id"])


def test_audit_refit_checks_the_influence_against_a_real_refit(first_run):
    from flows.audit import audit

    home, result = first_run
    report = audit(result["edit_id"], str(home), log_to_mlflow=False, refit=2)
    top = [e["example_index"] for e in report["influence"][:2]]  # the most influential, text still there
    assert sorted({r["example_index"] for r in report["refit"]}) == sorted(top)
    for row in report["refit"]:
        assert row["module"] in result["modules"] and row["predicted"] > 0
        # the real change moves keys, targets and c as well, so it differs from the prediction, but only by
        # the order of magnitude the audit promises
        assert 0.05 * row["predicted"] < row["actual"] < 20 * row["predicted"]
    assert "## Refit check" in Path(report["report"]["markdown"]).read_text()


def test_second_run_reuses_the_statistics_and_changes_invalidate_them(first_run, harness, trained_dir, files):
    home, first = first_run
    second = unlearn(harness, trained_dir, files, home)
    assert second["cached_stats"] is True and second["edit_id"] == first["edit_id"]
    other_data = unlearn(harness, trained_dir, files, home, retain="retain_less")
    assert other_data["cached_stats"] is False
    other_model = home / "other-model"
    shutil.copytree(trained_dir, other_model)

    model, tokenizer = load_model(other_model, device="cpu")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
    model.save_pretrained(other_model)
    assert unlearn(harness, trained_dir.__class__(other_model), files, home)["cached_stats"] is False
    versions = registered_versions(home, first["mlflow"]["model_name"])
    assert len(versions) == 4  # trained_dir's weights once, three edits of them; the other model has its own name


def test_forget_examples_in_retain_are_dropped_with_a_warning(harness, trained_dir, files, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        result = unlearn(harness, trained_dir, files, tmp_path, retain="retain_with_forget")
    assert "3 retain examples are also forget examples" in caplog.text
    rows = Catalog(tmp_path / "catalog.duckdb").query("SELECT n_examples FROM datasets WHERE role = 'retain'")
    assert rows == [{"n_examples": len(RETAIN)}] and result["edit_id"]


def test_two_dask_workers_equal_one_process(trained_dir):
    from grom_core.data import make_batches
    from grom_core.fingerprint import weights_fingerprint
    from grom_core.statistics import accumulate
    from tasks.distributed import sharded_statistics

    model, tokenizer = load_model(trained_dir, device="cpu")
    fp = weights_fingerprint(model)
    modules = ["model.layers.2.mlp.down_proj", "lm_head"]
    rows = [ex.record() for ex in RETAIN]
    single = accumulate(model, make_batches(tokenizer, RETAIN, 16), modules, fingerprint=fp, data_digest="d")
    import tempfile
    from pathlib import Path

    sharded = sharded_statistics(str(trained_dir), rows, modules, fingerprint=fp, data_digest="d",
                                 out_dir=Path(tempfile.mkdtemp()), workers=2)
    for name in modules:
        assert sharded[name].count == single[name].count
        # the keys are float32 forward passes over other batches (other padding, other kernels): float32's precision
        gram = single[name].gram
        torch.testing.assert_close(sharded[name].gram, gram, rtol=1e-5, atol=1e-5 * float(gram.abs().max()))


def test_two_dask_workers_equal_one_process_at_a_1b_gram(tokenizer, tmp_path):
    """Llama-3.2-1B's down-projection Gram (8192 x 8192, float64: 512 MB a shard), sharded over two worker
    processes and merged, equals the one-process sums."""
    from conftest import random_llama

    from grom_core.data import make_batches
    from grom_core.fingerprint import weights_fingerprint
    from grom_core.statistics import accumulate
    from tasks.distributed import sharded_statistics

    random_llama(tokenizer, hidden_size=64, intermediate_size=8192, num_hidden_layers=1).save_pretrained(
        tmp_path / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "model")
    model, tokenizer = load_model(tmp_path / "model", device="cpu")
    fp, modules = weights_fingerprint(model), ["model.layers.0.mlp.down_proj"]
    single = accumulate(model, make_batches(tokenizer, RETAIN, 16), modules, fingerprint=fp, data_digest="d")
    sharded = sharded_statistics(str(tmp_path / "model"), [ex.record() for ex in RETAIN], modules, fingerprint=fp,
                                 data_digest="d", out_dir=tmp_path / "shards", workers=2)
    got, want = sharded[modules[0]], single[modules[0]]
    assert got.gram.shape == (8192, 8192) and got.count == want.count > 0
    torch.testing.assert_close(got.gram, want.gram, rtol=1e-5, atol=1e-5 * float(want.gram.abs().max()))
    torch.testing.assert_close(got.key_sum, want.key_sum, rtol=1e-5, atol=1e-5 * float(want.key_sum.abs().max()))


def assert_nothing_changed(home):
    path = home / "catalog.duckdb"
    if path.exists():
        assert Catalog(path).query("SELECT count(*) AS n FROM runs")[0]["n"] == 0
        assert Catalog(path).query("SELECT count(*) AS n FROM edits")[0]["n"] == 0
    assert registered_versions(home, "grom-unknown") == []


def test_bad_inputs_give_one_error_and_change_nothing(harness, trained_dir, files, tmp_path):
    home = tmp_path / "ws"
    model = str(trained_dir)
    cases = [
        (DataError, "does not exist", dict(model=model, forget=str(tmp_path / "missing.jsonl"),
                                           retain=files["retain"])),
        (DataError, "no rows", dict(model=model, forget=files["empty"], retain=files["retain"])),
        (DataError, "no .safetensors", dict(model=str(files["root"]), forget=files["forget"], retain=files["retain"])),
        (DataError, "layers \\[9\\]", dict(model=model, forget=files["forget"], retain=files["retain"],
                                          params={"layers": [9]})),
    ]
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"question": "q", "answer": "a"}\n{broken\n')
    cases.append((DataError, "line 2", dict(model=model, forget=str(bad_json), retain=files["retain"])))
    wrong_cols = tmp_path / "cols.csv"
    wrong_cols.write_text("prompt,completion\nx,y\n")
    cases.append((DataError, "columns", dict(model=model, forget=str(wrong_cols), retain=files["retain"])))
    mystery = tmp_path / "mystery"
    shutil.copytree(trained_dir, mystery)
    config = json.loads((mystery / "config.json").read_text())
    (mystery / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    cases.append((UnsupportedArchitectureError, "from_names", dict(model=str(mystery), forget=files["forget"],
                                                                   retain=files["retain"])))
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            run_unlearn(home=str(home), model_name="grom-unknown", **kwargs)
    assert_nothing_changed(home)


def test_non_finite_keys_fail_the_flow_and_change_nothing(harness, trained_dir, files, tmp_path):

    broken = tmp_path / "nan-model"
    model, tokenizer = load_model(trained_dir, device="cpu")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, :] = float("nan")
    model.save_pretrained(broken)
    tokenizer.save_pretrained(broken)
    with pytest.raises(NonFiniteError, match="non-finite"):
        unlearn(harness, broken, files, tmp_path / "ws", model_name="grom-unknown")
    assert_nothing_changed(tmp_path / "ws")


def test_gradient_method_runs_through_the_same_flow(harness, trained_dir, files, tmp_path, monkeypatch):
    from tasks import steps

    loads = []
    monkeypatch.setattr(steps, "load_model", lambda path, **kw: loads.append(path) or load_model(path, **kw))
    result = unlearn(harness, trained_dir, files, tmp_path, method="npo",
                     params={"compose": "sago", "trainer": {"epochs": 2, "batch_size": 4, "grad_accum": 2, "lr": 2e-3}})
    assert result["method"] == "npo" and result["compose"] == "sago" and result["cached_stats"] is None
    assert result["unlearning"]["steps"] == 2 * 2 and result["unlearning"]["peak_rss_mb"] > 0
    assert loads == [str(trained_dir)]  # one load for the whole run: method, evaluations, quantization attack
    assert result["metrics"]["after"]["forget_probability"] < result["metrics"]["before"]["forget_probability"]
    rows = Catalog(tmp_path / "catalog.duckdb").query("SELECT method, compose FROM runs")
    assert rows == [{"method": "npo", "compose": "sago"}]
    assert Catalog(tmp_path / "catalog.duckdb").query("SELECT method FROM edits") == [{"method": "npo"}]
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(result["mlflow"]["run_id"])
    assert run.data.metrics["unlearning.steps"] == 4 and run.data.params["method"] == "npo"
