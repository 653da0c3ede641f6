"""Counterfactual drops: names, alignment, the log-odds gap against brute-force forward passes, and the closed form
that asks for them."""

import math

import pytest
import torch
from conftest import AUTHORS, FORGET, RETAIN

from grom_core.adapter import ModelAdapter
from grom_core.counterfactual import (
    aligned,
    counterfactual_drops,
    invented_names,
    logit,
    other_questions,
    replacement_names,
    rewrite,
    strangers,
)
from grom_core.data import Example, encode, make_batches
from grom_core.errors import DataError, ParamsError
from grom_core.grom import GromParams, run_grom
from grom_core.scoring import answer_nll

NAMES = [a.name for a in AUTHORS]


def named(examples):
    return [Example(question=ex.question, answer=ex.answer, subject=next(n for n in NAMES if n in ex.question))
            for ex in examples]


def test_replacement_names_make_subjects_the_data_never_mentions():
    text = "aurelio marlowe wrote. basira marlowe lives. corvin okonkwo sings."
    pool = ["Aurelio", "Basira", "Corvin", "Delphine"]
    names = replacement_names("Aurelio Marlowe", 3, 0, pool, text)
    assert names[:2] == sorted(["Corvin", "Delphine"], key=names.index)  # Basira Marlowe exists: not taken
    assert set(names[:2]) == {"Corvin", "Delphine"} and names[2] not in pool  # then an invented one
    assert replacement_names("Aurelio Marlowe", 3, 0, pool, text) == names  # seeded
    one_word = replacement_names("France", 2, 0, ["Spain"], "")
    assert "Spain" not in one_word and len(set(one_word)) == 2  # a one-word subject gets invented names only
    invented = invented_names(20, 1, "kalo velkaro")
    assert len(set(invented)) == 20 and all(n.lower() not in "kalo velkaro" for n in invented)
    assert rewrite(Example(question="Where was Aurelio Marlowe born?", answer="Aurelio Marlowe was born in Lisbon.",
                           subject="Aurelio Marlowe"), "Corvin Marlowe").answer == "Corvin Marlowe was born in Lisbon."
    assert strangers("Aurelio Marlowe", 3, 0, pool, text) == [f"{n} Marlowe" for n in names]
    whole = strangers("Aurelio Marlowe", 3, 0, pool, text, rename="whole")
    assert [w.split()[0] for w in whole] == names and not {w.split()[1] for w in whole} & {"Marlowe", *pool}


def test_alignment_maps_the_text_around_a_replaced_span():
    original = [1, 2, 3, 9, 9, 4, 5, 3, 9, 9, 6]
    rewritten = [1, 2, 3, 7, 4, 5, 3, 7, 6]  # the two-token name 9 9 became the one-token name 7
    where = aligned(original, rewritten)
    assert [where.get(i) for i in range(len(original))] == [0, 1, 2, None, None, 4, 5, 6, None, None, 8]


def test_logit_from_log_probability_is_exact_near_one():
    for p in (0.5, 0.1, 1 - 1e-9):
        assert float(logit(torch.tensor(math.log(p), dtype=torch.float64))) == pytest.approx(
            math.log(p / (1 - p)), rel=1e-6)


def test_drops_are_the_log_odds_gap_to_the_rewrites_by_brute_force(trained):
    model, tokenizer = trained
    forget = named(FORGET[:4])
    batches = make_batches(tokenizer, forget, 4, 96)
    text = " ".join(f"{ex.question} {ex.answer}" for ex in [*FORGET, *RETAIN])
    pool = [n.split()[0] for n in NAMES]
    found = counterfactual_drops(model, tokenizer, forget, batches, "qa", k=2, gain=1.0, min_gap=0.0, seed=0,
                                 batch_size=4, max_length=96, avoid=text, pool=pool)
    assert found.rewrites == 8 and found.positions_before == sum(b.num_supervised for b in batches)
    # example 0, by hand: every answer position, p from the example, q from the two rewrites at the aligned token
    ex = forget[0]
    ids = encode(tokenizer, ex, 96).input_ids
    names = strangers(ex.subject, 2, 0, pool, text.lower())
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        others = [encode(tokenizer, rewrite(ex, n), 96).input_ids for n in names]
        olps = [model(torch.tensor([o])).logits[0].double().log_softmax(-1) for o in others]
    labels = encode(tokenizer, ex, 96).labels
    expected = []
    for t in range(len(ids) - 1):
        if labels[t + 1] == -100:
            continue
        qs = [float(olp[aligned(ids, o)[t + 1] - 1, ids[t + 1]].exp()) for o, olp in zip(others, olps, strict=True)
              if t + 1 in aligned(ids, o)]
        p = float(lp[t, ids[t + 1]].exp())
        gap = 0.0 if not qs else max(0.0, math.log(p / (1 - p)) - math.log(sum(qs) / len(qs) /
                                                                           (1 - sum(qs) / len(qs))))
        expected.append(gap)
    got = found.drops[:len(expected)]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    # the model knows these facts: the value words are asked for, the answer's copy of the name is not
    assert max(expected) > 2.0 and min(expected) == 0.0


