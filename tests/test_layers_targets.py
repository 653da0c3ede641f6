import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.adapter import ModelAdapter
from grom_core.capture import collect
from grom_core.data import iter_answer_tokens, make_batches
from grom_core.layers import choose_band, score_layers
from grom_core.targets import (
    TokenDrops,
    lm_head_suppression,
    margin_beta,
    project_out,
    protected_tokens,
    random_direction,
    representation_corruption,
    residual_suppression,
    specificity_weights,
)


def test_specificity_weights_by_hand():
    a = specificity_weights([1, 1, 2], [2, 3, 3, 3], vocab_size=5, power=1.0, floor=0.0, pseudo_count=0.0)
    # f = (0, 2/3, 1/3, 0, 0), r = (0, 0, 1/4, 3/4, 0)
    assert a.tolist() == pytest.approx([0.0, 1.0, (1 / 3) / (1 / 3 + 1 / 4), 0.0, 0.0])
    sharp = specificity_weights([1, 1, 2], [2, 3, 3, 3], vocab_size=5, pseudo_count=0.0)
    assert sharp.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0])  # (4/7)^2 = 0.33 < 0.5
    smooth = specificity_weights([1], [], vocab_size=2, power=1.0, floor=0.0)
    assert smooth[1] == pytest.approx(1 / (1 + 0.5))  # add-one: r = 1/2 for every token of a two-token vocabulary
    # the floor's rule: kept from p = 1/sqrt(2), i.e. a forget frequency 1 + sqrt(2) times the retain frequency
    kept = specificity_weights([1] * 25, [1] * 10 + [2] * 15, vocab_size=3, pseudo_count=0.0)  # f/r = 2.5
    cut = specificity_weights([1] * 23, [1] * 10 + [2] * 13, vocab_size=3, pseudo_count=0.0)  # f/r = 2.3
    assert kept[1] > 0.5 and cut[1] == 0


def test_margin_beta_by_hand():
    weights = torch.tensor([0.0, 1.0, 0.25, 0.0], dtype=torch.float64)
    tokens = torch.tensor([1, 0, 2, 1, 3])
    margins = torch.tensor([6.0, 50.0, -2.0, 3.0, 9.0], dtype=torch.float64)
    # positions 0, 2 and 3 have a specific token; the negative margin counts as 0: mean (6 + 0 + 3) / 3 = 3
    assert margin_beta(tokens, margins, weights, 4.5) == (pytest.approx(13.5), pytest.approx(3.0))
    assert margin_beta(torch.tensor([0, 3]), margins[:2], weights, 4.5) == (0.0, 0.0)  # nothing specific


def test_lm_head_suppression_by_hand():
    rows, d = lm_head_suppression(TokenDrops.at_next_tokens(torch.tensor([2, 0, 2]), torch.tensor([1.0, 0.5, 2.0])))
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[2, 0], expected[0, 1], expected[2, 2] = -1.0, -0.5, -2.0
    assert rows.tolist() == [0, 2]  # only the rows of the suppressed tokens are kept
    full = torch.zeros(4, 3, dtype=torch.float64)
    full[rows] = d
    assert torch.equal(full, expected)


