"""Promotion gates fail closed: a gate that cannot be measured is a reason, never a pass."""

import math

import pytest

from grom_core.errors import DataError
from grom_core.gates import Gates as AllGates


def Gates(**thresholds):  # noqa: N802 - these tests are about the other gates: the read-around one is tested last
    return AllGates(**{"max_attack_recovery": None, **thresholds})

BEFORE = {"forget_probability": 0.9, "retain_probability": 0.8, "forget_rougeL_recall": 1.0,
          "retain_rougeL_recall": 1.0}
AFTER = {"forget_probability": 0.1, "retain_probability": 0.79, "forget_rougeL_recall": 0.2,
         "retain_rougeL_recall": 0.98}
ATTACKED = {"rtn4": {"recovery_forget_rougeL_recall": 0.02}}


def test_a_good_edit_passes_and_each_threshold_names_itself():
    assert Gates().check(BEFORE, AFTER, ATTACKED) == []
    reasons = Gates(max_forget_rougeL_recall=0.1, min_retain_probability_ratio=0.999).check(BEFORE, AFTER, ATTACKED)
    assert reasons == ["forget ROUGE-L recall 0.200 > 0.1", "retain probability kept 0.988 of its value < 0.999"]
    recovered = {"rtn4": {"recovery_forget_rougeL_recall": 0.5}}
    assert Gates().check(BEFORE, AFTER, recovered) == [
        "rtn4 quantization recovers forget rougeL recall by +0.500 > 0.1"]


@pytest.mark.parametrize("key", sorted(AFTER))
@pytest.mark.parametrize("bad", [math.nan, None, "0.1"])
def test_a_metric_that_is_nan_or_missing_after_the_edit_fails_its_gate(key, bad):
    after = {**AFTER, key: bad} if bad is not None else {k: v for k, v in AFTER.items() if k != key}
    reasons = Gates().check(BEFORE, after, ATTACKED)
    assert len(reasons) == 1 and f"{key} is" in reasons[0] and "not measured" in reasons[0]


def test_a_model_with_nan_everywhere_is_never_promoted():
    nan = {k: math.nan for k in AFTER}
    attacked = {"rtn4": {"recovery_forget_rougeL_recall": math.nan}}
    assert len(Gates().check(BEFORE, nan, attacked)) == 5


def test_an_unmeasurable_reference_fails_too():
    reasons = Gates().check({**BEFORE, "retain_probability": 0.0}, AFTER, ATTACKED)
    assert reasons == ["retain probability gate not measured: retain_probability is 0.0 (nothing to compare with) "
                       "before the edit"]


def test_the_quantization_gate_fails_when_no_attack_ran_and_says_why():
    for quantized in (None, {}, {"_note": "not run (bitsandbytes unavailable): fp4, nf4"}):
        reasons = Gates().check(BEFORE, AFTER, quantized)
        assert len(reasons) == 1 and "no attack ran" in reasons[0]
    assert "bitsandbytes unavailable" in Gates().check(BEFORE, AFTER, {"_note": "not run (bitsandbytes "
                                                                                 "unavailable): fp4"})[0]
    assert "recovery_forget_rougeL_recall is missing" in Gates().check(BEFORE, AFTER, {"rtn4": {}})[0]


def test_switched_off_gates_and_texts_without_rouge():
    assert Gates(max_quantized_recovery=None).check(BEFORE, AFTER, None) == []
    texts_before = {"forget_probability": 0.9, "retain_probability": 0.8}
    texts_after = {"forget_probability": 0.1, "retain_probability": 0.79}
    # texts have no ROUGE-L before the edit either: those gates do not apply; the attack is judged on probability
    assert Gates().check(texts_before, texts_after, {"rtn4": {"recovery_forget_probability": 0.01}}) == []
    assert "recovery_forget_probability is missing" in Gates().check(texts_before, texts_after, ATTACKED)[0]


@pytest.mark.parametrize("values", [{"max_quantized_recovery": -1}, {"min_retain_rougeL_ratio": "high"},
                                    {"max_forget_probability_ratio": math.nan}, {"max_forget_rougeL_recall": True},
                                    {"max_forget_rouge": 0.4}])
def test_bad_thresholds_are_refused_by_name(values):
    with pytest.raises(DataError, match="gate|unknown gates"):
        AllGates.from_dict(values)


