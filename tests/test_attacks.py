"""The attacks that read around an edit: exact against brute force, restoring every bit, and the positive control
(a head-only edit that the base head reads straight back)."""

import dataclasses

import pytest
import torch
from conftest import AUTHORS, FORGET, RETAIN

from grom_core.adapter import ModelAdapter
from grom_core.attacks import (
    ATTACKS,
    HEAD_SWAP,
    HELDOUT_ACCURACY,
    HELDOUT_PROBABILITY,
    AttackKit,
    RelearnRecipe,
    head_swapped,
    heldout_metrics,
    lens,
    lens_layers,
    relearned,
    split_halves,
)
from grom_core.data import Example
from grom_core.fingerprint import weights_fingerprint
from grom_core.grom import GromParams, run_grom
from grom_core.scoring import answer_probability


def _ids(tokenizer, text="Question: Who wrote it?\nAnswer: a name"):
    return torch.tensor([tokenizer.encode(text)])


def test_lens_at_a_layer_is_that_layers_residual_through_the_final_norm_and_the_base_head(tiny_llama, tokenizer):
    model = tiny_llama
    adapter = ModelAdapter.for_model(model)
    ids = _ids(tokenizer)
    base_head = torch.randn_like(model.lm_head.weight)
    fingerprint = weights_fingerprint(model)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states  # embeddings, then each block's
        for layer in range(adapter.num_layers):
            with lens(model, adapter, layer, base_head):
                got = model(input_ids=ids).logits
            # the last entry of hidden_states is already normed; the others are the raw residual stream
            residual = hidden[layer + 1] if layer < adapter.num_layers - 1 else None
            if residual is not None:
                expected = adapter.final_norm(residual) @ base_head.T
                assert torch.allclose(got, expected, atol=1e-5)
        with head_swapped(model, base_head):
            swapped = model(input_ids=ids).logits
        with lens(model, adapter, adapter.num_layers - 1, base_head):
            top = model(input_ids=ids).logits
    assert torch.allclose(swapped, top, atol=1e-6)  # the lens at the last layer is the head swap
    assert torch.allclose(swapped, hidden[-1] @ base_head.T, atol=1e-5)
    assert len(model.model.layers) == adapter.num_layers == model.config.num_hidden_layers
    assert weights_fingerprint(model) == fingerprint  # every bit restored


