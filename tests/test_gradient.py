"""Gradient baselines: losses by hand, composition math, and a short NPO+SAGO run on the trained tiny model."""

import math

import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.errors import DataError, ParamsError
from grom_core.fingerprint import weights_fingerprint
from grom_core.gradient import losses
from grom_core.gradient.composition import compose_pcgrad, compose_sago, compose_sum
from grom_core.gradient.methods import NPOParams, TrainerParams
from grom_core.gradient.trainer import idk_answers, unlearn_gradient
from grom_core.methods import METHODS
from grom_core.scoring import answer_probability


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_answer_logprobs_and_nll_by_hand():
    # one sequence, vocab 2, uniform logits: every supervised token has log p = log 1/2
    logits = torch.zeros(1, 4, 2)
    labels = torch.tensor([[-100, 1, 0, -100]])
    logp, lengths = losses.answer_logprobs(logits, labels)
    assert logp.tolist() == pytest.approx([2 * math.log(0.5)]) and lengths.tolist() == [2]
    assert float(losses.nll(logp, lengths)) == pytest.approx(math.log(2))
    assert float(losses.gradient_ascent(logp, lengths)) == pytest.approx(-math.log(2))


def test_npo_simnpo_dpo_by_hand():
    logp, ref = torch.tensor([-2.0, -4.0]), torch.tensor([-3.0, -3.0])
    # NPO, beta 0.1: -(2/0.1) mean log sigmoid(-0.1 (logp - ref)) with differences +1 and -1
    expected = -20 * (log_sigmoid(-0.1) + log_sigmoid(0.1)) / 2
    assert float(losses.npo(logp, ref, 0.1)) == pytest.approx(expected)
    # SimNPO, beta 4.5, delta 0, lengths 2 and 4: -(2/4.5) mean log sigmoid(-(4.5/|y|) logp)
    lengths = torch.tensor([2, 4])
    expected = -(2 / 4.5) * (log_sigmoid(4.5 / 2 * 2.0) + log_sigmoid(4.5 / 4 * 4.0)) / 2
    assert float(losses.simnpo(logp, lengths, 4.5, 0.0)) == pytest.approx(expected)
    # DPO, beta 0.1: margins (chosen - ref) - (rejected - ref)
    chosen, rejected = torch.tensor([-1.0]), torch.tensor([-5.0])
    got = losses.dpo(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-4.0]), 0.1)
    assert float(got) == pytest.approx(-log_sigmoid(0.1 * ((-1 + 2) - (-5 + 4))))


def test_kl_to_reference_is_zero_for_the_same_model_and_positive_otherwise():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6]])
    assert float(losses.kl_to_reference(logits, logits, labels)) == pytest.approx(0.0, abs=1e-7)
    assert float(losses.kl_to_reference(logits, logits.flip(-1), labels)) > 0


def test_sum_is_the_weighted_sum():
    f, r = [torch.tensor([1.0, -2.0]), None], [torch.tensor([3.0, 1.0]), torch.tensor([1.0])]
    out = compose_sum(f, r, gamma=2.0, alpha=0.5)
    assert out[0].tolist() == [3.5, -3.5] and out[1].tolist() == [0.5]  # no forget gradient: retain alone
    assert compose_sum([None], [None]) == [None]


def test_pcgrad_removes_the_conflict_per_tensor_and_leaves_the_rest():
    g_r = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])]
    g_f = [torch.tensor([-1.0, 1.0]), torch.tensor([2.0, 0.0])]  # first conflicts, second does not
    out = compose_pcgrad(g_f, g_r, gamma=1.0, alpha=0.0)
    assert out[0].tolist() == [0.0, 1.0]  # projected onto the normal plane of g_r
    assert out[1].tolist() == [2.0, 0.0]  # unchanged
    assert float((out[0] * g_r[0]).sum()) == pytest.approx(0.0)


def test_sago_never_opposes_the_retain_gradient():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        g_f = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
        g_r = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
        out = compose_sago(g_f, g_r, gamma=0.7, alpha=1.3)
        dot = sum(float((o * r).sum()) for o, r in zip(out, g_r, strict=True))
        assert dot >= 0
        for o, f, r in zip(out, g_f, g_r, strict=True):
            conflict = torch.sign(f) * torch.sign(r) < 0
            assert torch.equal(o[conflict], 1.3 * r[conflict]) and torch.equal(o[~conflict], 0.7 * f[~conflict])


def test_registry_has_every_gradient_method_with_its_published_defaults():
    gradient = {name for name, m in METHODS.items() if m.objective is not None}
    assert gradient == {"ga", "graddiff", "npo", "simnpo", "idkdpo", "altpo"}
    assert METHODS["npo"].params().beta == 0.1 and METHODS["simnpo"].params().beta == 4.5
    assert METHODS["simnpo"].params().gamma == 0.125 and METHODS["ga"].params().alpha == 0.0
    assert METHODS["npo"].objective.needs_reference and METHODS["idkdpo"].objective.preferred == "idk"
    assert METHODS["altpo"].objective.preferred == "alternative" and METHODS["altpo"].params().beta == 0.1
    assert not METHODS["simnpo"].objective.needs_reference
    assert len(idk_answers()) > 50


