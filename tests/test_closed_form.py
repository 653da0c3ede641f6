import dataclasses
import time

import pytest
import torch
from conftest import FORGET, RETAIN

import grom_core.closed_form as closed_form
from grom_core.adapter import ModelAdapter
from grom_core.capture import collect
from grom_core.closed_form import GromParams, compute_edit, prepare, run_grom
from grom_core.data import make_batches
from grom_core.edit import Edit
from grom_core.errors import DataError, FingerprintMismatchError, ParamsError, UnsupportedArchitectureError
from grom_core.fingerprint import weights_fingerprint
from grom_core.influence import leave_one_out
from grom_core.scoring import answer_probability, gold_margins
from grom_core.statistics import GramStats, MemoryStatsStore


def test_one_call_edit_forgets_and_keeps_retain(trained, capsys):
    model, tokenizer = trained
    forget_before = answer_probability(model, tokenizer, FORGET)
    retain_before = answer_probability(model, tokenizer, RETAIN)
    assert forget_before.mean() > 0.9 and retain_before.mean() > 0.9  # the model did memorise
    fingerprint = weights_fingerprint(model)

    start = time.perf_counter()
    run = run_grom(model, tokenizer, FORGET, RETAIN)
    seconds = time.perf_counter() - start
    assert weights_fingerprint(model) == fingerprint  # computing the edit leaves the model unchanged
    assert run.edit.base_fingerprint == fingerprint
    assert run.edit.modules[-1] == "lm_head" and len(run.edit.modules) == 3
    # body first: the band was solved for the whole drop and scaled to the budget on its own, then the head
    placement = run.edit.metadata["placement"]
    assert 0 < placement["band_scale"] <= 1 and placement["band_damage"] <= GromParams().retain_budget
    assert placement["band_logit_drop"]["achieved_mean"] > 0

    with run.edit.applied(model):
        forget_after = answer_probability(model, tokenizer, FORGET)
        retain_after = answer_probability(model, tokenizer, RETAIN)
    ratio = float(forget_before.mean() / forget_after.mean())
    retain_change = float(retain_after.mean() / retain_before.mean() - 1)
    with capsys.disabled():
        print(f"\n[figures] GROM on the tiny Llama: edit {seconds:.3f} s, forget probability "
              f"{forget_before.mean():.3f} -> {forget_after.mean():.4f} (x{ratio:.1f} lower), retain "
              f"{retain_before.mean():.3f} -> {retain_after.mean():.3f} ({100 * retain_change:+.1f}%), "
              f"layers {run.layers}, stages {({k: round(v, 3) for k, v in run.timings_s.items()})}")
    assert ratio >= 10
    assert abs(retain_change) <= 0.10
    assert weights_fingerprint(model) == fingerprint


def test_a_solve_that_fails_midway_leaves_the_model_as_it_was(trained, monkeypatch):
    """The sequential solve keeps each solved layer's update applied while it collects the next keys; an error in a
    later module's solve must still give every weight back."""
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    real, calls = closed_form.solve_factors, []

    def failing_at_the_head(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # layers 1 and 2 are solved and applied, then the LM head's solve fails
            raise RuntimeError("solver failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(closed_form, "solve_factors", failing_at_the_head)
    with pytest.raises(RuntimeError, match="solver failure"):
        run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(1, 2), influence=False))
    assert len(calls) == 3 and weights_fingerprint(model) == fingerprint


def test_influence_covers_every_forget_example_and_matches_the_contract(trained):
    model, tokenizer = trained
    run = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(2,)))
    for name, report in run.influence.items():
        assert report.example_ids.tolist() == list(range(len(FORGET)))
        assert (report.norms > 0).all() and not report.flagged.any()
        rec, stats = run.records[name], run.retain_stats[name]
        direct = leave_one_out(rec.keys, rec.targets, stats.gram, stats.count, rec.example_ids,
                               w_retain=GromParams().w_retain, ridge=rec.ridge)
        assert direct == pytest.approx(report.as_dict(), rel=1e-9)