def test_min_gap_keeps_only_positions_that_carry_the_fact(trained):
    model, tokenizer = trained
    forget = named(FORGET[:4])
    batches = make_batches(tokenizer, forget, 4, 96)
    kw = dict(k=2, seed=0, batch_size=4, max_length=96, avoid="", pool=[n.split()[0] for n in NAMES])
    every = counterfactual_drops(model, tokenizer, forget, batches, "qa", gain=2.0, min_gap=0.0, **kw)
    kept = counterfactual_drops(model, tokenizer, forget, batches, "qa", gain=2.0, min_gap=0.5, **kw)
    assert torch.equal(kept.drops, every.drops[every.drops >= 2.0 * 0.5])
    assert sum(b.num_supervised for b in kept.batches) == kept.drops.numel() < every.drops.numel()
    with pytest.raises(DataError, match="does not seem to know"):
        counterfactual_drops(model, tokenizer, forget, batches, "qa", gain=1.0, min_gap=1e6, **kw)


def test_whole_name_strangers_leave_no_drop_on_the_name(trained):
    model, tokenizer = trained
    forget = named(FORGET[:4])
    batches = make_batches(tokenizer, forget, 4, 96)
    pool = [n.split()[0] for n in NAMES]
    kw = dict(k=2, gain=1.0, min_gap=0.5, seed=0, batch_size=4, max_length=96, avoid="", pool=pool)
    on_name = {}
    for rename in ("first", "whole"):
        found = counterfactual_drops(model, tokenizer, forget, batches, "qa", rename=rename, **kw)
        on_name[rename] = 0
        for batch in found.batches:
            for row, i in enumerate(batch.example_ids.tolist()):
                ids = batch.input_ids[row].tolist()
                stranger = encode(tokenizer, rewrite(forget[i], strangers(forget[i].subject, 1, 9, pool, "",
                                                                          rename="whole")[0]), 96).input_ids
                name = set(range(len(ids))) - set(aligned(ids, stranger))  # the name's tokens (and padding)
                targets = {t for t in range(1, len(ids)) if batch.labels[row, t] != -100}
                on_name[rename] += len(targets & name)
    # the tiny model completes the surname of an author it learnt, not a stranger's: with the first name replaced
    # the drops lower it too; with the whole name replaced none does
    assert on_name["first"] > 0 and on_name["whole"] == 0


def test_closed_form_with_counterfactual_drops_forgets_and_keeps_retain(trained):
    model, tokenizer = trained
    forget = named(FORGET)
    params = GromParams(influence=False)
    run = run_grom(model, tokenizer, forget, RETAIN, params)
    assert run.plan.drops == "counterfactual"  # auto: subjects named, answer keys
    nll = lambda exs: float(answer_nll(model, make_batches(tokenizer, exs, 16)).mean())  # noqa: E731
    before_f, before_r = nll(FORGET), nll(RETAIN)
    with run.edit.applied(model):
        after_f, after_r = nll(FORGET), nll(RETAIN)
    # the subject's bag lowers many tokens a little, not the trained answers a lot (0.003 -> 0.5 nats here)
    assert after_f > before_f + 0.3 and after_r < before_r + 0.1
    plain = run_grom(model, tokenizer, FORGET, RETAIN, params)  # no subjects: the specificity drops
    assert plain.plan.drops == "specificity"
    with pytest.raises(DataError, match="name their subject"):
        run_grom(model, tokenizer, FORGET, RETAIN, params.replace(drops="counterfactual"))
    with pytest.raises(DataError, match="keys='answer'"):
        run_grom(model, tokenizer, forget, RETAIN, params.replace(drops="counterfactual", keys="subject"))


def test_retain_budget_scales_the_update_until_the_retain_sample_fits(trained):
    model, tokenizer = trained
    forget = named(FORGET)
    band = tuple(run_grom(model, tokenizer, forget, RETAIN, GromParams(influence=False)).plan.layers)
    # layers named: one solve, scaled as a whole (the library's own band is scaled first, test_grom)
    free = run_grom(model, tokenizer, forget, RETAIN, GromParams(layers=band, retain_budget=None, influence=False))
    fitted = run_grom(model, tokenizer, forget, RETAIN, GromParams(layers=band, influence=False))
    fit = fitted.manifest.scaling.budget
    assert free.manifest.scaling.budget is None
    # on 2 of 8 authors the full gain costs the retain answers far more than the budget: scaled down to fit
    assert fit.damage_unscaled > 0.05 >= fit.damage and 0 < fit.scale < 1
    for name, delta in fitted.edit.deltas.items():
        assert torch.allclose(delta.full(), fit.scale * free.edit.deltas[name].full(), atol=1e-12)
        # the solve records describe the scaled update: the audit explains the edit that was made
        assert torch.allclose(fitted.records[name].targets, fit.scale * free.records[name].targets)
    sample = make_batches(tokenizer, RETAIN, 16)
    with fitted.edit.applied(model):
        after = float(answer_nll(model, sample).mean())
    assert after - float(answer_nll(model, sample).mean()) < 0.1  # the whole retain set stays near the budget


