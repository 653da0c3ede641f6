"""The NLL probe against brute force: a head-only update read from the head's inputs gives what a forward pass of
the edited model gives, and any other update is read on the model and reverted."""

import pytest
import torch
from conftest import FORGET, RETAIN, random_gpt2

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.data import make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError
from grom_core.fingerprint import weights_fingerprint
from grom_core.readout import NllProbe
from grom_core.scoring import answer_nll


def applied_nll(model, batches, deltas):
    with Edit(deltas=deltas, base_fingerprint="").applied(model, verify=False):
        return answer_nll(model, batches)


def head_delta(model, rows, scale, seed=0):
    """A row-sparse update of the LM head's `rows` (None: every row, dense), random, of size `scale`."""
    weight = weight_out_in(model.lm_head)
    gen = torch.Generator().manual_seed(seed)
    count = weight.shape[0] if rows is None else len(rows)
    left = torch.randn(count, 3, generator=gen, dtype=torch.float64) * scale
    right = torch.randn(3, weight.shape[1], generator=gen, dtype=torch.float64)
    index = None if rows is None else torch.tensor(sorted(rows))
    return ModuleDelta.from_factors("lm_head", left, right, row_index=index, out_features=weight.shape[0])


def test_unedited_reading_matches_a_forward_pass(trained, tokenizer):
    model, _ = trained
    batches = make_batches(tokenizer, RETAIN[:20], 8)
    probe = NllProbe(model, batches, "lm_head")
    assert probe.base.shape == (20,)
    assert torch.allclose(probe.base, answer_nll(model, batches), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["gold rows", "other rows", "every row"])
def test_head_only_update_matches_the_edited_model(trained, tokenizer, which):
    model, _ = trained
    batches = make_batches(tokenizer, FORGET, 8)
    fingerprint = weights_fingerprint(model)
    golds = sorted({int(t) for batch in batches for t in batch.labels.flatten() if t >= 0})
    others = [t for t in range(weight_out_in(model.lm_head).shape[0]) if t not in golds][:40]
    rows = {"gold rows": golds[:30] + others[:10], "other rows": others, "every row": None}[which]
    probe = NllProbe(model, batches, "lm_head")
    for scale in (0.05, 1.0, 4.0):  # from a small change to golds dropped by many nats
        delta = {"lm_head": head_delta(model, rows, scale)}
        expected = applied_nll(model, batches, delta)
        got = probe.nll(delta)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (scale, (got - expected).abs().max())
        half = probe.nll(delta, 0.5)
        assert torch.allclose(half, applied_nll(model, batches, {"lm_head": delta["lm_head"].scaled(0.5)}),
                              rtol=1e-4, atol=1e-4)
    assert (probe.nll(delta) - probe.base).abs().max() > 0.1  # the update did move the sample
    assert weights_fingerprint(model) == fingerprint


def test_other_updates_are_read_by_a_forward_pass_and_reverted(tokenizer):
    model = random_gpt2(tokenizer)
    adapter = ModelAdapter.for_model(model)
    adapter.untie_lm_head()
    batches = make_batches(tokenizer, RETAIN[:10], 4)
    fingerprint = weights_fingerprint(model)
    assert adapter.lm_head_name == "lm_head"
    probe = NllProbe(model, batches, adapter.lm_head_name)
    down = adapter.down_proj_names[0]
    shape = tuple(weight_out_in(adapter.module(down)).shape)
    gen = torch.Generator().manual_seed(1)
    deltas = {down: ModuleDelta.from_factors(down, torch.randn(shape[0], 2, generator=gen, dtype=torch.float64),
                                             torch.randn(2, shape[1], generator=gen, dtype=torch.float64)),
              adapter.lm_head_name: head_delta(model, [1, 5, 9], 1.0)}
    assert torch.allclose(probe.nll(deltas, 0.3), applied_nll(model, batches, {
        name: d.scaled(0.3) for name, d in deltas.items()}), rtol=1e-6, atol=1e-8)
    assert probe.rise(deltas) != 0.0
    assert weights_fingerprint(model) == fingerprint


def test_empty_sample_is_refused(trained):
    model, _ = trained
    with pytest.raises(DataError, match="at least one batch"):
        NllProbe(model, [], "lm_head")


def layer_delta(adapter, layer, seed):
    name = adapter.down_proj_names[layer]
    out, inp = weight_out_in(adapter.module(name)).shape
    gen = torch.Generator().manual_seed(seed)
    return name, ModuleDelta.from_factors(name, torch.randn(out, 2, generator=gen, dtype=torch.float64) * 0.3,
                                          torch.randn(2, inp, generator=gen, dtype=torch.float64))


def test_passes_from_the_lowest_edited_block_read_what_full_passes_read(trained, tokenizer):
    model, _ = trained
    adapter = ModelAdapter.for_model(model)
    blocks, top = adapter.block_names[0].rpartition(".")[0], adapter.num_layers - 1
    batches = make_batches(tokenizer, RETAIN[:12], 4)
    fingerprint = weights_fingerprint(model)
    probe = NllProbe(model, batches, adapter.lm_head_name, from_block=(blocks, top))
    assert probe.cache.exact and len(probe.cache.hidden) == len(batches)
    assert torch.allclose(probe.base, answer_nll(model, batches), rtol=1e-5, atol=1e-6)
    above = dict([layer_delta(adapter, top, 0)])
    below = dict([layer_delta(adapter, 0, 1)])  # under the cached block: read by full passes
    for deltas in (above, {**above, adapter.lm_head_name: head_delta(model, [1, 5, 9], 1.0)}, below):
        assert probe.cache.covers([m for m in deltas if m != adapter.lm_head_name]) == (deltas is not below)
        expected = applied_nll(model, batches, {name: d.scaled(0.5) for name, d in deltas.items()})
        assert torch.allclose(probe.nll(deltas, 0.5), expected, rtol=1e-5, atol=1e-6)
        assert probe.rise(deltas) != 0.0
    assert weights_fingerprint(model) == fingerprint
    assert len(adapter.block_names) == len(adapter.module(blocks))  # the block list is restored


def test_a_forward_that_adds_to_the_embedding_keeps_full_passes(tokenizer):
    """GPT-2 adds position embeddings after the token embedding: a run from a cached block would add them twice,
    the check says so, and the probe reads the update by full passes."""
    model = random_gpt2(tokenizer)
    adapter = ModelAdapter.for_model(model)
    adapter.untie_lm_head()
    blocks = adapter.block_names[0].rpartition(".")[0]
    batches = make_batches(tokenizer, RETAIN[:8], 4)
    probe = NllProbe(model, batches, adapter.lm_head_name, from_block=(blocks, 1))
    assert not probe.cache.exact
    deltas = dict([layer_delta(adapter, 1, 2)])
    assert torch.allclose(probe.nll(deltas), applied_nll(model, batches, deltas), rtol=1e-5, atol=1e-6)
