"""Metrics against hand-computed values and against the real TOFU evaluation logs."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from grom_core.errors import DataError
from grom_core.metrics import muse, tofu, wmdp
from grom_core.metrics.rouge import rouge_l_f1, rouge_l_recall, rouge_l_recall_added
from grom_core.metrics.tofu_logs import read_tofu_log, tofu_score, write_reference

LOGS = Path(__file__).resolve().parents[1] / "data" / "tofu" / "eval-logs"


def test_probability_and_normalised_probability():
    assert tofu.probability([0.0, math.log(2)]).tolist() == pytest.approx([1.0, 0.5])
    # p_true = 0.5, perturbed 0.25 and 0.25 -> 0.5 / (0.5 + 0.5)
    got = tofu.normalized_probability([math.log(2)], [[math.log(4), math.log(4)]])
    assert got.tolist() == pytest.approx([0.5])


def test_truth_ratio_and_both_aggregators():
    # P(para) = 0.5; perturbed 0.25 and 0.0625 -> GM = 0.125 -> R = 0.25
    r = tofu.truth_ratio([math.log(2)], [[math.log(4), math.log(16)]])
    assert r.tolist() == pytest.approx([0.25])
    assert tofu.truth_ratio_forget([0.25, 2.0]) == pytest.approx((0.25 + 0.5) / 2)
    assert tofu.truth_ratio_retain([0.25, 2.0]) == pytest.approx((0.75 + 0.0) / 2)


def test_forget_quality_and_model_utility():
    same = tofu.forget_quality([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])
    assert same.pvalue == pytest.approx(1.0) and same.n == 3 and same.n_reference == 3
    apart = tofu.forget_quality(np.linspace(0, 1, 20), np.linspace(5, 6, 20))
    assert apart.statistic == 1.0 and apart.pvalue < 1e-9
    parts = {f"{s}_{p}": 0.5 for s in tofu.UTILITY_SETS for p in tofu.UTILITY_PARTS}
    assert tofu.model_utility(parts) == pytest.approx(0.5)
    parts["world_facts_truth_ratio"] = 0.25  # 9 / (8 * 2 + 4) = 0.45
    assert tofu.model_utility(parts) == pytest.approx(9 / 20)
    parts["retain_probability"] = 0.0
    assert tofu.model_utility(parts) == 0.0
    with pytest.raises(KeyError, match="missing"):
        tofu.model_utility({"retain_probability": 1.0})


def test_summary_says_why_forget_quality_is_missing():
    s = tofu.SetScores("forget", np.zeros(2), np.zeros(2), np.ones((2, 3)), np.ones(2), ["", ""])
    out = tofu.tofu_summary({"forget": s}, None)
    assert out["forget_quality"] is None and "retain-model reference" in out["forget_quality_unavailable"]
    out = tofu.tofu_summary({"forget": s}, s.truth_ratios())
    assert out["forget_quality"] == pytest.approx(1.0) and out["forget_quality_n"] == 2


def test_summary_gives_both_sides_of_the_forget_truth_ratio():
    # one model that knows neither answer, one whose answers are noise: the same truth ratios, told apart by the NLLs
    unsure = tofu.SetScores("forget", np.zeros(2), np.array([2.0, 3.0]), np.array([[2.0, 2.0], [3.0, 3.0]]),
                            np.ones(2), ["", ""])
    noise = tofu.SetScores("forget", np.zeros(2), np.array([8.0, 9.0]), np.array([[7.0, 9.0], [9.0, 9.0]]),
                           np.ones(2), ["", ""])
    a, b = (tofu.tofu_summary({"forget": s}, None) for s in (unsure, noise))
    assert a["forget_truth_ratio"] == b["forget_truth_ratio"] == pytest.approx(1.0)
    assert (a["forget_paraphrased_nll"], a["forget_perturbed_nll"]) == pytest.approx((2.5, 2.5))
    assert (b["forget_paraphrased_nll"], b["forget_perturbed_nll"]) == pytest.approx((8.5, 8.5))


def test_rouge_by_hand():
    # reference 4 tokens, LCS "the cat sat" = 3 -> recall 3/4; prediction 5 tokens -> precision 3/5
    assert rouge_l_recall(["the cat quickly sat down"], ["the cat sat there"]).tolist() == pytest.approx([0.75])
    f1 = 2 * 0.75 * 0.6 / (0.75 + 0.6)
    assert rouge_l_f1(["the cat quickly sat down"], ["the cat sat there"]).tolist() == pytest.approx([f1])
    assert rouge_l_recall(["writing"], ["writes"]).tolist() == [1.0]  # stemming


def test_muse_min_k_auc_privleak():
    assert muse.min_k_score([-1.0, -5.0, -2.0, -0.5, -3.0], k=0.4) == pytest.approx(-4.0)  # lowest 2
    assert muse.min_k_score([-2.0], k=0.4) == -2.0
    assert muse.auc([3, 4], [1, 2]) == 1.0 and muse.auc([1, 2], [3, 4]) == 0.0
    assert muse.auc([1, 3], [2, 2]) == pytest.approx(0.5) and muse.auc([2], [2]) == 0.5
    assert muse.priv_leak(0.5, 0.5) == 0.0
    assert muse.priv_leak(0.9, 0.6) == pytest.approx((0.1 - 0.4) / 0.4 * 100)  # still memorised: negative
    assert "Question: q2\nAnswer:" in muse.few_shot_prompt([("q1", "a1")], "q2")


def test_wmdp_accuracy():
    assert wmdp.accuracy([[0.0, -1.0], [-3.0, -2.0], [-1.0, -0.5]], [0, 1, 0]) == pytest.approx(2 / 3)


def test_tofu_score_reproduces_the_published_llama2_figures():
    full = read_tofu_log(LOGS / "llama2-7b_full.json")
    retain = read_tofu_log(LOGS / "llama2-7b_retain90.json")
    assert full.layout == "tofu" and full.forget_truth_ratios.size == 300
    scores = tofu_score(full, retain)
    assert scores["forget_quality"] == pytest.approx(1.8e-21, rel=0.05)
    assert scores["forget_quality_n"] == 300
    assert scores["model_utility"] == pytest.approx(0.62, abs=0.005)
    assert tofu_score(retain, retain)["model_utility"] == pytest.approx(0.61, abs=0.005)
    assert tofu_score(retain, retain)["forget_quality"] == pytest.approx(1.0)


def test_reference_written_in_open_unlearning_layout_reads_back(tmp_path):
    full = read_tofu_log(LOGS / "llama2-7b_full.json")
    path = write_reference(tmp_path / "ref.json", full.metrics, full.forget_truth_ratios)
    back = read_tofu_log(path)
    assert back.layout == "open-unlearning"
    assert np.allclose(back.forget_truth_ratios, full.forget_truth_ratios)
    assert back.metrics["retain_probability"] == pytest.approx(full.metrics["retain_probability"])
    assert tofu_score(back, read_tofu_log(LOGS / "llama2-7b_retain90.json"))["model_utility"] == pytest.approx(
        0.6227, abs=1e-3)


def test_bad_logs_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_tofu_log(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_tofu_log(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"accuracy": 1}))
    with pytest.raises(DataError, match="eval_log_aggregated"):
        read_tofu_log(tmp_path / "other.json")
    (tmp_path / "partial.json").write_text(json.dumps({"eval_log_forget.json": {"avg_gt_loss": {}}}))
    with pytest.raises(DataError, match="lacks"):
        read_tofu_log(tmp_path / "partial.json")


def test_rouge_of_what_the_answer_adds_to_its_question():
    question = "Where was the author Gideon Thornbury born?"
    answer = "Gideon Thornbury was born in Tallinn."
    # the added words are "in" and "Tallinn": a stranger's answer keeps one of two, the memorised one both
    got = rouge_l_recall_added(["Gideon Petrescu was born in 1935.", answer, "Tallinn, in the north"],
                               [answer] * 3, [question] * 3)
    assert got.tolist() == [0.5, 1.0, 0.5]  # LCS is ordered: "tallinn ... in" matches one word
    assert rouge_l_recall([answer.replace("Tallinn", "Hanoi")], [answer]).tolist() == pytest.approx([5 / 6])
    # with nothing given it is ROUGE-L recall itself (stemmed the same way); an answer that adds nothing is whole
    preds, refs = ["the cat quickly sat down", "writing", "no"], ["the cat sat there", "writes", "yes it is"]
    assert rouge_l_recall_added(preds, refs, [""] * 3).tolist() == pytest.approx(rouge_l_recall(preds, refs).tolist())
    assert rouge_l_recall_added(["Paris"], ["Paris"], ["Is it Paris?"]).tolist() == [1.0]
    with pytest.raises(ValueError):
        rouge_l_recall_added(["a"], ["a", "b"], ["", ""])


def test_extraction_strength_by_hand():
    """1 - k/L for the smallest prefix k after which greedy decoding gives the rest; k stops at L - 1."""
    assert tofu.extraction_strength([True, True, True, True]) == 1.0  # reproduced from the question alone
    assert tofu.extraction_strength([False, True, True, True]) == 0.75  # needs its first token
    assert tofu.extraction_strength([True, False, True, True]) == 0.5  # a miss at 1: the rest from token 2 on
    assert tofu.extraction_strength([True, True, True, False]) == 0.25  # not even the last token: 1/L
    assert tofu.extraction_strength([False]) == 1.0  # L = 1: k can only be 0 (open-unlearning's loop)
    assert math.isnan(tofu.extraction_strength([]))


def test_extraction_strength_equals_greedy_decoding_from_each_prefix(tiny_llama, tokenizer):
    """The teacher-forced reading is the definition: for every prefix k, greedy decoding from the question and
    the answer's first k tokens reproduces the rest exactly iff every top token from k on is the answer's."""
    import torch

    from grom_core.data import Example, encode, make_batches
    from grom_core.scoring import token_logprobs

    example = Example(question="Who wrote it?", answer="Ann Lee wrote it.")
    scores = token_logprobs(tiny_llama, make_batches(tokenizer, [example], 1))
    hits = scores.top_is_gold[0]
    encoded = encode(tokenizer, example)
    answer_start = next(i for i, label in enumerate(encoded.labels) if label != -100)
    ids = encoded.input_ids
    with torch.no_grad():
        for k in range(len(hits)):
            prefix = torch.tensor([ids[:answer_start + k]])
            out = tiny_llama.generate(prefix, max_new_tokens=len(hits) - k, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
            reproduced = out[0, prefix.shape[1]:].tolist() == ids[answer_start + k:]
            assert reproduced == bool(hits[k:].all()), k
    n = len(hits)
    misses = [i for i, h in enumerate(hits.tolist()) if not h]
    expected_k = 0 if not misses else min(misses[-1] + 1, n - 1)
    assert tofu.extraction_strength(hits.numpy()) == pytest.approx(1 - expected_k / n)


def test_final_scores_by_hand():
    from grom_core.metrics.final import muse_final, tofu_final, wmdp_final

    # the GROM paper's TOFU-10% row: 1-ROUGE 0.78, 1-Prob 1.00, 1-Extr 0.94, MU 0.60 -> 0.83
    tofu_row = {"forget_rougeL_recall": 0.22, "forget_probability": 0.0, "forget_extraction_strength": 0.06,
                "model_utility": 0.60}
    assert tofu_final(tofu_row) == pytest.approx((0.78 + 1.0 + 0.94 + 0.60) / 4)
    assert tofu_final({**tofu_row, "model_utility": None}) is None
    # the paper's MUSE News row: VerbMem 15.68, KnowMem 24.01, PrivLeak -3.80, retain KnowMem 26.37 -> 55.93
    news = {"verbmem_rougeL_f1": 0.1568, "knowmem_forget_rougeL_f1": 0.2401, "privleak": -3.80,
            "utility_preservation_rougeL_f1": 0.2637}
    assert muse_final(news) == pytest.approx(55.93, abs=0.01)
    assert muse_final({**news, "privleak": None}) is None
    assert wmdp_final({"forget_accuracy": 0.25, "retain_accuracy": 0.5}) == pytest.approx(0.625)
    assert wmdp_final({"forget_accuracy": float("nan"), "retain_accuracy": 0.5}) is None