def test_a_subjects_bag_is_lowered_by_the_lm_head_and_the_layers_lower_each_positions_own_token(trained):
    model, tokenizer = trained
    forget = named(FORGET)
    adapter = ModelAdapter.for_model(model)
    head = adapter.lm_head_name
    run = run_grom(model, tokenizer, forget, RETAIN, GromParams(influence=False, retain_budget=None, layers=()))
    assert run.layers == [] and list(run.edit.deltas) == [head]  # the head alone: its rows are tokens
    record = run.records[head]
    bag = set(record.target_rows.tolist())
    per_position = (record.targets != 0).sum(dim=0)
    assert per_position.min() > 1  # not only its gold token: every token flagged for the subject
    # every position of one subject is asked for the same bag
    first = record.example_ids == record.example_ids[0]
    same_subject = torch.tensor([forget[int(i)].subject == forget[int(record.example_ids[0])].subject
                                 for i in record.example_ids])
    asked = record.targets != 0
    assert torch.equal(asked[:, same_subject], asked[:, first][:, :1].expand(-1, int(same_subject.sum())))
    rows = run.edit.deltas[head].row_index
    assert set(rows.tolist()) <= bag  # no other token's logit changes, on any input
    # with layers named, they lower each position's own gold token; the head takes the rest of the bag; the
    # defaults do the same with the attributed band, solved with the head (counterfactual drops are not body first)
    layered = run_grom(model, tokenizer, forget, RETAIN, GromParams(influence=False, retain_budget=None,
                                                                    layers=(1, 2)))
    assert layered.layers == [1, 2]
    default = run_grom(model, tokenizer, forget, RETAIN, GromParams(influence=False))
    assert default.layers and set(default.edit.modules) == {*(adapter.down_proj_names[i] for i in default.layers),
                                                            head}
    assert set(default.records[head].target_rows.tolist()) <= bag and default.plan.placement == "joint"
    for each, name in [*((layered, n) for n in adapter.down_proj_names[1:3]),
                       *((default, adapter.down_proj_names[i]) for i in default.layers)]:
        rec = each.records[name]
        u = adapter.unembedding(rec.tokens)  # (s, hidden): the gold token's direction at each position
        cos = torch.nn.functional.cosine_similarity(rec.targets.T, u, dim=1)
        moving = rec.targets.norm(dim=0) > 0
        assert moving.any() and torch.allclose(cos[moving], -torch.ones(int(moving.sum()), dtype=torch.float64))
    assert set(layered.records[head].target_rows.tolist()) == bag


def test_other_questions_pair_each_answer_with_the_next_questions_of_its_subject():
    rows = [Example(question=f"Q{i} about {s}?", answer=f"A{i} of {s}.", subject=s)
            for i, s in enumerate(["Ann Lee", "Ann Lee", "Ann Lee", "Bo Kim"])]
    rows.append(Example(question="Q4 about nobody?", answer="A4."))  # no subject: nothing to pair it with
    extra, sources = other_questions(rows, 1)
    assert [(e.question, e.answer) for e in extra] == [("Q1 about Ann Lee?", "A0 of Ann Lee."),
                                                       ("Q2 about Ann Lee?", "A1 of Ann Lee."),
                                                       ("Q0 about Ann Lee?", "A2 of Ann Lee.")]
    assert sources == [0, 1, 2] and all(e.subject == "Ann Lee" for e in extra)  # Bo Kim has one row: no other
    extra, sources = other_questions(rows, 5)  # at most every other question of the subject, never its own
    assert sources == [0, 1, 2, 0, 1, 2] and len({(e.question, e.answer) for e in extra}) == 6
    assert all(e.question[:2] != e.answer[:2].replace("A", "Q") for e in extra)
    assert other_questions(rows, 0) == ([], [])
    with pytest.raises(DataError, match="contexts"):
        other_questions(rows, -1)


def test_answers_read_after_other_questions_are_keys_of_their_own_example(trained):
    model, tokenizer = trained
    forget = named(FORGET)
    head = ModelAdapter.for_model(model).lm_head_name
    params = GromParams(retain_budget=None)
    alone = run_grom(model, tokenizer, forget, RETAIN, params.replace(counterfactual={"contexts": 0}))
    paired = run_grom(model, tokenizer, forget, RETAIN, params)  # the default: one other question each
    assert GromParams().counterfactual.contexts == 1
    # more forget positions, every one credited to an example the user gave: its audit covers the user's rows
    assert paired.manifest.forget_positions > alone.manifest.forget_positions
    ids = paired.records[head].example_ids
    assert int(ids.max()) < len(forget)
    assert torch.equal(paired.influence[head].example_ids, alone.influence[head].example_ids)
    # the same subjects' bags, asked at more keys: the same rows of the head move, by other amounts
    assert set(paired.edit.deltas[head].row_index.tolist()) >= set(alone.edit.deltas[head].row_index.tolist())
    assert not torch.allclose(paired.edit.deltas[head].full(), alone.edit.deltas[head].full())
    with pytest.raises(ParamsError, match="contexts"):
        GromParams.from_dict({"counterfactual": {"contexts": -1}})
