import dataclasses

import pytest
import torch
from conftest import FORGET, RETAIN

import grom_core.grom.solve as grom_solve
from grom_core.adapter import ModelAdapter
from grom_core.capture import collect
from grom_core.data import make_batches
from grom_core.edit import Edit
from grom_core.errors import DataError, FingerprintMismatchError, ParamsError, UnsupportedArchitectureError
from grom_core.fingerprint import weights_fingerprint
from grom_core.grom import GromParams, compute_edit, make_plan, run_grom
from grom_core.influence import leave_one_out
from grom_core.scoring import answer_probability, gold_margins
from grom_core.statistics import GramStats, MemoryStatsStore


def test_one_call_edit_forgets_and_keeps_retain(trained):
    model, tokenizer = trained
    forget_before = answer_probability(model, tokenizer, FORGET)
    retain_before = answer_probability(model, tokenizer, RETAIN)
    assert forget_before.mean() > 0.9 and retain_before.mean() > 0.9  # the model did memorise
    fingerprint = weights_fingerprint(model)

    run = run_grom(model, tokenizer, FORGET, RETAIN)
    assert weights_fingerprint(model) == fingerprint  # computing the edit leaves the model unchanged
    assert run.edit.base_fingerprint == fingerprint
    assert run.edit.modules[-1] == "lm_head" and len(run.edit.modules) == 3
    # body first: the band was solved for the whole drop and scaled to the budget on its own, then the head
    assert run.plan.placement == "body_first" and run.edit.metadata["plan"] == run.plan.as_dict()
    band = run.manifest.body_first
    assert 0 < band.band.scale <= 1 and band.band.damage <= GromParams().retain_budget
    assert band.band_logit_drop.achieved_mean > 0
    assert list(run.timings_s) == ["plan", "retain_statistics", "retain_probe", "solve", "scale", "influence"]
    assert set(run.peaks_mb) == set(run.timings_s) and min(run.peaks_mb.values()) > 0

    with run.edit.applied(model):
        forget_after = answer_probability(model, tokenizer, FORGET)
        retain_after = answer_probability(model, tokenizer, RETAIN)
    ratio = float(forget_before.mean() / forget_after.mean())
    retain_change = float(retain_after.mean() / retain_before.mean() - 1)
    assert ratio >= 10
    assert abs(retain_change) <= 0.10
    assert weights_fingerprint(model) == fingerprint


def test_a_solve_that_fails_midway_leaves_the_model_as_it_was(trained, monkeypatch):
    """The sequential solve keeps each solved layer's update applied while it collects the next keys; an error in a
    later module's solve must still give every weight back."""
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    real, calls = grom_solve.solve_factors, []

    def failing_at_the_head(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # layers 1 and 2 are solved and applied, then the LM head's solve fails
            raise RuntimeError("solver failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(grom_solve, "solve_factors", failing_at_the_head)
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
    run = run_grom(tiny_gpt2, tokenizer, FORGET[:4], RETAIN[:8], GromParams.from_dict(
        {"band_width": 1, "specificity": {"beta": 40.0}}))
    assert run.plan.beta == 40.0
    unknown = run_grom(tiny_gpt2, tokenizer, FORGET[:4], RETAIN[:8], GromParams(band_width=1, influence=False))
    assert unknown.plan.mean_margin == 0.0 and unknown.plan.beta == 0.0
    assert all(float(d.full().abs().max()) == 0.0 for d in unknown.edit.deltas.values())
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
    assert GromParams.from_dict({"layers": [2, 1], "specificity": {"beta": 60}}).layers == (2, 1)
    with pytest.raises(ParamsError, match="SpecificityDrops has no parameter 'gain'"):
        GromParams.from_dict({"specificity": {"gain": 2}})
    with pytest.raises(ParamsError, match="counterfactual.scope must be"):
        GromParams.from_dict({"counterfactual": {"scope": "word"}})
    for bad in ({"layers": [], "target": "corrupt"}, {"layers": [], "edit_lm_head": False}):
        with pytest.raises(ParamsError, match="edits the LM head alone"):
            run_grom(model, tokenizer, FORGET, RETAIN, GromParams.from_dict(bad))
    with pytest.raises(ParamsError, match="layer indices >= 0"):
        GromParams.from_dict({"layers": [-1]}).validate()


def test_the_lm_head_alone_and_the_budget_on_specificity_drops(trained):
    """layers=[] edits the LM head alone; the retain budget scales the band first, then the whole edit."""
    model, tokenizer = trained
    alone = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(layers=(), influence=False))
    assert alone.edit.modules == ["lm_head"] and alone.plan.layers == () and alone.plan.placement == "joint"
    tight = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(retain_budget=1e-4, influence=False))
    fit, band = tight.manifest.scaling.budget, tight.manifest.body_first.band
    assert band.damage_unscaled > 1e-4 >= band.damage and 0 < band.scale < 1
    assert fit.damage <= 1e-4 and tight.edit.modules[-1] == "lm_head" and len(tight.edit.modules) == 3
    free = run_grom(model, tokenizer, FORGET, RETAIN, GromParams(retain_budget=None, influence=False))
    assert free.manifest.scaling.budget is None and free.plan.placement == "joint"  # nothing to weigh at