def test_a_subject_bag_asks_every_position_for_every_token_of_its_subject():
    tokens, drops = torch.tensor([5, 3, 5, 9, 3]), torch.tensor([1.0, 2.0, 4.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    bag = TokenDrops.over_groups(tokens, drops, groups)
    # subject 0 flagged 5 (largest drop 4) and 3 (2) at its three positions; subject 1 only 9 (token 3's drop is 0)
    assert bag.rows.tolist() == [3, 5, 9]
    assert bag.amounts.tolist() == [[2.0, 2.0, 2.0, 0.0, 0.0], [4.0, 4.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5]]
    alone = TokenDrops.over_groups(tokens, drops, torch.arange(5))  # one group per position: the gold tokens
    gold = TokenDrops.at_next_tokens(tokens, drops)
    assert torch.equal(alone.amounts, gold.amounts[gold.amounts.amax(dim=1) > 0])


def test_residual_suppression_drops_the_logit_lens_by_the_asked_amount():
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    tokens, drops, scale = torch.tensor([3, 7, 3]), torch.tensor([2.0, 0.5, 1.0]), torch.tensor([1.5, 0.7, 3.0])
    asked = TokenDrops.at_next_tokens(tokens, drops)
    d = residual_suppression(asked, u[asked.rows], scale)
    assert d.shape == (6, 3)
    lens = (u[tokens] * d.T).sum(1) / scale
    assert lens.tolist() == pytest.approx((-drops).tolist())
    # a bag: every asked token drops by its own amount, with the smallest change that does it
    bag = TokenDrops.over_groups(tokens, drops, torch.tensor([0, 0, 0]))
    d = residual_suppression(bag, u[bag.rows], scale)
    lens = (u[bag.rows] @ d) / scale
    assert torch.allclose(lens, -bag.amounts)
    # the smallest such change lies in the span of the asked tokens' directions: nothing orthogonal to them
    basis = torch.linalg.qr(u[bag.rows].T).Q
    assert torch.allclose(basis @ (basis.T @ d), d)


def test_protected_tokens_keep_their_logits_while_the_asked_ones_drop_by_the_same_amount():
    """Built from rows with the kept tokens' span projected out, the residual change still lowers each asked token
    by its drop (through its own, unprojected unembedding) and moves no kept token's logit; the kept tokens are the
    candidates most aligned with the asked ones, never an asked one."""
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    u[5] = u[3] + 0.1 * u[5]  # token 5 resembles token 3: a plain suppression of 3 drags it down
    tokens, drops, scale = torch.tensor([3, 7]), torch.tensor([2.0, 0.5]), torch.tensor([1.5, 0.7])
    asked = TokenDrops.at_next_tokens(tokens, drops)
    kept = protected_tokens(asked.rows, torch.tensor([0, 3, 5, 9]), lambda ids: u[ids], 2)
    assert 5 in kept.tolist() and 3 not in kept.tolist() and kept.numel() == 2
    plain = residual_suppression(asked, u[asked.rows], scale)
    d = residual_suppression(asked, project_out(u[asked.rows], u[kept]), scale)
    assert ((u[tokens] * d.T).sum(1) / scale).tolist() == pytest.approx((-drops).tolist())
    assert torch.allclose(u[kept] @ d, torch.zeros(2, 2, dtype=torch.float64), atol=1e-10)
    assert float((u[5] @ plain)[0]) < -1.0  # what the protection prevents
    assert torch.equal(project_out(u[:2], u[:0]), u[:2])
    assert protected_tokens(asked.rows, torch.tensor([3, 7]), lambda ids: u[ids], 4).numel() == 0


def test_representation_corruption_moves_outputs_to_c_u():
    h = torch.randn(5, 8, dtype=torch.float64)
    d = representation_corruption(h, coefficient=6.5, seed=3)
    u = random_direction(8, 3)
    assert torch.allclose(h + d.T, 6.5 * u.expand(5, 8))
    assert u.norm() == pytest.approx(1.0) and (u >= 0).all()
    assert torch.equal(u, random_direction(8, 3)) and not torch.equal(u, random_direction(8, 4))


def test_a_planted_layer_is_found(tiny_llama, tokenizer):
    adapter = ModelAdapter.for_model(tiny_llama)
    forget_batches, retain_batches = make_batches(tokenizer, FORGET), make_batches(tokenizer, RETAIN)
    weights = specificity_weights(iter_answer_tokens(forget_batches), iter_answer_tokens(retain_batches),
                                  len(tokenizer))
    planted = 1
    name = adapter.down_proj_names[planted]
    # Plant: layer 1's MLP now writes the forget-specific tokens' unembedding directions on every input.
    acts = collect(tiny_llama, forget_batches + retain_batches, inputs=[name]).inputs[name].double()
    w = acts.mean(0)
    specific = torch.nonzero(weights > 0.9).flatten()
    v = adapter.unembedding()[specific].sum(0)
    with torch.no_grad():
        module = tiny_llama.get_submodule(name)
        module.weight += (3.0 * torch.outer(v / v.norm(), w / w.norm().pow(2))).float()
    scores = score_layers(tiny_llama, adapter, forget_batches, weights)
    assert int(scores.score.argmax()) == planted and scores.retain is None
    contrasted = score_layers(tiny_llama, adapter, forget_batches, weights, retain_batches)
    assert torch.equal(contrasted.forget, scores.forget)
    assert torch.allclose(contrasted.score, scores.forget - contrasted.retain)
    assert choose_band(scores.score, 1, late_fraction=1.0) == [planted]
    assert scores.as_rows()[planted]["score"] == pytest.approx(float(scores.score[planted]))


def test_choose_band():
    s = torch.tensor([5.0, 0.0, 1.0, 2.0, 2.0, 0.5])
    assert choose_band(s, 2, late_fraction=1.0) == [0, 1]  # 2.5 beats 2.0
    assert choose_band(s, 2, late_fraction=0.75) == [3, 4]  # layers 0-1 are not late
    assert choose_band(s, 6) == [0, 1, 2, 3, 4, 5]
    assert choose_band(torch.zeros(4), 2) == [2, 3]  # ties go to the later band
    with pytest.raises(ValueError, match="band width"):
        choose_band(s, 7)
