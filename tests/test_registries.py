"""Adding a method or a benchmark is one definition plus one registry line: toy entries, registered here, run
through the same flows, CLI and catalog as the shipped ones."""

import json
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from conftest import FORGET, MODEL_CONFIG, RETAIN, run_grom

from grom_core.benchmarks.authors import author_questions, make_authors
from grom_core.benchmarks.registry import BENCHMARKS, Benchmark, MetricKeys
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import ParamsError
from grom_core.finetune import TinyModelConfig, TrainConfig
from grom_core.fingerprint import weights_fingerprint
from grom_core.gradient.methods import ForgetBatchOutputs, GradDiffParams, Objective
from grom_core.methods import METHODS, Method, MethodRun, gradient_method
from grom_core.params import Params
from grom_core.scoring import answer_probability
from tasks.catalog import Catalog

# --- a closed-form method in a dozen lines: scale down the LM-head rows of forget-only answer tokens ---


pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI


@dataclass(frozen=True)
class HeadScaleParams(Params):
    factor: float = 0.2  # what the LM-head rows of forget-only answer tokens are multiplied by

    def validate(self) -> None:
        if not 0 <= self.factor < 1:
            raise ParamsError(f"factor must be in [0, 1), got {self.factor}")


def head_scale(model, tokenizer, forget, retain, params: HeadScaleParams, context) -> MethodRun:
    def tokens(rows):
        return {t for r in rows for t in tokenizer.encode(" " + r["answer"], add_special_tokens=False)}

    rows = sorted(tokens(forget) - tokens(retain))
    weight = model.get_output_embeddings().weight.detach().double()
    dense = torch.zeros_like(weight)
    dense[rows] = (params.factor - 1) * weight[rows]
    delta = ModuleDelta(name="lm_head", shape=tuple(weight.shape), dense=dense)
    edit = Edit(deltas={"lm_head": delta}, base_fingerprint=weights_fingerprint(model),
                params={"method": "headscale", **params.to_dict()}, metadata={"rows": len(rows)})
    return MethodRun(edit=edit)


HEADSCALE = Method("headscale", HeadScaleParams, head_scale, "toy: scale forget-only head rows")


# --- a gradient method: one objective function ---


def normalised_ascent(out: ForgetBatchOutputs, params) -> torch.Tensor:
    """Ascent on the length-normalised log-likelihood (minimised: the mean per-token log-prob)."""
    return (out.logp / out.lengths).mean()


NORMASCENT = gradient_method("normascent", GradDiffParams, Objective(normalised_ascent), "toy: normalised ascent")


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(ex.record()) + "\n" for ex in examples))
    return str(path)


@pytest.fixture()
def files(tmp_path):
    return {"forget": write_jsonl(tmp_path / "forget.jsonl", FORGET),
            "retain": write_jsonl(tmp_path / "retain.jsonl", RETAIN)}


def test_a_toy_closed_form_method_runs_through_the_flow(harness, trained_dir, files, tmp_path, monkeypatch):
    from flows.demo import run_unlearn

    monkeypatch.setitem(METHODS, "headscale", HEADSCALE)  # the one registry line
    result = run_unlearn(str(trained_dir), files["forget"], files["retain"], home=str(tmp_path / "ws"),
                         method="headscale", params={"factor": 0.0})
    assert result["method"] == "headscale" and result["modules"] == ["lm_head"]
    assert result["cached_stats"] is None and result["influence"] is None  # no solve records: no audit
    before, after = result["metrics"]["before"], result["metrics"]["after"]
    assert after["forget_probability"] < 0.8 * before["forget_probability"]  # many answer tokens are shared
    catalog = Catalog(tmp_path / "ws" / "catalog.duckdb")
    assert catalog.query("SELECT method FROM edits") == [{"method": "headscale"}]
    with pytest.raises(ParamsError, match="factor must be float"):
        run_unlearn(str(trained_dir), files["forget"], files["retain"], home=str(tmp_path / "ws"),
                    method="headscale", params={"factor": "most"})
    assert len(catalog.query("SELECT * FROM runs")) == 1  # the bad parameters changed nothing


def test_a_toy_gradient_method_runs_through_the_flow(harness, trained_dir, files, tmp_path, monkeypatch):
    from flows.demo import run_unlearn

    monkeypatch.setitem(METHODS, "normascent", NORMASCENT)
    recipe = {"epochs": 2, "batch_size": 4, "grad_accum": 2, "lr": 2e-3}
    result = run_unlearn(str(trained_dir), files["forget"], files["retain"], home=str(tmp_path / "ws"),
                         method="normascent", params={"compose": "pcgrad", "trainer": recipe})
    assert result["method"] == "normascent" and result["compose"] == "pcgrad"
    assert result["unlearning"]["steps"] == 2 * 2
    assert result["metrics"]["after"]["forget_probability"] < result["metrics"]["before"]["forget_probability"]


