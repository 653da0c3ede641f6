"""head_reach against the edit's own arithmetic, and the rank-one structure of one subject's bag on the head."""

import dataclasses
import math

import pytest
import torch
from conftest import AUTHORS, RETAIN

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.benchmarks.authors import author_questions
from grom_core.capture import collect
from grom_core.data import Batch, make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError
from grom_core.fingerprint import weights_fingerprint
from grom_core.grom import GromParams, run_grom
from grom_core.reach import head_reach


def test_head_reach_is_the_edits_rows_times_the_keys(tiny_llama, tokenizer):
    """The largest rise and the share past the threshold equal P[rows] k read off the LM-head keys; the gold NLL
    changes split by whether the gold token is a row; the model is left as it was."""
    name = ModelAdapter.for_model(tiny_llama).lm_head_name
    m, n = weight_out_in(tiny_llama.get_submodule(name)).shape
    gen = torch.Generator().manual_seed(5)
    batches = make_batches(tokenizer, RETAIN[:12], 6)
    golds = torch.cat([b.labels[:, 1:][b.labels[:, 1:] != -100] for b in batches])
    rows = torch.unique(torch.cat([golds[:3], torch.tensor([m - 1])]))  # some golds among the rows, some not
    left = torch.randn(rows.numel(), 2, generator=gen, dtype=torch.float64)
    right = torch.randn(2, n, generator=gen, dtype=torch.float64)
    edit = Edit({name: ModuleDelta.from_factors(name, left, right, row_index=rows, out_features=m)},
                weights_fingerprint(tiny_llama))
    before = weights_fingerprint(tiny_llama)

    got = head_reach(tiny_llama, edit, batches, name, threshold=1.0)

    keys = collect(tiny_llama, batches, [name], []).inputs[name].double()  # (p, n)
    rise = (keys @ (left @ right).T).amax(dim=1)  # (p,) the rows' logit change, largest per position
    assert got.positions == keys.shape[0] and got.rows == rows.numel()
    assert got.largest_rise == pytest.approx(float(rise.mean()), abs=1e-4)
    assert got.rise_share == pytest.approx(float((rise > 1.0).double().mean()))
    assert not math.isnan(got.gold_nll_rows) and not math.isnan(got.gold_nll_others)
    assert weights_fingerprint(tiny_llama) == before


def test_head_reach_refuses_what_it_cannot_read(tiny_llama, tokenizer):
    adapter = ModelAdapter.for_model(tiny_llama)
    down = adapter.down_proj_names[0]
    m, n = weight_out_in(tiny_llama.get_submodule(down)).shape
    no_head = Edit({down: ModuleDelta(down, (m, n), dense=torch.zeros(m, n, dtype=torch.float64))},
                   weights_fingerprint(tiny_llama))
    batches = make_batches(tokenizer, RETAIN[:4], 4)
    with pytest.raises(DataError, match="does not change rows"):
        head_reach(tiny_llama, no_head, batches, adapter.lm_head_name)
    name = adapter.lm_head_name
    hm, hn = weight_out_in(tiny_llama.get_submodule(name)).shape
    head = Edit({name: ModuleDelta.from_factors(name, torch.ones(1, 1, dtype=torch.float64),
                                                torch.ones(1, hn, dtype=torch.float64), row_index=torch.tensor([3]),
                                                out_features=hm)}, weights_fingerprint(tiny_llama))
    unsupervised = [Batch(b.input_ids, b.attention_mask, torch.full_like(b.labels, -100), b.example_ids)
                    for b in batches]
    with pytest.raises(DataError, match="no supervised position"):
        head_reach(tiny_llama, head, unsupervised, name)


def test_one_subjects_bag_is_a_rank_one_head_edit(trained):
    """Pooled by subject, every position of one author asks for the same bag, so the head's update is -a w^T: its
    rows move together, by one scalar of the key (what reach.py's docstring builds on)."""
    model, tokenizer = trained
    adapter = ModelAdapter.for_model(model)
    adapter.untie_lm_head()
    params = GromParams(influence=False, retain_budget=None, layers=())  # the head alone lowers a subject's bag

    def about(author):
        return [dataclasses.replace(ex, subject=author.name) for ex in author_questions(author)]

    run = run_grom(model, tokenizer, about(AUTHORS[0]), RETAIN, params)
    assert run.edit.modules == [adapter.lm_head_name]
    delta = run.edit.deltas[adapter.lm_head_name]
    singular = torch.linalg.svdvals(delta.full()[delta.row_index])
    assert delta.row_index.numel() > 1 and singular[1] < 1e-9 * singular[0]
    two = run_grom(model, tokenizer, about(AUTHORS[0]) + about(AUTHORS[1]), RETAIN, params)
    two_delta = two.edit.deltas[adapter.lm_head_name]
    assert torch.linalg.matrix_rank(two_delta.full()[two_delta.row_index]) == 2  # one detector per author