def test_beta_is_measured_in_the_forget_answers_margins_unless_set(trained):
    """Specificity drops with beta None: `margins` times the mean margin of the forget answers' specific tokens,
    recorded on the edit; the same edit as with that beta set by hand."""
    model, tokenizer = trained
    params = GromParams(layers=(2, 3), retain_budget=None, influence=False)
    run = run_grom(model, tokenizer, FORGET, RETAIN, params)
    measured, beta, margin = run.edit, run.plan.beta, run.plan.mean_margin
    tokens, margins = gold_margins(model, make_batches(tokenizer, FORGET, 16))
    weights = make_plan(model, tokenizer, FORGET, RETAIN, params)[1].weights
    specific = weights[tokens] > 0
    assert margin == pytest.approx(float(margins[specific].clamp_min(0).mean()))
    assert beta == pytest.approx(4.5 * margin) and margin > 1
    by_hand = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(specificity={"beta": beta}))
    assert by_hand.plan.beta == beta and by_hand.plan.mean_margin is None
    for name in measured.modules:
        assert torch.equal(measured.deltas[name].full(), by_hand.edit.deltas[name].full())
    double = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(specificity={"margins": 9.0}))
    assert double.plan.beta == pytest.approx(2 * beta)
    with pytest.raises(ParamsError, match="specificity.margins > 0"):
        GromParams.from_dict({"specificity": {"margins": 0}})
    # keyed at the subjects the drop is asked far from the answer whose margin is read: the fixed beta there
    named = [dataclasses.replace(ex, subject=" ".join(ex.answer.split()[:2])) for ex in FORGET
             if " ".join(ex.answer.split()[:2]) in ex.question]
    at_subjects, _ = make_plan(model, tokenizer, named, RETAIN, params.replace(keys="subject"))
    assert at_subjects.beta == params.specificity.subject_beta and at_subjects.mean_margin is None


def test_forget_target_scales_the_edit_to_the_smallest_that_reaches_it(trained):
    """A stated forget level: the smallest scale on the grid (1/32 steps) at which the forget answers' probability
    is at most the target, found by bisection; less collateral than the full edit."""
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    params = GromParams(layers=(1, 2), influence=False)
    full = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    run = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=0.3))
    aimed, fit = run.edit, run.manifest.scaling.forget_target
    assert weights_fingerprint(model) == fingerprint
    assert fit.reached and 0 < fit.scale < 1 and fit.probability_unscaled <= fit.probability <= 0.3
    assert full.metadata["scaling"]["forget_target"] is None

    def forget_and_retain(edit):
        with edit.applied(model):
            return (float(answer_probability(model, tokenizer, FORGET).mean()),
                    float(answer_probability(model, tokenizer, RETAIN).mean()))

    forget_at, retain_at = forget_and_retain(aimed)
    # read from the LM head's inputs (grom_core.readout): the forward pass's value to float32 rounding
    assert forget_at == pytest.approx(fit.probability, rel=1e-6)
    one_step_less = Edit(deltas={n: d.scaled(1 - 1 / (32 * fit.scale)) for n, d in aimed.deltas.items()},
                         base_fingerprint=fingerprint)
    assert forget_and_retain(one_step_less)[0] > 0.3  # the smallest such scale: one grid step less misses it
    forget_full, retain_full = forget_and_retain(full)
    assert forget_full < forget_at and retain_at >= retain_full  # the surplus the target leaves out


def test_a_forget_target_scales_the_placement_the_budget_kept(trained):
    """With the layers left to the library the band is still solved first under a forget target, and the whole
    edit is scaled down from its budget's scale to the target."""
    model, tokenizer = trained
    params = GromParams(influence=False, retain_budget=1e-3)
    budgeted = run_grom(model, tokenizer, FORGET, RETAIN, params)
    budget_scale = budgeted.manifest.scaling.budget.scale
    aimed = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=0.9))
    assert aimed.manifest.body_first.band.scale == budgeted.manifest.body_first.band.scale
    assert aimed.edit.modules == budgeted.edit.modules
    fit = aimed.manifest.scaling.forget_target
    assert fit.reached and fit.probability <= 0.9 < float(answer_probability(model, tokenizer, FORGET).mean())
    assert 0 < fit.scale < budget_scale  # less than the retain budget allows, which forgets more
    with aimed.edit.applied(model):
        assert float(answer_probability(model, tokenizer, FORGET).mean()) == pytest.approx(fit.probability, rel=1e-5)


def test_an_unreachable_forget_target_keeps_the_full_edit(trained):
    model, tokenizer = trained
    params = GromParams(layers=(1, 2), influence=False)
    full = run_grom(model, tokenizer, FORGET, RETAIN, params).edit
    run = run_grom(model, tokenizer, FORGET, RETAIN, params.replace(forget_target=1e-30))
    aimed, fit = run.edit, run.manifest.scaling.forget_target
    assert not fit.reached and fit.scale == 1.0 and fit.probability > 1e-30
    assert aimed.deltas.keys() == full.deltas.keys()
    assert all(torch.equal(aimed.deltas[n].tensors()[k], t) for n in full.deltas
               for k, t in full.deltas[n].tensors().items())


@pytest.mark.parametrize("target", [0.0, 1.0, -0.5, 2.0])
def test_forget_target_must_be_a_probability(trained, target):
    model, tokenizer = trained
    with pytest.raises(ParamsError, match="forget_target"):
        run_grom(model, tokenizer, FORGET, RETAIN, GromParams(forget_target=target))


def test_a_drop_kinds_knobs_are_grouped_and_replace_merges_them():
    params = GromParams.from_dict({"gain": 4.0, "counterfactual": {"scope": "position"}})
    assert params.counterfactual.scope == "position" and params.counterfactual.strangers == 4
    changed = params.replace(counterfactual={"rename": "whole"}, specificity={"beta": 12.0})
    # only the named fields of a group change: the scope set before stays
    assert (changed.counterfactual.scope, changed.counterfactual.rename, changed.specificity.beta) == (
        "position", "whole", 12.0)
    assert changed.gain == 4.0 and GromParams.from_dict(changed.to_dict()) == changed
    with pytest.raises(ParamsError, match="GromParams.counterfactual must be an object"):
        GromParams.from_dict({"counterfactual": "position"})