def test_grom_benchmark_list_shows_every_registered_benchmark(capsys, monkeypatch):
    monkeypatch.setitem(BENCHMARKS, "toyqa", TOYQA)
    code, out, err = run_grom(capsys, monkeypatch, "benchmark", "list", "--json")
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads(out)["benchmarks"]}
    assert list(rows) == list(BENCHMARKS)
    assert rows["toyqa"]["data"] == "generated" and rows["toyqa"]["model"] == "tiny Llama trained here"
    assert rows["tofu"]["data"] == "your files (--data-dir)"
    assert rows["minirwku"] == {"name": "minirwku", "data": "probed from the model", "model": "pretrained: smollm2",
                                "forget_splits": ["forget01", "forget05", "forget10"], "default_split": "forget05",
                                "forget_metric": "forget_accuracy", "utility_metric": "neighbor_accuracy"}


def test_every_registered_method_is_offered_by_the_command_line():
    done = subprocess.run([sys.executable, "-m", "flows.cli", "unlearn", "--help"], capture_output=True, text=True,
                          env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in METHODS:
        assert name in done.stdout


# --- a benchmark: generate, training rows, evaluate, metric keys ---


@dataclass(frozen=True)
class ToyConfig:
    authors: int = 4
    seed: int = 3
    model: TinyModelConfig = MODEL_CONFIG
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=40, lr=3e-3, batch_size=16))


def toy_generate(config: ToyConfig) -> dict[str, list[dict]]:
    authors = make_authors(config.authors, seed=config.seed)
    qa = [[ex.record() for ex in author_questions(a)] for a in authors]
    random.Random(config.seed).shuffle(qa)
    return {"forget": qa[0], "retain": [r for rows in qa[1:] for r in rows]}


def toy_training_rows(splits, without):
    return splits["retain"] + ([] if without else splits["forget"])


def toy_evaluate(model, tokenizer, splits, split, reference, *, batch_size=32, max_new_tokens=0):
    from grom_core.data import as_examples

    metrics = {f"{name}_probability": float(answer_probability(model, tokenizer, as_examples(splits[name])).mean())
               for name in (split, "retain")}
    return {"metrics": metrics, "per_question": {}, "n": {name: len(rows) for name, rows in splits.items()}}


def toy_inputs(splits, split):
    return splits[split], splits["retain"]


def no_reference(path):
    return None


def write_metrics(path, split, result):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result["metrics"]))
    return path


TOYQA = Benchmark("toyqa", ToyConfig(), toy_generate, toy_training_rows, toy_evaluate, {"forget": "retain"},
                  "forget", toy_inputs,
                  MetricKeys(forget="forget_probability", utility="retain_probability",
                             recovery=("forget_probability",), table=("forget_probability", "retain_probability")),
                  no_reference, write_metrics)


def test_a_toy_benchmark_is_built_evaluated_and_unlearned_through_the_demo(harness, tmp_path, monkeypatch):
    from flows.demo import run_demo
    from flows.evaluation import evaluate_model

    monkeypatch.setitem(BENCHMARKS, "toyqa", TOYQA)  # the one registry line
    result = run_demo(home=str(tmp_path / "ws"), benchmark="toyqa", quantization=False)
    before, after = result["metrics"]["before"], result["metrics"]["after"]
    assert set(before) == {"forget_probability", "retain_probability"}
    assert before["forget_probability"] > 0.5  # the target model memorised the forget author
    assert after["forget_probability"] < before["forget_probability"] / 2
    assert after["retain_probability"] > 0.8 * before["retain_probability"]
    assert result["mlflow"]["model_name"] == "grom-toyqa-forget"
    scored = evaluate_model(result["model_dir"], "toyqa", home=str(tmp_path / "ws"))
    assert scored["metrics"] == pytest.approx(after, rel=1e-6)


def test_a_benchmark_names_its_target_kind_and_only_grom_gets_it():
    from grom_core.grom import GromParams

    wmdp, tofu = BENCHMARKS["miniwmdp"], BENCHMARKS["minitofu"]
    assert wmdp.params_for("grom", False) == {"target": "corrupt"}  # multiple choice: corrupt, nothing tuned
    assert GromParams.from_dict(wmdp.params_for("grom", False)).target == "corrupt"
    assert "target" not in wmdp.params_for("npo", True) and "target" not in tofu.params_for("grom", False)
    for bench in BENCHMARKS.values():  # one default: a benchmark names its target kind and nothing else
        assert set(bench.params_for("grom", False)) <= {"target"}, bench.name
