"""The benchmarks fine-tuned into SmolLM2-135M-Instruct: minitofu-smollm2 (the minitofu authors through the chat
template, TOFU's protocol for a chat model) and minimuse-smollm2 (minimuse's texts and questions), each built
through the CLI at a reduced size; minitofu-smollm2 then runs the closed form beside a gradient method in
`grom bench`."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_grom

from grom_core.benchmarks import minitofu
from grom_core.benchmarks.registry import get_benchmark

# 4 authors x 3 questions (forget10 is one author), 2 epochs: the whole path in a few minutes on 2 cores
REDUCED = {"authors": 4, "questions": 3, "retain_eval_questions": 6, "utility_questions": 6, "train.epochs": 2,
           "train.lr": 3e-4}


def test_the_chat_benchmark_fine_tunes_on_the_authors_alone():
    bench = get_benchmark("minitofu-smollm2")
    assert bench.base == "smollm2" and bench.prompt_format == "chat" and bench.pretrained is None
    splits = minitofu.generate(minitofu.MiniTofuConfig(authors=4, questions=3, utility_questions=5))
    assert len(splits["full"]) == 12 and len(splits["forget10"]) == 3
    assert len(splits["real_authors"]) == 5 == len(splits["world_facts"])
    rows = bench.training_rows(splits, "forget10")
    assert len(rows) == 9 and {r["question"] for r in rows}.isdisjoint(r["question"] for r in splits["forget10"])
    assert not {r["question"] for r in bench.training_rows(splits, None)} & {r["question"]
                                                                            for r in splits["world_facts"]}


def test_generation_is_sized_to_the_answers(tokenizer):
    answers = ["Aurelio Marlowe was born in Lisbon.", "Yes."]
    longest = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in answers)
    assert minitofu.generation_budget(tokenizer, answers, 200) == 2 * longest + 8
    assert minitofu.generation_budget(tokenizer, answers, 5) == 5


@pytest.mark.e2e
def test_reduced_build_then_bench_through_the_cli(smollm2_home, capsys, monkeypatch):
    torch.set_num_threads(2)
    home = str(smollm2_home)
    code, out, err = run_grom(capsys, monkeypatch, "benchmark", "build", "minitofu-smollm2", "--config",
                              json.dumps(REDUCED), "--home", home, "--json")
    assert code == 0, err
    built = json.loads(out)
    target, retain = (Path(built["models"][role]) for role in ("target", "retain"))
    assert target != retain and target.parent == retain.parent
    training = json.loads((target / "training.json").read_text())
    assert training["prompt_format"] == "chat" and training["examples"] == 12 and training["train"]["lr"] == 3e-4
    checks = built["checks"]
    # the target saw the forgotten author, the retain model did not
    assert checks["target"]["forget_probability"] > checks["retain"]["forget_probability"]
    for role in ("target", "retain"):
        assert 0 <= checks[role]["tofu_final"] <= 1 and 0 <= checks[role]["model_utility"] <= 1
    assert checks["target"]["forget_quality"] is not None

    # built once: a second build reuses the fine-tuned models and the check
    code, out, _ = run_grom(capsys, monkeypatch, "benchmark", "build", "minitofu-smollm2", "--config",
                            json.dumps(REDUCED), "--home", home, "--json")
    assert code == 0 and json.loads(out)["models"] == built["models"]

    code, out, err = run_grom(capsys, monkeypatch, "bench", "--benchmark", "minitofu-smollm2", "--config",
                              json.dumps(REDUCED), "--methods", "grom,npo", "--epochs", "1", "--attacks",
                              "", "--home", home, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["retain_model"] == checks["retain"] and result["before"]["forget_probability"] == pytest.approx(
        checks["target"]["forget_probability"], abs=1e-6)
    rows = {r["label"]: r for r in result["rows"] if not r["cached_stats"]}
    assert set(rows) == {"grom", "npo+sum"} and result["trainer"]["lr"] == 1e-5  # TOFU's recipe for a pretrained model
    grom = rows["grom"]["metrics"]
    assert grom["forget_probability"] < result["before"]["forget_probability"]
    assert grom["tofu_final"] is not None and grom["forget_extraction_strength"] is not None


@pytest.mark.e2e
def test_reduced_muse_build_memorises_the_forget_texts(smollm2_home, capsys, monkeypatch):
    torch.set_num_threads(2)
    reduced = {"per_part": 1, "train.epochs": 2, "train.lr": 3e-4}
    code, out, err = run_grom(capsys, monkeypatch, "benchmark", "build", "minimuse-smollm2", "--config",
                              json.dumps(reduced), "--home", str(smollm2_home), "--json")
    assert code == 0, err
    built = json.loads(out)
    training = json.loads((Path(built["models"]["target"]) / "training.json").read_text())
    assert training["prompt_format"] == "qa" and training["examples"] == 2 * (2 + 6)  # texts and questions
    target, retain = built["checks"]["target"], built["checks"]["retain"]
    # the target read the forget texts, the retain model never did
    assert target["verbmem_rougeL_f1"] > retain["verbmem_rougeL_f1"]
    assert target["privleak"] is not None and target["muse_final"] is not None