def test_cached_retain_statistics_give_the_same_edit(trained):
    model, tokenizer = trained
    params = GromParams(layers=(1, 2), influence=False)
    first = run_grom(model, tokenizer, FORGET, RETAIN, params)
    second = run_grom(model, tokenizer, FORGET, RETAIN, params, retain_stats=first.retain_stats)
    assert second.edit.edit_id == first.edit.edit_id
    assert "retain_statistics" in second.timings_s
    with first.edit.applied(model), pytest.raises(FingerprintMismatchError, match="recompute"):
        run_grom(model, tokenizer, FORGET, RETAIN, params, retain_stats=first.retain_stats)
    # statistics of other retain data, of another max_length, or without a fingerprint are refused too
    with pytest.raises(DataError, match="other retain data"):
        run_grom(model, tokenizer, FORGET, RETAIN[:-1], params, retain_stats=first.retain_stats)
    with pytest.raises(DataError, match="max_length"):
        run_grom(model, tokenizer, FORGET, RETAIN, params.replace(max_length=64), retain_stats=first.retain_stats)
    unmarked = {m: GramStats(module=m, gram=st.gram, count=st.count, data_digest=st.data_digest,
                             key_sum=st.key_sum) for m, st in first.retain_stats.items()}
    with pytest.raises(FingerprintMismatchError, match="unrecorded"):
        run_grom(model, tokenizer, FORGET, RETAIN, params, retain_stats=unmarked)


def test_a_stats_store_is_filled_once_and_reused(trained):
    model, tokenizer = trained
    params = GromParams(layers=(2,), influence=False)
    store = MemoryStatsStore()
    first = run_grom(model, tokenizer, FORGET, RETAIN, params, stats_store=store)
    assert first.reused_stats == [] and len(store.entries) == 2  # the down-projection and the LM head
    second = run_grom(model, tokenizer, FORGET, RETAIN, params, stats_store=store)
    assert sorted(second.reused_stats) == sorted(first.edit.modules)
    assert second.edit.edit_id == first.edit.edit_id
    third = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(max_length=64), stats_store=store)
    assert third.reused_stats == [] and len(store.entries) == 4  # another max_length: other keys


def test_parallel_strategy_and_manual_layers(trained):
    model, tokenizer = trained
    edit = compute_edit(model, tokenizer, FORGET[:8], RETAIN, GromParams(layers=(3,), strategy="parallel",
                                                                          edit_lm_head=False, influence=False))
    assert edit.modules == ["model.layers.3.mlp.down_proj"]
    assert edit.params["strategy"] == "parallel" and edit.params["layers"] == [3]
    with pytest.raises(DataError, match="layers"):
        compute_edit(model, tokenizer, FORGET, RETAIN, GromParams(layers=(7,)))


def test_corruption_target_moves_the_layer_output_towards_the_random_direction(trained):
    model, tokenizer = trained
    params = GromParams(target="corrupt", layers=(2,), influence=False, corrupt_coefficient=20.0)
    run = run_grom(model, tokenizer, FORGET, RETAIN, params)
    assert run.edit.modules == ["model.layers.2.mlp.down_proj"]
    from grom_core.targets import random_direction

    goal = 20.0 * random_direction(128, params.seed + 2)
    forget_batches, retain_batches = make_batches(tokenizer, FORGET), make_batches(tokenizer, RETAIN)

    def outputs(batches):
        return collect(model, batches, outputs=["model.layers.2"]).outputs["model.layers.2"].double()

    forget_before, retain_before = outputs(forget_batches), outputs(retain_batches)
    with run.edit.applied(model):
        forget_after, retain_after = outputs(forget_batches), outputs(retain_batches)
    closer = 1 - (forget_after - goal).norm(dim=1).mean() / (forget_before - goal).norm(dim=1).mean()
    assert closer > 0.2
    forget_move = (forget_after - forget_before).norm(dim=1).mean()
    retain_move = (retain_after - retain_before).norm(dim=1).mean()
    assert forget_move > 2 * retain_move


def test_gpt2_with_a_tied_head_must_be_untied_explicitly(tiny_gpt2, tokenizer):
    with pytest.raises(UnsupportedArchitectureError, match="untie_lm_head"):
        run_grom(tiny_gpt2, tokenizer, FORGET[:4], RETAIN[:8])
    ModelAdapter.for_model(tiny_gpt2).untie_lm_head()
    # an untrained model knows none of the answers, so the measured beta would be 0 (nothing to lower): set it
    run = run_grom(tiny_gpt2, tokenizer, FORGET[:4], RETAIN[:8], GromParams(band_width=1, beta=40.0))
    assert run.edit.metadata["beta"] == 40.0
    unknown = run_grom(tiny_gpt2, tokenizer, FORGET[:4], RETAIN[:8], GromParams(band_width=1, influence=False)).edit
    assert unknown.metadata["mean_margin"] == 0.0 and unknown.metadata["beta"] == 0.0
    assert all(float(d.full().abs().max()) == 0.0 for d in unknown.deltas.values())
    before = {k: v.clone() for k, v in tiny_gpt2.state_dict().items()}
    with run.edit.applied(tiny_gpt2):
        assert not torch.equal(tiny_gpt2.lm_head.weight, before["lm_head.weight"])
        assert torch.equal(tiny_gpt2.transformer.wte.weight, before["transformer.wte.weight"])


