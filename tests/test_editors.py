"""ROME, MEMIT and AlphaEdit: their updates against hand-checked small cases, and each one run as an unlearning
method on the trained tiny model (forget facts given up, the edit reverts bit for bit)."""

import dataclasses

import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.data import Example, encode, prompt_format, subject_position
from grom_core.editors.facts import default_layers
from grom_core.editors.updates import alphaedit_update, memit_update, null_space_projector, rome_updates
from grom_core.errors import DataError, ParamsError
from grom_core.fingerprint import weights_fingerprint
from grom_core.methods import METHODS, MethodContext, method_params
from grom_core.scoring import answer_probability
from grom_core.statistics import MemoryStatsStore


def _problem(seed=0, n_in=8, n_out=5, facts=3):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_in, facts, generator=g, dtype=torch.float64)
    residuals = torch.randn(n_out, facts, generator=g, dtype=torch.float64)
    x = torch.randn(n_in, 40, generator=g, dtype=torch.float64)
    return keys, residuals, x @ x.T / 40


def test_rome_each_rank_one_update_writes_its_fact_exactly():
    keys, residuals, cov = _problem()
    left, right = rome_updates(keys, residuals, cov)
    for i in range(keys.shape[1]):
        so_far = left[:, :i + 1] @ right[:i + 1]  # the edits up to and including fact i
        assert torch.allclose(so_far @ keys[:, i], residuals[:, i], atol=1e-10)
        single = torch.outer(left[:, i], right[i])
        assert torch.linalg.matrix_rank(single) == 1
    # ROME's direction: the update of fact i is along C^-1 k_i
    u = torch.linalg.solve(cov, keys[:, 0])
    assert torch.allclose(right[0] / right[0].norm(), u / u.norm(), atol=1e-10)


def test_memit_update_is_the_least_squares_solution():
    keys, residuals, cov = _problem(1)
    weight = 3.0
    left, right = memit_update(keys, residuals, cov, weight)
    delta = left @ right
    # brute force: min ||D K - R||^2 + weight tr(D C D^T) as one stacked least-squares problem in D^T
    chol = torch.linalg.cholesky(cov)
    a = torch.cat([keys.T, weight ** 0.5 * chol.T])  # (N + in, in)
    b = torch.cat([residuals.T, torch.zeros(cov.shape[0], residuals.shape[0], dtype=torch.float64)])
    expected = torch.linalg.lstsq(a, b).solution.T
    assert torch.allclose(delta, expected, atol=1e-10)


def test_alphaedit_leaves_preserved_keys_unchanged_and_moves_the_facts():
    g = torch.Generator().manual_seed(2)
    preserved = torch.randn(8, 5, generator=g, dtype=torch.float64)  # span 5 of 8 dimensions: a null space of 3
    cov = preserved @ preserved.T / 5
    projector = null_space_projector(cov, 1e-8)
    assert torch.allclose(projector @ projector, projector, atol=1e-12) and round(float(projector.trace())) == 3
    keys = torch.randn(8, 2, generator=g, dtype=torch.float64)
    residuals = torch.randn(4, 2, generator=g, dtype=torch.float64)
    left, right = alphaedit_update(keys, residuals, projector, l2=0.1)
    delta = left @ right
    assert (delta @ preserved).abs().max() < 1e-8
    assert (delta @ keys - residuals).norm() < residuals.norm()  # the facts moved towards their targets
    # the published closed form, R K^T P (K K^T P + l2 I)^-1, computed directly
    direct = residuals @ keys.T @ projector @ torch.linalg.inv(keys @ keys.T @ projector
                                                               + 0.1 * torch.eye(8, dtype=torch.float64))
    assert torch.allclose(delta, direct, atol=1e-10)


def test_default_layers_follow_the_papers_depths():
    assert default_layers(28, 0.11, 0.29) == [3, 4, 5, 6, 7, 8]  # MEMIT on GPT-J
    assert default_layers(28, 0.18, 0.18) == [5]  # ROME on GPT-J
    assert default_layers(4, 0.11, 0.29) == [0, 1]
    assert default_layers(1, 0.11, 0.29) == [0]


def test_subject_position_is_the_subjects_last_token(tokenizer):
    fmt = prompt_format("qa")
    example = Example(question="Where was the author Rosalind Halloran born?", answer="In Osaka.",
                      subject="Rosalind Halloran")
    ids = encode(tokenizer, example, 96, fmt).input_ids
    at = subject_position(tokenizer, example, fmt)
    assert tokenizer.decode(ids[:at + 1]).rstrip().endswith("Halloran")
    assert not tokenizer.decode(ids[:at]).rstrip().endswith("Halloran")
    plain = dataclasses.replace(example, subject=None)
    prompt_ids = fmt.prefix(tokenizer) + tokenizer.encode(fmt.prompt(tokenizer, example.question),
                                                          add_special_tokens=False)
    assert subject_position(tokenizer, plain, fmt) == len(prompt_ids) - 1
    with pytest.raises(DataError, match="must be a non-empty part"):
        Example(question="Where was X born?", answer="Y", subject="Z")


def _facts(rows):
    """The tiny model's QA memories as completions that end where the fact's last word starts ("...Answer: Rosalind
    Halloran was born in" -> "Osaka."): a value written at the prompt's last token decides that word. (The tiny model
    reads a fact from the name it repeats in its answer, not from the question's subject token, so these tests key
    at the prompt's last token: no subject.)"""
    out = []
    for ex in rows:
        head, _, last = ex.answer.rstrip(".").rpartition(" ")
        out.append(Example(question=f"Question: {ex.question}\nAnswer: {head}", answer=last + "."))
    return out


