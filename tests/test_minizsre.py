"""minizsre: facts in ZsRE/CounterFact's format, its metrics by hand, and its inputs to a method (the build on
SmolLM2 and the methods' figures are `grom bench --benchmark minizsre`'s)."""

import math

import pytest

from grom_core.benchmarks import minizsre
from grom_core.benchmarks.registry import get_benchmark
from grom_core.data import as_examples


def test_ngram_entropy_by_hand():
    # "a b a b": bigrams ab, ba, ab -> p = 2/3, 1/3; trigrams aba, bab -> 1 bit
    h2 = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert minizsre.ngram_entropy("a b a b") == pytest.approx((2 / 3 * h2 + 4 / 3 * 1.0) / 2)
    assert minizsre.ngram_entropy("the the the the the") == 0.0  # repetition: no fluency at all
    assert minizsre.ngram_entropy("Paris is the capital of France, a country in Europe.") > 3


def _splits():
    facts = [{"subject": f"Land{r}", "relation": "capital", "object": f"City{r}", "rank": r,
              "prompt": f"The capital of Land{r} is", "paraphrases": [f"Land{r}'s capital city is"],
              "neighborhood": [{"prompt": "The capital of Peru is", "answer": "Lima"}]} for r in range(12)]
    return {"facts": facts, "retain_facts": [{"question": "The capital of Chile is", "answer": "Santiago",
                                              "subject": "Chile"}],
            "retain_text": [{"text": "Some prose."}]}


def test_unlearning_inputs_carry_the_subject_and_take_the_split_s_facts():
    forget, retain = minizsre.unlearning_inputs(_splits(), "edit10")
    assert len(forget) == 10 and forget[3] == {"question": "The capital of Land3 is", "answer": "City3",
                                               "subject": "Land3"}
    examples = as_examples(forget + retain)
    assert examples[0].subject == "Land0" and examples[-1].text == "Some prose."
    assert examples[0].record()["subject"] == "Land0" and "subject" not in examples[-1].record()


def test_metrics_of_a_model_that_knows_nothing(tiny_llama, tokenizer):
    # a random model states no fact: every fact is "given up", no neighbour is right; the metric keys are flat
    result = minizsre.evaluate(tiny_llama, tokenizer, _splits(), "edit1", None, max_new_tokens=2)
    metrics = result["metrics"]
    assert metrics["efficacy"] == metrics["generalization"] == 1.0
    assert metrics["specificity"] == 0.0 and metrics["rewrite_accuracy"] == 0.0
    assert result["n"] == {"facts": 1, "paraphrases": 1, "neighbors": 1}
    bench = get_benchmark("minizsre")
    assert set(bench.metrics.table) <= set(metrics) and bench.metrics.forget in metrics
    assert bench.default_split == "edit10" and bench.pretrained == "smollm2"