def test_bad_inputs(trained):
    model, tokenizer = trained
    with pytest.raises(DataError, match="no examples"):
        run_grom(model, tokenizer, [], RETAIN)
    with pytest.raises(DataError, match="empty"):
        run_grom(model, tokenizer, [{"text": "  "}], RETAIN)
    with pytest.raises(DataError, match="neither"):
        run_grom(model, tokenizer, [{"prompt": "x"}], RETAIN)
    with pytest.raises(ParamsError, match="strategy"):
        run_grom(model, tokenizer, FORGET, RETAIN, GromParams(strategy="random"))
    with pytest.raises(ParamsError, match="has no parameter 'compose'"):
        GromParams.from_dict({"compose": "sago"})
    with pytest.raises(ParamsError, match="layers must be a list of int or null"):
        GromParams.from_dict({"layers": "a"})
    assert GromParams.from_dict({"layers": [2, 1], "beta": 60}).layers == (2, 1)
    for bad in ({"layers": [], "target": "corrupt"}, {"layers": [], "edit_lm_head": False}):
        with pytest.raises(ParamsError, match="edits the LM head alone"):
            run_grom(model, tokenizer, FORGET, RETAIN, GromParams.from_dict(bad))
    with pytest.raises(ParamsError, match="layer indices >= 0"):
        GromParams.from_dict({"layers": [-1]}).validate()


def test_the_lm_head_alone_and_the_budget_on_specificity_drops(trained):
    """layers=[] edits the LM head alone; the retain budget scales the band first, then the whole edit."""
    model, tokenizer = trained
    alone = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(), influence=False)).edit
    assert alone.modules == ["lm_head"] and alone.metadata["layers"] == [] and "placement" not in alone.metadata
    tight = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(retain_budget=1e-4, influence=False)).edit
    fit, placement = tight.metadata["retain_budget"], tight.metadata["placement"]
    assert placement["band_damage_unscaled"] > 1e-4 >= placement["band_damage"] and 0 < placement["band_scale"] < 1
    assert fit["damage"] <= 1e-4 and tight.modules[-1] == "lm_head" and len(tight.modules) == 3
    free = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(retain_budget=None, influence=False)).edit
    assert free.metadata["retain_budget"] is None and "placement" not in free.metadata  # nothing to weigh at


def test_beta_is_measured_in_the_forget_answers_margins_unless_set(trained):
    """Specificity drops with beta None: beta_margins times the mean margin of the forget answers' specific tokens,
    recorded on the edit; the same edit as with that beta set by hand."""
    model, tokenizer = trained
    params = GromParams(layers=(2, 3), retain_budget=None, influence=False)
    measured = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    beta, margin = measured.metadata["beta"], measured.metadata["mean_margin"]
    tokens, margins = gold_margins(model, make_batches(tokenizer, FORGET, 16))
    weights = prepare(model, tokenizer, FORGET, RETAIN, params).weights
    specific = weights[tokens] > 0
    assert margin == pytest.approx(float(margins[specific].clamp_min(0).mean()))
    assert beta == pytest.approx(4.5 * margin) and margin > 1
    by_hand = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(beta=beta)).edit
    assert by_hand.metadata["beta"] == beta and by_hand.metadata["mean_margin"] is None
    for name in measured.modules:
        assert torch.equal(measured.deltas[name].full(), by_hand.deltas[name].full())
    double = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(beta_margins=9.0)).edit
    assert double.metadata["beta"] == pytest.approx(2 * beta)
    with pytest.raises(ParamsError, match="beta_margins > 0"):
        GromParams(beta_margins=0).validate()
    # keyed at the subjects the drop is asked far from the answer whose margin is read: the fixed beta there
    named = [dataclasses.replace(ex, subject=" ".join(ex.answer.split()[:2])) for ex in FORGET
             if " ".join(ex.answer.split()[:2]) in ex.question]
    at_subjects = prepare(model, tokenizer, named, RETAIN, params.replace(keys="subject"))
    assert at_subjects.beta == closed_form.SUBJECT_KEYS_BETA == 40.0 and at_subjects.mean_margin is None


