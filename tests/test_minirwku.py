"""minirwku: real facts (countryinfo, pinned), probes kept where SmolLM2 answers them, and the closed form with the
benchmark's parameters forgetting its targets on every probe type while the neighbours stay."""

from importlib import metadata

import pytest
import torch

from flows.evaluation import build_benchmark
from grom_core.attacks import head_swapped
from grom_core.benchmarks import minirwku
from grom_core.benchmarks.registry import get_benchmark
from grom_core.errors import DataError
from grom_core.methods import MethodContext, get_method
from tasks.steps import load_for_edit


def test_countryinfo_is_read_from_the_pinned_package():
    countries = {c["entity"]: c for c in minirwku.read_countries()}
    assert len(countries) >= 240
    assert countries["France"] == {"entity": "France", "capital": "Paris", "continent": "Europe", "demonym": "French"}
    assert countries["Brazil"]["continent"] is None  # "Americas" is no continent name: no probe asks it


def test_without_countryinfo_the_error_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(minirwku.metadata, "distribution", missing)
    with pytest.raises(DataError, match=r"countryinfo==1\.0\.1 \(it is not installed\): pip install --no-deps"):
        minirwku.countryinfo_dir()


def test_general_text_is_prose_and_answers_match_whole_words():
    text = minirwku.general_text(50)
    assert len(text) == 50 and all(200 <= len(t) <= 700 and "::=" not in t for t in text)
    assert minirwku.answer_matches("Paris, the city of light", "Paris")
    assert minirwku.answer_matches("it is paris.", "Paris")
    assert not minirwku.answer_matches("Parisian food", "Paris")
    assert minirwku.answer_matches("Port-au-Prince is", "Port-au-Prince")


def test_unlearning_inputs_take_the_split_s_targets_and_all_retain_data():
    splits = {"forget_corpus": [{"question": f"q{r}", "answer": "a", "rank": r} for r in range(10)],
              "retain_corpus": [{"question": "The capital of X is", "answer": "Y"}],
              "retain_text": [{"text": "Some prose."}]}
    forget, retain = minirwku.unlearning_inputs(splits, "forget05")
    assert [f["question"] for f in forget] == ["q0", "q1", "q2", "q3", "q4"]
    assert retain == [{"question": "The capital of X is", "answer": "Y"}, {"text": "Some prose."}]


@pytest.mark.e2e
def test_built_on_smollm2_then_forgotten_by_the_closed_form(smollm2_home):
    torch.set_num_threads(2)
    # smaller than the shipped sizes (which `grom bench` runs): the same build, probes and checks in half the time
    small = minirwku.MiniRwkuConfig(retain_entities=16, neighbor_entities=10, utility_items=16, text_paragraphs=12,
                                    retain_paragraphs=40)
    built = build_benchmark("minirwku", None, str(smollm2_home), "forget01", config=small)
    base = built.checks["target"]
    # every probe kept is one the base model answers: it scores 1.0 on each forget and neighbour type
    assert all(base[f"forget_{k}_accuracy"] == 1.0 for k in minirwku.PROBE_TYPES)
    assert base["neighbor_fb_accuracy"] == base["neighbor_qa_accuracy"] == 1.0
    splits = built.load_splits()
    info = splits["build"][0]
    assert info["eligible_targets"] >= 10 and info["probes_kept"] < info["probes_tried"]
    assert info["source"]["license"] == "MIT"
    assert {p["entity"] for p in splits["neighbor_probes"]}.isdisjoint({t["entity"] for t in splits["targets"]})

    bench = get_benchmark("minirwku")
    method = get_method("grom")
    params = method.params.from_dict({**bench.params_for("grom", False), "influence": False})
    model, tokenizer = load_for_edit(built.models["target"])
    forget, retain = built.unlearning_inputs()
    run = method.run(model, tokenizer, forget, retain, params, MethodContext(prompt_format=bench.prompt_format))
    with run.edit.applied(model):
        after = bench.evaluate(model, tokenizer, splits, "forget01", None)["metrics"]
    # read through the base model's head (grom_core.attacks.head_swap): the band took part of it out of the body
    base_head = load_for_edit(built.models["target"])[0].get_output_embeddings().weight.detach()
    with run.edit.applied(model), head_swapped(model, base_head):
        swapped = bench.evaluate(model, tokenizer, splits, "forget01", None)["metrics"]
    for kind in minirwku.PROBE_TYPES:
        assert after[f"forget_{kind}_accuracy"] <= 0.1, kind  # forgotten in every form it was asked
    # the default edits the band before the head: removal, not a mask the base head reads through
    assert run.layers and len(run.edit.modules) > len(run.layers)
    assert min(swapped[f"forget_{kind}_accuracy"] for kind in minirwku.PROBE_TYPES) < 1.0
    # the band's edit takes some neighbours along (on an AMD EPYC, 0.8 of the fill-in-the-blank ones and 0.625 of
    # the questions kept; the LM head alone kept them all and hid the facts from its own reading only)
    assert after["neighbor_fb_accuracy"] >= 0.5 and after["neighbor_qa_accuracy"] >= 0.5
    assert after["utility_perplexity"] <= 1.05 * base["utility_perplexity"]