@pytest.mark.parametrize("method", ["rome", "memit", "alphaedit"])
def test_editor_gives_up_the_facts_and_reverts_exactly(trained, method):
    model, tokenizer = trained
    forget, retain = _facts(FORGET[:4]), _facts(RETAIN)
    fingerprint = weights_fingerprint(model)
    before_f = answer_probability(model, tokenizer, forget, fmt="completion").mean()
    before_r = answer_probability(model, tokenizer, retain, fmt="completion").mean()
    # AlphaEdit's null space at its 1% threshold is almost empty where 48 retain rows' keys fill a tiny model's 256
    # dimensions (on one CPU's training of it, nothing was left to edit): a wider one here
    params = method_params(method, {"v_steps": 15, **({"null_threshold": 0.1} if method == "alphaedit" else {})})
    context = MethodContext(stats_store=MemoryStatsStore(), prompt_format="completion")
    run = METHODS[method].run(model, tokenizer, forget, retain, params, context)
    assert weights_fingerprint(model) == fingerprint  # computing the edit leaves the model alone
    assert run.edit.base_fingerprint == fingerprint and run.edit.params["method"] == method
    assert all(name.endswith("down_proj") for name in run.edit.modules)
    with run.edit.applied(model):
        after_f = answer_probability(model, tokenizer, forget, fmt="completion").mean()
        after_r = answer_probability(model, tokenizer, retain, fmt="completion").mean()
    assert weights_fingerprint(model) == fingerprint
    # v*'s Adam steps (lr 0.5, ROME's clamp) need not bring every fact under the target on every CPU's tiny model
    # (on one, 2 of 4 stay above after 15, 25 or 60 steps); the edit must still give the facts up
    assert run.edit.metadata["facts_above_target"] < len(forget)
    # AlphaEdit keeps the retain keys' outputs exactly and so gives up less on a model this small
    assert after_f < (0.9 if method == "alphaedit" else 0.7) * before_f, (method, before_f, after_f)
    assert after_r > 0.97 * before_r, (method, before_r, after_r)


def test_editors_share_groms_retain_statistics_and_refuse_bad_input(trained):
    model, tokenizer = trained
    store = MemoryStatsStore()
    context = MethodContext(stats_store=store)
    forget = _facts(FORGET[:2])
    first = METHODS["memit"].run(model, tokenizer, forget, RETAIN, method_params("memit", {"v_steps": 2}), context)
    again = METHODS["alphaedit"].run(model, tokenizer, forget, RETAIN, method_params("alphaedit", {"v_steps": 2}),
                                     context)
    assert first.reused_stats == () and set(again.reused_stats) == set(first.edit.modules)
    with pytest.raises(ParamsError, match="ROME edits one layer"):
        method_params("rome", {"layers": [0, 1]})
    with pytest.raises(DataError, match="question/answer"):
        METHODS["rome"].run(model, tokenizer, [{"text": "a text"}], RETAIN, method_params("rome"), context)
    with pytest.raises(DataError, match="layers \\[9\\] do not exist"):
        METHODS["memit"].run(model, tokenizer, forget, RETAIN, method_params("memit", {"layers": [9]}), context)


def test_grom_keys_at_subjects(trained):
    from conftest import AUTHORS

    from grom_core.data import make_batches
    from grom_core.grom import GromParams, run_grom

    model, tokenizer = trained
    names = [a.name for a in AUTHORS]
    forget = [Example(question=ex.question, answer=ex.answer, subject=next(n for n in names if n in ex.question))
              for ex in FORGET[:3]]
    params = GromParams(keys="subject", layers=(1,), edit_lm_head=False, influence=False)
    record = run_grom(model, tokenizer, forget, RETAIN, params).records["model.layers.1.mlp.down_proj"]
    fmt = prompt_format("qa")
    assert record.positions.tolist() == [subject_position(tokenizer, ex, fmt) for ex in forget]
    first_answer_tokens = [encode(tokenizer, ex, 96, fmt) for ex in forget]
    assert record.tokens.tolist() == [next(t for t in e.labels if t != -100) for e in first_answer_tokens]
    both = run_grom(model, tokenizer, forget, RETAIN, params.replace(keys="subject+answer")).records
    answers = sum(b.num_supervised for b in make_batches(tokenizer, forget, 16, fmt=fmt))
    assert both["model.layers.1.mlp.down_proj"].keys.shape[1] == answers + len(forget)
    with pytest.raises(DataError, match="name their subject"):
        run_grom(model, tokenizer, FORGET[:2], RETAIN, params)
    # auto: these answers restate their subject, so the keys are the answers (with counterfactual drops); answers
    # that are bare objects take the subjects
    auto = run_grom(model, tokenizer, forget, RETAIN, params.replace(keys="auto"))
    answer = run_grom(model, tokenizer, forget, RETAIN, params.replace(keys="answer"))
    assert auto.plan.drops == "counterfactual"
    assert torch.equal(auto.records["model.layers.1.mlp.down_proj"].positions,
                       answer.records["model.layers.1.mlp.down_proj"].positions)
    bare = [dataclasses.replace(ex, answer=ex.answer.rstrip(".").split()[-1]) for ex in forget]
    bare_auto = run_grom(model, tokenizer, bare, RETAIN, params.replace(keys="auto")).records
    assert bare_auto["model.layers.1.mlp.down_proj"].positions.tolist() == [
        subject_position(tokenizer, ex, fmt) for ex in bare]
    with pytest.raises(ParamsError, match="keys must be"):
        GromParams(keys="question").validate()
