"""Sentence drops: sentence spans, the log-odds gap against brute-force forward passes on cut-down rows, and the
closed form that asks for them where the forget data holds texts."""

import math

import pytest
import torch
from conftest import AUTHORS, FORGET, RETAIN

from grom_core.closed_form import GromParams, resolve_keys_and_drops, run_grom
from grom_core.data import Example, bos_prefix, encode, make_batches
from grom_core.errors import DataError
from grom_core.params import ParamsError
from grom_core.scoring import answer_nll
from grom_core.sentence_drops import sentence_drops, sentence_ender, sentence_spans


def biographies(authors):
    """One text per author: its QA answers, one sentence each, in a row."""
    by_name = {a.name: [ex.answer for ex in [*FORGET, *RETAIN] if a.name in ex.question] for a in authors}
    return [Example(text=" ".join(answers)) for answers in by_name.values() if answers]


def test_sentence_spans_split_after_every_sentence_end():
    ends = {9}.__contains__
    assert list(sentence_spans([0, 1, 2, 9, 3, 9, 4], 1, ends)) == [(1, 4), (4, 6), (6, 7)]
    assert list(sentence_spans([0, 1, 9], 1, ends)) == [(1, 3)]  # an end on the last token: no empty span
    assert list(sentence_spans([0, 9, 9], 0, ends)) == [(0, 2), (2, 3)]


def test_sentence_ender_reads_the_tokens_text(tokenizer):
    ids = tokenizer.encode("born in Lisbon.\nHe", add_special_tokens=False)
    ends = sentence_ender(tokenizer)
    marks = [ends(i) for i in ids]
    assert marks[-1] is False and any(marks)  # the full stop (or the line break) ends a sentence, "He" does not
    assert not any(ends(i) for i in tokenizer.encode("born in Lisbon", add_special_tokens=False))


def _rating(model, ids, index):
    """log p(ids[index] | ids[:index]) by one forward pass over ids[:index] alone."""
    with torch.no_grad():
        return float(model(torch.tensor([ids[:index]])).logits[0, -1].double().log_softmax(-1)[ids[index]])


def test_drops_are_the_log_odds_gap_to_the_own_sentence_by_brute_force(trained):
    model, tokenizer = trained
    forget = [*biographies(AUTHORS[:1]), FORGET[0]]  # a text and a QA pair
    batches = make_batches(tokenizer, forget, 4, 160)
    found = sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=0.0, batch_size=3)
    ends = sentence_ender(tokenizer)
    qa_prefix = bos_prefix(tokenizer) + tokenizer.encode("Question: \nAnswer:", add_special_tokens=False)
    expected = []
    for ex in forget:
        enc = encode(tokenizer, ex, 160)
        ids = enc.input_ids
        first = next(i for i, label in enumerate(enc.labels) if label != -100)
        prefix = bos_prefix(tokenizer) if ex.text is not None else qa_prefix
        for index in range(first, len(ids)):
            start = max(i + 1 for i in range(first - 1, index) if i < first or ends(ids[i]))  # its sentence's start
            p = _rating(model, ids, index)
            q = _rating(model, prefix + ids[start:index + 1], len(prefix) + index - start)
            expected.append(max(0.0, math.log(math.exp(p) / -math.expm1(p)) - math.log(math.exp(q) / -math.expm1(q))))
    assert found.positions_before == len(expected) == found.drops.numel()
    assert torch.allclose(found.drops, torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-5)
    # the facts are memorised beyond what their sentence says: some tokens get a large gap, template words none
    assert max(expected) > 2.0 and min(expected) == 0.0
    kept = sentence_drops(model, tokenizer, forget, batches, "qa", gain=2.0, min_gap=0.5, batch_size=3)
    assert torch.equal(kept.drops, 2.0 * found.drops[found.drops >= 0.5])
    assert sum(b.num_supervised for b in kept.batches) == kept.drops.numel()
    with pytest.raises(DataError, match="memorised"):
        sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=1e6, batch_size=3)


def test_auto_picks_sentence_drops_for_texts_and_refuses_them_where_they_cannot_apply():
    texts, qa = biographies(AUTHORS[:2]), list(FORGET)
    named = [Example(question=ex.question, answer=ex.answer, subject=AUTHORS[0].name) for ex in FORGET[:3]
             if AUTHORS[0].name in ex.question]
    params = GromParams()
    assert resolve_keys_and_drops(params, texts + qa) == ("answer", "sentence")
    assert resolve_keys_and_drops(params, qa) == ("answer", "specificity")  # QA pairs without subjects
    assert resolve_keys_and_drops(params, named + texts) == ("answer", "counterfactual")
    assert resolve_keys_and_drops(params.replace(target="corrupt"), texts) == ("answer", "specificity")
    assert resolve_keys_and_drops(params.replace(drops="sentence"), qa) == ("answer", "sentence")
    with pytest.raises(DataError, match="drops='sentence' needs keys='answer'"):
        resolve_keys_and_drops(params.replace(drops="sentence", target="corrupt"), texts)
    with pytest.raises(ParamsError, match="'sentence'"):
        GromParams(drops="sentences").validate()


def test_closed_form_with_sentence_drops_forgets_texts_and_keeps_retain(trained):
    model, tokenizer = trained
    forget, retain = biographies(AUTHORS[:2]), [*biographies(AUTHORS[2:]), *RETAIN]
    run = run_grom(model, tokenizer, forget, retain, GromParams(influence=False))
    assert run.edit.metadata["drops"] == "sentence"
    nll = lambda exs: float(answer_nll(model, make_batches(tokenizer, exs, 16, 160)).mean())  # noqa: E731
    before_f, before_r = nll(forget), nll(retain)
    with run.edit.applied(model):
        after_f, after_r = nll(forget), nll(retain)
    assert after_f > before_f + 0.2 and after_r < before_r + 0.1
    fit = run.edit.metadata["retain_budget"]
    assert fit is not None and fit["damage"] <= 0.04  # the budget reads the retain sample for these drops too
