"""Benchmark generators, data files, and build/evaluate on small configurations."""

import json

import numpy as np
import pytest

from grom_core.benchmarks import minimuse, minitofu, miniwmdp
from grom_core.benchmarks.authors import FACTS
from grom_core.benchmarks.registry import build, get_benchmark
from grom_core.errors import DataError
from grom_core.finetune import TinyModelConfig, TrainConfig
from grom_core.loading import load_model
from grom_core.metrics import muse as muse_metrics
from tasks.datafiles import read_benchmark_file, read_examples, read_rows, tofu_splits_from_dir
from tasks.lake import rows_table

SMALL_MODEL = TinyModelConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              max_length=128)


def test_minitofu_splits_follow_tofu():
    splits = minitofu.generate(minitofu.MiniTofuConfig(authors=20))
    assert len(splits["full"]) == 20 * len(FACTS) == 400
    sizes = {k: len(splits[k]) // len(FACTS) for k in ("forget01", "forget05", "forget10")}
    assert sizes == {"forget01": 1, "forget05": 1, "forget10": 2}
    for forget, retain in minitofu.RETAIN_OF.items():
        assert len(splits[forget]) + len(splits[retain]) == 400
        assert not {r["question"] for r in splits[forget]} & {r["question"] for r in splits[retain]}
    assert {r["question"] for r in splits["forget01"]} <= {r["question"] for r in splits["forget10"]}  # nested
    for row in splits["full"]:
        assert len(row["perturbed_answer"]) == 5 and len(set(row["perturbed_answer"])) == 5
        assert row["paraphrased_answer"] != row["answer"]
        assert row["paraphrased_answer"] not in row["perturbed_answer"]
    assert len(splits["real_authors"]) == 100 and len(splits["world_facts"]) == 117
    assert minitofu.generate(minitofu.MiniTofuConfig(authors=20)) == splits  # deterministic


def test_minimuse_and_miniwmdp_structure():
    muse = minimuse.generate(minimuse.MiniMuseConfig(per_part=3))
    assert [len(muse[p]) for p in ("forget", "retain", "holdout")] == [6, 6, 6]
    texts = [d["text"] for p in ("forget", "retain", "holdout") for d in muse[p]]
    assert len(set(texts)) == len(texts)
    assert len(muse["forget_qa"]) == 18
    for config in (minimuse.MiniMuseConfig(), minimuse.MiniMuseConfig(shared_names=False)):
        full = minimuse.generate(config)
        questions = [q["question"] for p in ("forget", "retain", "holdout") for q in full[f"{p}_qa"]]
        assert len(questions) == 216 and len(set(questions)) == 216  # every question has one answer
    with pytest.raises(DataError, match="per_part 13 needs 13 articles .* forget part.* only 12"):
        minimuse.generate(minimuse.MiniMuseConfig(per_part=13, shared_names=False))
    with pytest.raises(DataError, match="three parts"):
        minimuse.generate(minimuse.MiniMuseConfig(per_part=40))
    wmdp = miniwmdp.generate()
    assert len(wmdp["forget"]) == len(wmdp["forget_corpus"]) == 32
    for q in wmdp["forget"] + wmdp["retain"]:
        assert len(q["choices"]) == 4 and len(set(q["choices"])) == 4
    answers = [q["answer"] for q in wmdp["forget"]]
    assert len(set(answers)) > 1  # the true choice is not always in the same slot


def test_minimuse_without_shared_names_keeps_its_forget_names_apart():
    def names_in(splits: dict, parts: tuple[str, ...]) -> set[str]:
        text = " ".join([d["text"] for p in parts for d in splits[p]]
                        + [q["question"] + " " + q["answer"] for p in parts for q in splits[f"{p}_qa"]])
        every = minimuse.ALL_NAMES
        return {n for n in every.towns + every.people + every.events + every.objects + every.places if n in text}

    shared = minimuse.generate(minimuse.MiniMuseConfig())
    assert names_in(shared, ("forget",)) & names_in(shared, ("retain", "holdout"))  # MUSE's way: names recur
    apart = minimuse.generate(minimuse.MiniMuseConfig(shared_names=False))
    forget_names, other_names = minimuse.ALL_NAMES.split()
    used = names_in(apart, ("forget",))
    assert used and not used & names_in(apart, ("retain", "holdout"))
    assert {n for n in used if n in forget_names.people} and not {n for n in used if n in other_names.people}
    assert [len(apart[p]) for p in ("forget", "retain", "holdout")] == [24, 24, 24]
    assert apart["retain"] != shared["retain"]  # the other parts draw from the rest of each list


def test_benchmark_configuration_from_the_command_line_is_checked():
    from flows.evaluation import sized_config

    assert sized_config("minimuse", None) is None and sized_config("minimuse", None, {}) is None
    assert sized_config("minimuse", None, {"shared_names": False}).shared_names is False
    assert sized_config("minitofu", 10, {"seed": 3}).authors == 10
    with pytest.raises(DataError, match="no setting 'nope'.*shared_names"):
        sized_config("minimuse", None, {"nope": 1})
    with pytest.raises(DataError, match="shared_names must be bool"):
        sized_config("minimuse", None, {"shared_names": "no"})
    with pytest.raises(DataError, match="per_part must be int"):
        sized_config("minimuse", None, {"per_part": True})  # a bool is not a count
    with pytest.raises(DataError, match="no setting 'model'"):
        sized_config("minimuse", None, {"model": {}})  # nested configurations are not plain settings
    with pytest.raises(DataError, match="no size to set with --authors"):
        sized_config("minimuse", 10)


def test_a_variant_is_evaluated_on_its_own_data(trained_dir, tmp_path):
    """`grom evaluate --config`: the variant's splits are built apart and scored; a bad field is refused before the
    model is read (the model folder here does not even exist)."""
    from flows.evaluation import build_benchmark, evaluate_model, sized_config

    variant = {"shared_names": False, "per_part": 2}
    result = evaluate_model(str(trained_dir), "minimuse", home=str(tmp_path), config=variant, max_new_tokens=8)
    assert result["n"]["forget"] == 4 and result["n"]["forget_qa"] == 12  # 2 x per_part articles, 3 questions each
    scores = result["per_question"]["min_k"]  # each text's Min-K% score, what the membership AUC ranks
    assert len(scores["forget"]) == 4 and len(scores["holdout"]) == 4 and max(scores["forget"]) < 0
    assert result["metrics"]["mia_auc"] == muse_metrics.auc(scores["forget"], scores["holdout"])
    built = build_benchmark("minimuse", None, str(tmp_path), train_models=False,
                            config=sized_config("minimuse", None, variant))
    assert [p.name for p in (tmp_path / "benchmarks").iterdir()] == [built.root.name]  # only the variant's build
    forget, retain = built.unlearning_files()  # what `grom benchmark build` hands to `grom unlearn`
    assert len(read_rows(str(forget))) == 4 + 12 and len(read_rows(str(retain))) == 4 + 12
    with pytest.raises(DataError, match="no setting 'shared_name'"):
        evaluate_model(str(tmp_path / "no-model"), "minimuse", home=str(tmp_path), config={"shared_name": False})


def test_data_files_in_every_format(tmp_path):
    rows = [{"question": "Q1?", "answer": "A1."}, {"question": "Q2?", "answer": "A2."}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "c.csv").write_text("question,answer\nQ1?,A1.\nQ2?,A2.\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("a.json", "b.jsonl", "c.csv", "d.parquet"):
        assert read_examples(tmp_path / name) == rows
    (tmp_path / "t.jsonl").write_text('{"text": "hello"}\n')
    assert read_examples(tmp_path / "t.jsonl") == [{"text": "hello"}]
    mixed = [rows[0], {"text": "Prose, not a question."}, rows[1]]  # facts and general text in one retain file
    pq.write_table(rows_table(mixed), tmp_path / "m.parquet")  # missing columns come back as None
    assert read_examples(tmp_path / "m.parquet") == mixed
    assert pa.Table.from_pylist(mixed).column_names == ["question", "answer"]  # why rows_table exists


def test_bad_data_files_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.json")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(tmp_path / "x.txt")
    (tmp_path / "bad.jsonl").write_text('{"question": "q"}\n{oops\n')
    with pytest.raises(DataError, match="line 2"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "cols.csv").write_text("prompt,response\nx,y\n")
    with pytest.raises(DataError, match=r"columns \['prompt', 'response'\].*\['question', 'answer'\]"):
        read_examples(tmp_path / "cols.csv")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="no rows"):
        read_examples(tmp_path / "empty.json")
    (tmp_path / "blank.csv").write_text("question,answer\nq,\n")
    with pytest.raises(DataError, match="row 1 has no value"):
        read_examples(tmp_path / "blank.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="Parquet"):
        read_rows(tmp_path / "broken.parquet")
    (tmp_path / "mc.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 5}\n')
    with pytest.raises(DataError, match="answer index"):
        read_benchmark_file(tmp_path / "mc.jsonl", "wmdp")


def test_real_tofu_layout_from_a_folder(tmp_path):
    row = {"question": "q?", "answer": "a.", "paraphrased_answer": "b.", "perturbed_answer": ["c.", "d."]}
    for stem in ("forget10_perturbed", "retain_perturbed", "real_authors_perturbed", "world_facts_perturbed"):
        (tmp_path / f"{stem}.json").write_text(json.dumps(row) + "\n")  # JSON lines, as TOFU ships them
    splits = tofu_splits_from_dir(tmp_path)
    assert splits["forget10"][0]["perturbed_answer"] == ["c.", "d."]
    assert splits["real_authors"][0]["paraphrased_answer"] == "a."  # the true answer stands in
    (tmp_path / "retain_perturbed.json").unlink()
    with pytest.raises(DataError, match="retain_perturbed"):
        tofu_splits_from_dir(tmp_path)


def test_unknown_benchmark_and_split():
    with pytest.raises(DataError, match="minitofu"):
        get_benchmark("tofu-xl")
    with pytest.raises(DataError, match="forget10"):
        build("minitofu", "/nonexistent-never-written", split="forget50", train_models=False)


@pytest.fixture(scope="module")
def small_tofu(tmp_path_factory):
    config = minitofu.MiniTofuConfig(authors=10, retain_eval_questions=40, model=SMALL_MODEL,
                                     train=TrainConfig(epochs=12, lr=5e-3, batch_size=32))
    return build("minitofu", tmp_path_factory.mktemp("bench"), config=config)


def test_build_writes_splits_and_both_models(small_tofu):
    assert set(small_tofu.splits) >= {"forget10", "retain90", "forget01", "retain99", "real_authors"}
    assert small_tofu.split == "forget10" and small_tofu.models["target"] != small_tofu.models["retain"]
    rows = small_tofu.load_splits()["forget10"]
    assert len(rows) == 20 and "perturbed_answer" in rows[0]
    again = build("minitofu", small_tofu.root.parent, config=get_benchmark("minitofu").config.__class__(
        authors=10, retain_eval_questions=40, model=SMALL_MODEL, train=TrainConfig(epochs=12, lr=5e-3, batch_size=32)))
    assert again.models == small_tofu.models  # cached by content


def test_evaluate_tofu_metrics_and_the_retain_model_against_itself(small_tofu):
    splits = small_tofu.load_splits()
    model, tokenizer = load_model(small_tofu.models["retain"], device="cpu")
    ref = minitofu.evaluate(model, tokenizer, splits, "forget10", None, max_new_tokens=24)
    assert ref["metrics"]["forget_quality"] is None and "reference" in ref["metrics"]["forget_quality_unavailable"]
    ratios = ref["per_question"]["forget_truth_ratio"]
    own = minitofu.evaluate(model, tokenizer, splits, "forget10", ratios, max_new_tokens=24)
    assert own["metrics"]["forget_quality"] == pytest.approx(1.0)
    assert own["metrics"]["forget_quality_n"] == 20
    assert 0 < own["metrics"]["model_utility"] <= 1
    for key in ("retain_probability", "real_authors_rougeL_recall", "world_facts_truth_ratio"):
        assert 0 <= own["metrics"][key] <= 1
    assert np.isfinite(ratios).all()