def test_lens_generates_on_gpt2_too(tiny_gpt2, tokenizer):
    model = tiny_gpt2
    adapter = ModelAdapter.for_model(model)
    adapter.untie_lm_head()
    base_head = model.lm_head.weight.detach().clone()
    with torch.no_grad(), lens(model, adapter, 0, base_head):
        out = model.generate(input_ids=_ids(tokenizer), max_new_tokens=3, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == _ids(tokenizer).shape[1] + 3 and len(model.transformer.h) == 3


def test_lens_layers_cover_the_second_half_below_the_last():
    assert lens_layers(30) == [15, 19, 24, 28]
    assert lens_layers(4) == [2]
    assert lens_layers(1) == [0]
    assert all(layer < 29 for layer in lens_layers(30, 8))


def test_split_halves_share_no_fact():
    rows = [Example(question=f"The capital of {c} is", answer=a) for c, a in
            [("France", "Paris"), ("France!", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Chad", "N'Djamena")]]
    trained, held = split_halves(rows)
    assert {r.answer for r in trained}.isdisjoint({r.answer for r in held})
    assert len(trained) + len(held) == len(rows) and trained and held
    named = [Example(question=f"{s} was born in", answer="Oslo", subject=s) for s in ("Ann", "Bo", "Cy")]
    assert len(split_halves(named)[0]) == 1  # grouped by subject, not by the shared answer
    with pytest.raises(ValueError, match="at least 2 facts"):
        split_halves(rows[:2])


def test_relearning_restores_every_bit_and_lowers_the_loss_it_trains(trained):
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    rows = FORGET[:4]
    new = [Example(question=ex.question, answer="an answer it never saw") for ex in RETAIN[:4]]
    before = answer_probability(model, tokenizer, RETAIN[:8])
    with relearned(model, tokenizer, new, RelearnRecipe(steps=5, lr=1e-3, batch_size=4)) as losses:
        assert len(losses) == 5 and losses[-1] < losses[0]
        assert weights_fingerprint(model) != fingerprint
        assert not any(p.requires_grad for p in model.parameters())
    assert weights_fingerprint(model) == fingerprint
    assert torch.equal(answer_probability(model, tokenizer, RETAIN[:8]), before)
    assert all(p.grad is None for p in model.parameters())
    assert set(heldout_metrics(model, tokenizer, rows)) == {HELDOUT_PROBABILITY, HELDOUT_ACCURACY}


def test_positive_control_head_swap_recovers_a_head_only_edit_in_full(trained):
    """An attack that cannot fail a method proves nothing: the LM head alone forgets, and the base head reads the
    body's unchanged hidden states back to the base model's answers, bit for bit."""
    model, tokenizer = trained
    ModelAdapter.for_model(model).untie_lm_head()
    base_head = model.lm_head.weight.detach().clone()
    before = answer_probability(model, tokenizer, FORGET)
    run = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(), influence=False, retain_budget=None))
    assert run.edit.modules == ["lm_head"]
    kit = AttackKit(base_head=base_head, forget=FORGET, retain=RETAIN, recovery=("forget_probability",),
                    evaluate=lambda: {"forget_probability": float(answer_probability(model, tokenizer,
                                                                                     FORGET).mean())})
    with run.edit.applied(model):
        edited = kit.evaluate()
        assert edited["forget_probability"] < 0.5 * float(before.mean())
        swapped = kit.run(HEAD_SWAP, model, tokenizer, edited)
    assert swapped["forget_probability"] == pytest.approx(float(before.mean()), abs=1e-6)
    assert swapped["recovery_forget_probability"] > 0.4


def test_an_edit_of_the_body_alone_is_not_read_back_by_the_base_head(trained):
    model, tokenizer = trained
    ModelAdapter.for_model(model).untie_lm_head()
    base_head = model.lm_head.weight.detach().clone()
    run = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(2, 3), edit_lm_head=False, influence=False))
    assert "lm_head" not in run.edit.modules
    kit = AttackKit(base_head=base_head, forget=FORGET, retain=RETAIN, recovery=("forget_probability",),
                    evaluate=lambda: {"forget_probability": float(answer_probability(model, tokenizer,
                                                                                     FORGET).mean())})
    with run.edit.applied(model):
        edited = kit.evaluate()
        swapped = kit.run(HEAD_SWAP, model, tokenizer, edited)
        lensed = kit.run("logit_lens", model, tokenizer, edited)
    assert swapped["recovery_forget_probability"] == pytest.approx(0.0, abs=1e-6)
    assert lensed["lens_layer"] == 2 and "recovery_forget_probability" in lensed


def test_relearn_attacks_read_the_half_they_never_trained(trained):
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    kit = AttackKit(base_head=model.lm_head.weight.detach().clone(), forget=FORGET, retain=RETAIN,
                    recovery=("forget_probability",), evaluate=dict,
                    recipe=RelearnRecipe(steps=3, lr=1e-3, batch_size=4))
    for name in ("relearn", "relearn_retain"):
        out = kit.run(name, model, tokenizer, {})
        assert out["heldout_rows"] + (out["trained_rows"] if name == "relearn" else 0) <= len(FORGET) + len(RETAIN)
        assert f"recovery_{HELDOUT_PROBABILITY}" in out and 0 <= out[HELDOUT_ACCURACY] <= 1
    assert weights_fingerprint(model) == fingerprint
    with pytest.raises(ValueError, match="unknown attack"):
        kit.run("bogus", model, tokenizer, {})
    assert set(ATTACKS) == {"head_swap", "logit_lens", "relearn", "relearn_retain"}
    # one fact cannot be split: relearn says why it did not run, relearn_retain reads the whole fact
    author = AUTHORS[0].name
    facts = [dataclasses.replace(ex, subject=author) for ex in FORGET if author in ex.question]
    one = dataclasses.replace(kit, forget=facts)
    skipped = one.run("relearn", model, tokenizer, {})
    assert skipped["recovery"] is None and "at least 2 facts" in skipped["skipped"]
    assert one.run("relearn_retain", model, tokenizer, {})["heldout_rows"] == len(facts)
    assert weights_fingerprint(model) == fingerprint