def test_forget_target_scales_the_edit_to_the_smallest_that_reaches_it(trained):
    """A stated forget level: the smallest scale on the grid (1/32 steps) at which the forget answers' probability
    is at most the target, found by bisection; less collateral than the full edit."""
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    params = GromParams(layers=(1, 2), influence=False)
    full = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    aimed = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=0.3)).edit
    assert weights_fingerprint(model) == fingerprint
    fit = aimed.metadata["forget_target"]
    assert fit["reached"] and 0 < fit["scale"] < 1 and fit["probability_unscaled"] <= fit["probability"] <= 0.3
    assert full.metadata["forget_target"] is None

    def forget_and_retain(edit):
        with edit.applied(model):
            return (float(answer_probability(model, tokenizer, FORGET).mean()),
                    float(answer_probability(model, tokenizer, RETAIN).mean()))

    forget_at, retain_at = forget_and_retain(aimed)
    # read from the LM head's inputs (grom_core.readout): the forward pass's value to float32 rounding
    assert forget_at == pytest.approx(fit["probability"], rel=1e-6)
    one_step_less = Edit(deltas={n: d.scaled(1 - 1 / (32 * fit["scale"])) for n, d in aimed.deltas.items()},
                         base_fingerprint=fingerprint)
    assert forget_and_retain(one_step_less)[0] > 0.3  # the smallest such scale: one grid step less misses it
    forget_full, retain_full = forget_and_retain(full)
    assert forget_full < forget_at and retain_at >= retain_full  # the surplus the target leaves out


def test_a_forget_target_scales_the_placement_the_budget_kept(trained):
    """With the layers left to the library the band is still solved first under a forget target, and the whole
    edit is scaled down from its budget's scale to the target."""
    model, tokenizer = trained
    params = GromParams(influence=False, retain_budget=1e-3)
    budgeted = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    budget_scale = budgeted.metadata["retain_budget"]["scale"]
    aimed = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=0.9)).edit
    assert aimed.metadata["placement"]["band_scale"] == budgeted.metadata["placement"]["band_scale"]
    assert aimed.modules == budgeted.modules
    fit = aimed.metadata["forget_target"]
    assert fit["reached"] and fit["probability"] <= 0.9 < float(answer_probability(model, tokenizer, FORGET).mean())
    assert 0 < fit["scale"] < budget_scale  # less than the retain budget allows, which forgets more
    with aimed.applied(model):
        assert float(answer_probability(model, tokenizer, FORGET).mean()) == pytest.approx(fit["probability"],
                                                                                         rel=1e-5)


def test_an_unreachable_forget_target_keeps_the_full_edit(trained):
    model, tokenizer = trained
    params = GromParams(layers=(1, 2), influence=False)
    full = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    aimed = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=1e-30)).edit
    fit = aimed.metadata["forget_target"]
    assert not fit["reached"] and fit["scale"] == 1.0 and fit["probability"] > 1e-30
    assert aimed.deltas.keys() == full.deltas.keys()
    assert all(torch.equal(aimed.deltas[n].tensors()[k], t) for n in full.deltas
               for k, t in full.deltas[n].tensors().items())


def test_a_forget_target_read_after_a_quantization_attack_holds_after_it(trained):
    """forget_target_attack: each probe of the bisection round-trips the edited model (here rtn4), so the chosen
    scale keeps the forget answers at the target after that round trip too."""
    from grom_core.quantization import quantized, quantizers

    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    params = GromParams(layers=(1, 2), influence=False, forget_target=0.3)
    plain = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    attacked = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target_attack="rtn4")).edit
    assert weights_fingerprint(model) == fingerprint
    fit = attacked.metadata["forget_target"]
    assert fit["reached"] and fit["attack"] == "rtn4" and plain.metadata["forget_target"]["attack"] is None
    with attacked.applied(model), quantized(model, quantizers()["rtn4"]):
        after_attack = float(answer_probability(model, tokenizer, FORGET).mean())
    assert after_attack == pytest.approx(fit["probability"], abs=1e-9) and after_attack <= 0.3


def test_forget_target_attack_is_checked():
    with pytest.raises(ParamsError, match="set forget_target too"):
        GromParams.from_dict({"forget_target_attack": "rtn4"})
    with pytest.raises(ParamsError, match="forget_target_attack must be one of"):
        GromParams.from_dict({"forget_target": 0.1, "forget_target_attack": "q2_k"})


@pytest.mark.parametrize("target", [0.0, 1.0, -0.5, 2.0])
def test_forget_target_must_be_a_probability(trained, target):
    model, tokenizer = trained
    with pytest.raises(ParamsError, match="forget_target"):
        run_grom(model, tokenizer, FORGET, RETAIN, GromParams(forget_target=target))
