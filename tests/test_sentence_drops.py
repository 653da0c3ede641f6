"""Sentence drops: sentence spans, the log-odds gap against brute-force forward passes on cut-down rows, and the
closed form that asks for them where the forget data holds texts."""

import math

import pytest
import torch
from conftest import AUTHORS, FORGET, RETAIN

from grom_core.data import Example, bos_prefix, encode, make_batches
from grom_core.errors import DataError
from grom_core.grom import GromParams, run_grom
from grom_core.grom.plan import resolve_keys_and_drops
from grom_core.params import ParamsError
from grom_core.scoring import answer_nll
from grom_core.sentence_drops import QuestionPool, sentence_drops, sentence_ender, sentence_spans


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


def _brute_force_gaps(model, tokenizer, forget, questions, swaps):
    """Every supervised position's gap, each cut-down rating by a forward pass of its own."""
    ends = sentence_ender(tokenizer)
    gaps = []
    for ex in forget:
        enc = encode(tokenizer, ex, 160)
        ids = enc.input_ids
        first = next(i for i, label in enumerate(enc.labels) if label != -100)
        prefixes = ([bos_prefix(tokenizer)] if ex.text is not None else
                    [bos_prefix(tokenizer) + tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)
                     for q in QuestionPool(questions).nearest(ex.question, swaps)])
        for index in range(first, len(ids)):
            start = max(i + 1 for i in range(first - 1, index) if i < first or ends(ids[i]))  # its sentence's start
            p = _rating(model, ids, index)
            q = max(_rating(model, prefix + ids[start:index + 1], len(prefix) + index - start) for prefix in prefixes)
            gaps.append(max(0.0, math.log(math.exp(p) / -math.expm1(p)) - math.log(math.exp(q) / -math.expm1(q))))
    return torch.tensor(gaps, dtype=torch.float64)


@pytest.mark.parametrize("swapped", [False, True])
def test_drops_are_the_log_odds_gap_to_the_own_sentence_by_brute_force(trained, swapped):
    model, tokenizer = trained
    forget = [*biographies(AUTHORS[:1]), FORGET[0]]  # a text and a QA pair
    # without retain questions a QA row's answer is rated after an empty question, else after its 3 nearest
    questions = [ex.question for ex in RETAIN] if swapped else []
    batches = make_batches(tokenizer, forget, 4, 160)
    found = sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=0.0, batch_size=3,
                           questions=questions, swaps=3)
    expected = _brute_force_gaps(model, tokenizer, forget, questions, 3)
    assert found.positions_before == expected.numel() == found.drops.numel()
    assert torch.allclose(found.drops, expected, rtol=1e-4, atol=1e-5)
    # the facts are memorised beyond what their sentence says: some tokens get a large gap, template words none
    assert float(expected.max()) > 2.0 and float(expected.min()) == 0.0
    kept = sentence_drops(model, tokenizer, forget, batches, "qa", gain=2.0, min_gap=0.5, batch_size=3,
                          questions=questions, swaps=3)
    assert torch.equal(kept.drops, 2.0 * found.drops[found.drops >= 0.5])
    assert sum(b.num_supervised for b in kept.batches) == kept.drops.numel()
    with pytest.raises(DataError, match="memorised"):
        sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=1e6, batch_size=3)


def test_swapped_questions_leave_the_answers_template_words_out(trained):
    """An answer's words that any question of its kind makes likely get no gap after a swap, though an empty
    question gives them one; the words that name the fact keep theirs."""
    model, tokenizer = trained
    forget = [ex for ex in FORGET if ex.question.startswith("Where was")][:2]
    questions = [ex.question for ex in RETAIN]
    batches = make_batches(tokenizer, forget, 4, 160)
    empty, swapped = (sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=0.0,
                                     batch_size=8, questions=qs, swaps=4).drops for qs in ([], questions))
    # "was born in" after another author's question is as likely as after this one: most positions keep no gap
    assert int((swapped < 0.5).sum()) >= swapped.numel() // 2 > int((empty < 0.5).sum())
    assert float(swapped.max()) > 2.0  # the birthplace itself is still far above what another author's gives


def test_a_swap_longer_than_max_length_is_left_out(trained):
    """A retain question too long to fit `max_length` with the answer is not read; the empty question stands in
    when no swap fits."""
    model, tokenizer = trained
    forget = [FORGET[0]]
    batches = make_batches(tokenizer, forget, 4, 160)
    near = RETAIN[0].question
    long = "Where was the author " + "very " * 80 + "well known born?"
    drops = lambda qs, n=None: sentence_drops(model, tokenizer, forget, batches, "qa", gain=1.0,  # noqa: E731
                                              min_gap=0.0, batch_size=4, questions=qs, swaps=2, max_length=n).drops
    assert torch.equal(drops([near, long], 60), drops([near]))
    assert not torch.equal(drops([near, long]), drops([near]))  # without a limit the long question is read
    assert torch.equal(drops([long], 60), drops([]))  # nothing fits: the empty question


def test_nearest_questions_share_the_most_words_and_leave_the_question_itself_out():
    pool = QuestionPool(["Where was Ana Silva born?", "What did Ana Silva write?", "Where was Tom Berg born?",
                         "Where was Ana Reyes born?", "Who wrote it?", "Where was Tom Berg born?"])
    assert pool.nearest("Where was Ana Silva born?", 2) == ["Where was Ana Reyes born?", "Where was Tom Berg born?"]
    assert pool.nearest("Where was Ana Silva born?", 9) == ["Where was Ana Reyes born?", "Where was Tom Berg born?",
                                                            "What did Ana Silva write?", "Who wrote it?"]  # once each
    assert QuestionPool([]).nearest("Anything?", 3) == [""]  # no retain questions: the empty question
    assert QuestionPool(["Who wrote it?"]).nearest("Who wrote it?", 3) == [""]
    assert pool.nearest("Who wrote it?", 0) == [""]  # swaps=0: the empty question


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
    assert run.plan.drops == "sentence"
    assert run.layers == list(range(model.config.num_hidden_layers))  # every layer, no attributed band
    nll = lambda exs: float(answer_nll(model, make_batches(tokenizer, exs, 16, 160)).mean())  # noqa: E731
    before_f, before_r = nll(forget), nll(retain)
    with run.edit.applied(model):
        after_f, after_r = nll(forget), nll(retain)
    assert after_f > before_f + 0.2 and after_r < before_r + 0.1
    fit = run.manifest.scaling.budget
    assert fit is not None and fit.damage <= 0.04  # the budget reads the retain sample for these drops too