def test_short_npo_sago_run_lowers_forget_probability_and_returns_an_edit(trained):
    model, tokenizer = trained
    fingerprint = weights_fingerprint(model)
    before_f = answer_probability(model, tokenizer, FORGET).mean()
    recipe = TrainerParams(lr=2e-3, epochs=4, batch_size=4, grad_accum=2)
    results = {}
    for compose in ("sago", "sum"):
        run = unlearn_gradient(model, tokenizer, FORGET, RETAIN, "npo", NPOParams(compose=compose, trainer=recipe))
        assert weights_fingerprint(model) == fingerprint  # the model is restored exactly
        with run.edit.applied(model):
            results[compose] = (answer_probability(model, tokenizer, FORGET).mean(),
                                answer_probability(model, tokenizer, RETAIN).mean(), run)
    forget_sago, retain_sago, run = results["sago"]
    forget_sum, retain_sum, _ = results["sum"]
    assert forget_sago < before_f and forget_sum < before_f
    assert forget_sago != forget_sum  # the composer changes the training, not only its label
    assert run.steps == 4 * 2 and run.edit.params["compose"] == "sago" and "lm_head" in run.edit.modules


def test_bad_method_and_composer(trained):
    model, tokenizer = trained
    with pytest.raises(DataError, match="npo"):
        unlearn_gradient(model, tokenizer, FORGET, RETAIN, method="fisher")
    with pytest.raises(ParamsError, match="sago"):
        unlearn_gradient(model, tokenizer, FORGET, RETAIN, "npo", NPOParams.from_dict({"compose": "mean"}))
    with pytest.raises(ParamsError, match="beta must be float"):
        NPOParams.from_dict({"beta": "high"})
    with pytest.raises(ParamsError, match="epochs must be int"):
        NPOParams.from_dict({"trainer": {"epochs": 2.5}})
    with pytest.raises(DataError, match="not a gradient method"):
        unlearn_gradient(model, tokenizer, FORGET, RETAIN, "grom")


def test_altpo_prefers_in_domain_alternatives_and_forgets(trained):
    from grom_core.data import Example
    from grom_core.gradient.trainer import alternative_answers

    forget = [Example(question="Where was the author Ann Lee born?", answer="Ann Lee was born in Oslo.")]
    retain = [Example(question="What genre does Bo Kim write in?", answer="Bo Kim writes crime."),
              Example(question="Where was the author Bo Kim born?", answer="Bo Kim was born in Lima."),
              Example(question="Where was the author Cy Ode born?", answer="Ann Lee was born in Oslo."),
              Example(text="a text has no answer to offer")]
    # the most similar question whose answer differs from the forget answer comes first
    assert alternative_answers(forget, retain, k=2) == [["Bo Kim was born in Lima.", "Bo Kim writes crime."]]
    with pytest.raises(DataError, match="retain questions"):
        alternative_answers(forget, [Example(text="only texts")])
    model, tokenizer = trained
    before = answer_probability(model, tokenizer, FORGET).mean()
    recipe = TrainerParams(lr=2e-3, epochs=2, batch_size=4, grad_accum=2)
    run = unlearn_gradient(model, tokenizer, FORGET, RETAIN, "altpo", METHODS["altpo"].params(trainer=recipe))
    with run.edit.applied(model):
        after = answer_probability(model, tokenizer, FORGET).mean()
    assert after < before and run.edit.params["method"] == "altpo"


def test_rmu_steers_the_forget_activations_and_holds_the_retain_ones(trained):
    """RMU (representation misdirection): the forget text's residual after the steered block moves toward c u, the
    retain text's stays near the frozen model's, only the down-projections of the blocks up to it are trained, and
    the model is restored exactly."""
    from grom_core.adapter import ModelAdapter
    from grom_core.data import make_batches
    from grom_core.gradient.rmu import RMUParams, block_output, masked_mse, run_rmu, steered_layer

    model, tokenizer = trained
    adapter = ModelAdapter.for_model(model)
    fingerprint = weights_fingerprint(model)
    # a tiny model's forget and retain text share their template tokens: a lighter retain weight than WMDP's 1200
    params = RMUParams(alpha=10.0, trainer=TrainerParams(lr=1e-2, epochs=10, batch_size=4, grad_accum=1))
    layer = steered_layer(params, adapter.num_layers)
    assert layer == 1 and steered_layer(RMUParams(), 32) == 7  # WMDP's layer 7 of Zephyr's 32
    run = run_rmu(model, tokenizer, FORGET, RETAIN, params)
    assert weights_fingerprint(model) == fingerprint
    assert sorted(run.edit.deltas) == [adapter.down_proj_names[0], adapter.down_proj_names[1]]
    assert run.steps == 10 * 4 and run.edit.metadata["steering_coeff"] > 0

    def activations(rows):
        batches = make_batches(tokenizer, rows, 16)
        with torch.no_grad(), block_output(model, adapter.block_names[layer]) as read:
            return [(read(b), b.attention_mask) for b in batches]

    before_f, before_r = activations(FORGET), activations(RETAIN)
    with run.edit.applied(model):
        after_f, after_r = activations(FORGET), activations(RETAIN)
        forget_after = answer_probability(model, tokenizer, FORGET).mean()
        retain_after = answer_probability(model, tokenizer, RETAIN).mean()
    norm = lambda acts: float(torch.cat([h.norm(dim=-1)[m.bool()] for h, m in acts]).mean())  # noqa: E731
    assert norm(after_f) > 1.5 * norm(before_f)  # pushed out toward c u, c = 5 x the mean norm
    drift = lambda after, before: sum(float(masked_mse(a, b, m)) for (a, m), (b, _)  # noqa: E731
                                      in zip(after, before, strict=True)) / len(after)  # mean over batches
    assert drift(after_r, before_r) < 0.2 * drift(after_f, before_f)
    assert forget_after < 0.5 * answer_probability(model, tokenizer, FORGET).mean()
    assert retain_after > forget_after + 0.3
    with pytest.raises(ParamsError, match="does not exist"):
        run_rmu(model, tokenizer, FORGET, RETAIN, RMUParams(layer=4))