def test_own_data_is_gated_on_what_the_answers_add_to_their_questions():
    # a model that never saw the subject restates the question: most of the whole answer's recall, little of the rest
    before = {**BEFORE, "forget_added_rougeL_recall": 1.0}
    after = {**AFTER, "forget_rougeL_recall": 0.61, "forget_added_rougeL_recall": 0.29}
    assert Gates().check(before, after, ATTACKED) == []
    assert Gates().check(before, {**after, "forget_added_rougeL_recall": 0.6}, ATTACKED) == [
        "forget ROUGE-L recall of what the answers add 0.600 > 0.5"]
    assert "forget_added_rougeL_recall is missing" in Gates().check(before, AFTER, ATTACKED)[0]
    # a benchmark's metrics have only the whole answer's recall, and are gated on it
    assert Gates().check(BEFORE, after, ATTACKED) == ["forget ROUGE-L recall 0.610 > 0.5"]
    # a recovery is a difference of one model's answers, where the restated question cancels: read on whole answers
    recovered = {"rtn4": {"recovery_forget_rougeL_recall": 0.2}}
    assert Gates().check(before, after, recovered) == [
        "rtn4 quantization recovers forget rougeL recall by +0.200 > 0.1"]


def test_texts_are_gated_on_verbmem_and_keep_the_probability_they_share_with_any_model():
    before = {"forget_probability": 0.97, "retain_probability": 0.97, "forget_verbatim_rougeL": 1.0}
    after = {"forget_probability": 0.82, "retain_probability": 0.93, "forget_verbatim_rougeL": 0.3}
    attacked = {"rtn4": {"recovery_forget_verbatim_rougeL": 0.02, "recovery_forget_probability": 0.5}}
    # texts only: forgotten word for word, though most of their words stay likely (0.85 of the probability)
    assert Gates().check(before, after, attacked) == []
    assert Gates().check(before, {**after, "forget_verbatim_rougeL": 0.7}, attacked) == [
        "forget texts' VerbMem (ROUGE-L F1 of their continuations) 0.700 > 0.5"]
    assert "forget_verbatim_rougeL is missing" in Gates().check(
        before, {k: v for k, v in after.items() if k != "forget_verbatim_rougeL"}, attacked)[0]
    # the attack is judged on VerbMem's recovery, which must be measured
    assert Gates().check(before, after, {"rtn4": {"recovery_forget_verbatim_rougeL": 0.3}}) == [
        "rtn4 quantization recovers forget verbatim rougeL by +0.300 > 0.1"]
    assert "recovery_forget_verbatim_rougeL is missing" in Gates().check(
        before, after, {"rtn4": {"recovery_forget_probability": 0.0}})[0]
    assert Gates(max_forget_verbatim_rougeL=None).check(
        before, {**after, "forget_verbatim_rougeL": 0.9}, attacked) == []
    # QA pairs beside the texts: their gates apply as before, the forget probability included, and VerbMem too
    mixed_before, mixed_after = {**BEFORE, "forget_verbatim_rougeL": 1.0}, {**AFTER, "forget_verbatim_rougeL": 0.7}
    assert Gates().check(mixed_before, {**mixed_after, "forget_probability": 0.8}, ATTACKED) == [
        "forget texts' VerbMem (ROUGE-L F1 of their continuations) 0.700 > 0.5",
        "forget probability kept 0.889 of its value > 0.5"]


def test_the_read_around_gate_fails_an_edit_that_hides_and_fails_closed():
    gates = AllGates()
    removed = {"head_swap": {"recovery": 0.0}, "relearn": {"recovery": 0.05}}
    assert gates.check(BEFORE, AFTER, ATTACKED, removed) == []
    hidden = {"head_swap": {"recovery": 1.0}, "relearn": {"recovery": 0.05}}  # a head-only edit, read back
    assert gates.check(BEFORE, AFTER, ATTACKED, hidden) == [
        "head_swap reads the forgotten data back: recovery +1.000 > 0.1"]
    assert "no attack that reads around the edit ran" in gates.check(BEFORE, AFTER, ATTACKED)[0]
    assert "head_swap recovery gate not measured: recovery is NaN" in gates.check(
        BEFORE, AFTER, ATTACKED, {"head_swap": {"recovery": math.nan}})[0]
    assert AllGates(max_attack_recovery=None).check(BEFORE, AFTER, ATTACKED) == []
    # a skipped attack (relearning on one fact) is not judged; all skipped is not measured
    skipped = {"relearn": {"skipped": "needs two facts", "recovery": None}}
    assert gates.check(BEFORE, AFTER, ATTACKED, {**removed, **skipped}) == []
    assert "every attack was skipped (relearn: needs two facts)" in gates.check(BEFORE, AFTER, ATTACKED, skipped)[0]
