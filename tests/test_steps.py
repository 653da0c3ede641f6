"""The storage glue of the tasks, without Prefect: the evaluation cache, model loading, registry look-ups, the
statistics cache in the lake."""

import json
from pathlib import Path

import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.adapter import ModelAdapter
from grom_core.grom import GromParams, run_grom
from tasks import steps
from tasks.lake import LakeStatsStore
from tasks.records import EvaluationSpec


def test_a_truncated_evaluation_cache_entry_is_evaluated_again(trained_dir, tmp_path):
    from grom_core.benchmarks.registry import read_split  # noqa: F401  (the spec below needs no benchmark)

    forget, retain = tmp_path / "f.parquet", tmp_path / "r.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([ex.record() for ex in FORGET[:4]]), forget)
    pq.write_table(pa.Table.from_pylist([ex.record() for ex in RETAIN[:4]]), retain)
    spec = EvaluationSpec(forget=str(forget), retain=str(retain), max_examples=4)
    cache = tmp_path / "cache"
    loaded = steps.load.fn(str(trained_dir))
    first = steps.evaluate.fn(loaded, spec, str(cache))
    [entry] = list(cache.glob("*.json"))
    assert json.loads(entry.read_text())["metrics"] == pytest.approx(dict(first.metrics))
    assert not list(cache.glob("*.tmp"))  # written under a temporary name, then renamed
    entry.write_text(entry.read_text()[: len(entry.read_text()) // 2])  # a crash mid-write, before the fix
    again = steps.evaluate.fn(loaded, spec, str(cache))
    assert again.metrics == pytest.approx(dict(first.metrics))
    assert json.loads(entry.read_text())["metrics"] == pytest.approx(dict(first.metrics))


def test_loading_for_an_edit_only_tolerates_unknown_architectures(trained_dir, monkeypatch):
    model, _ = steps.load_for_edit(str(trained_dir))
    assert model.config.model_type == "llama"

    def broken(model):
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(ModelAdapter, "for_model", staticmethod(broken))
    with pytest.raises(RuntimeError, match="adapter bug"):  # a bug is not an unknown architecture
        steps.load_for_edit(str(trained_dir))


def test_lake_statistics_cache_is_keyed_by_weights_data_and_max_length(trained, tmp_path):
    model, tokenizer = trained
    store = LakeStatsStore(tmp_path)
    params = GromParams(layers=(2,), influence=False)
    first = run_grom(model, tokenizer, FORGET, RETAIN, params, stats_store=store)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.safetensors"))
    assert len(files) == 2 and first.reused_stats == []
    second = run_grom(model, tokenizer, FORGET, RETAIN, params, stats_store=store)
    assert sorted(second.reused_stats) == sorted(first.edit.modules)
    assert run_grom(model, tokenizer, FORGET, RETAIN, params.replace(max_length=64),
                    stats_store=store).reused_stats == []
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0  # other weights: other statistics
    assert run_grom(model, tokenizer, FORGET, RETAIN, params, stats_store=store).reused_stats == []
    assert len(list(tmp_path.rglob("*.safetensors"))) == 6


def test_versions_of_a_name_with_a_quote_are_found(tmp_path):
    from tasks.tracking import client, versions

    mlflow_client = client(tmp_path)
    for name in ("o'brien", "plain"):
        mlflow_client.create_registered_model(name)
        mlflow_client.create_model_version(name, source=str(tmp_path))
    mlflow_client.create_model_version("o'brien", source=str(tmp_path))
    assert [str(v.version) for v in sorted(versions(tmp_path, "o'brien"), key=lambda v: int(v.version))] == ["1", "2"]
    assert len(versions(tmp_path, "plain")) == 1 and versions(tmp_path, "nobody") == []


def test_model_names_grom_creates_are_checked():
    from grom_core.errors import DataError
    from tasks.tracking import check_model_name

    assert check_model_name("grom-minitofu-forget10") == "grom-minitofu-forget10"
    for bad in ("../../x", "a/b", "it's", "", ".hidden", "x" * 101):
        with pytest.raises(DataError, match="not allowed"):
            check_model_name(bad)


def test_ingested_rows_keep_their_subjects_and_a_purge_nulls_them(tmp_path):
    from tasks.purge import _purge_dataset
    from tasks.records import example_sha256

    forget = tmp_path / "forget.jsonl"
    rows = [{"question": "Where was Ann Lee born?", "answer": "Ann Lee was born in Oslo.", "subject": "Ann Lee"},
            {"text": "Some prose."}]
    forget.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = steps.dataset_record("forget", rows, str(forget), tmp_path / "lake")
    assert dataset.rows() == rows  # the subject reaches the method through the lake (counterfactual drops need it)
    _purge_dataset(Path(dataset.path), {example_sha256(rows[0])})
    import pyarrow.parquet as pq

    purged = pq.read_table(dataset.path).to_pylist()[0]
    assert purged["subject"] is None and purged["question"] is None and purged["sha256"]
