"""Quantization round trips by hand, exact restoration, and edit-survival diagnostics."""

import pytest
import torch
from conftest import needs_bitsandbytes

from grom_core.edit import ModuleDelta
from grom_core.quantization import (
    QuantSpec,
    edit_survival,
    gguf_q4_1,
    gguf_q8_0,
    int8_rowwise,
    quantized,
    quantizers,
    rtn4,
)


def test_rtn4_by_hand():
    w = torch.tensor([[7.0, -7.0, 3.5, 0.2]])
    deq, codes = rtn4(w, group=4)  # scale 7 / 7 = 1
    assert codes.tolist() == [[7, -7, 4, 0]] and deq.tolist() == [[7.0, -7.0, 4.0, 0.0]]


def test_int8_by_hand():
    w = torch.tensor([[127.0, -63.4, 0.4]])
    deq, codes = int8_rowwise(w)
    assert codes.tolist() == [[127, -63, 0]] and deq.flatten().tolist() == pytest.approx([127.0, -63.0, 0.0])


def test_gguf_q4_1_by_hand_and_its_own_grid_is_a_fixed_point():
    block = [0.0, 0.0625, 0.125, 0.9375, 0.5, 0.53] + [0.25] * 26  # min 0, max 15/16: d = 1/16 exactly
    w = torch.tensor([block + [-1.0, -1.0, -1.0]])  # and a 3-wide tail block of equal values (d = 0)
    deq, codes = gguf_q4_1(w)
    assert codes[0, :6].tolist() == [0, 1, 2, 15, 8, 8] and codes[0, 32:].tolist() == [0, 0, 0]
    assert deq[0, :6].tolist() == [0.0, 0.0625, 0.125, 0.9375, 0.5, 0.5] and deq[0, 32:].tolist() == [-1.0] * 3
    rows = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    once, _ = gguf_q4_1(rows)
    assert float((once - rows).abs().max()) <= float((rows.max() - rows.min()) / 15 / 2 + 1e-3)
    twice, _ = gguf_q4_1(once)
    assert torch.equal(twice, once)  # what a Q4_1 file gives back survives the round trip unchanged
    edited, _ = gguf_q4_1(once + 1e-4)  # an edit far below d / 2 is rounded away entirely
    assert torch.equal(edited, once)


def test_gguf_q8_0_by_hand():
    w = torch.tensor([[127.0, 62.5, -62.5, 0.5, 0.4] + [0.0] * 27])  # absmax 127: d = 1
    deq, codes = gguf_q8_0(w)
    assert codes[0, :5].tolist() == [127, 63, -63, 1, 0]  # halves away from zero, as ggml's roundf (not to even)
    assert deq[0, :5].tolist() == [127.0, 63.0, -63.0, 1.0, 0.0]
    scaled = w / 100  # d = 1.27 / 127, stored as float16
    assert torch.equal(gguf_q8_0(gguf_q8_0(scaled)[0])[0], gguf_q8_0(scaled)[0])


def test_without_bitsandbytes_the_pure_torch_attacks_are_offered():
    assert set(quantizers(available=False)) == {"rtn4", "gguf_q4_1"}


@needs_bitsandbytes
def test_bitsandbytes_round_trips_are_close_and_every_attack_is_listed():
    specs = quantizers()
    assert {"fp4", "nf4", "int8", "rtn4", "gguf_q4_1", "fp4_head_kept"} == set(specs)
    assert not specs["fp4_head_kept"].include_lm_head and specs["fp4"].include_lm_head
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    for name in ("fp4", "nf4", "int8", "rtn4"):
        deq, _ = specs[name].quantize(w)
        rel = float((deq - w).norm() / w.norm())
        assert 0 < rel < (0.02 if name == "int8" else 0.2), name


def test_quantized_context_restores_every_bit(tiny_llama):
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    with quantized(tiny_llama, quantizers()["rtn4"]) as count:
        assert count == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
        assert not torch.equal(tiny_llama.lm_head.weight, before["lm_head.weight"])
    for k, v in tiny_llama.state_dict().items():
        assert torch.equal(v, before[k]), k
    with quantized(tiny_llama, QuantSpec("rtn4_head_kept", rtn4, include_lm_head=False)) as count:
        assert count == 3 * 7 and torch.equal(tiny_llama.lm_head.weight, before["lm_head.weight"])


def test_edit_survival_small_edits_round_away_large_ones_survive():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    spec = quantizers()["rtn4"]
    tiny = 1e-5 * torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    large = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    small_result, large_result = (edit_survival(w, ModuleDelta(name="w", shape=(32, 128), dense=p.double()), spec)
                                  for p in (tiny, large))
    # no code moves; what is left is the drift of the group scales, a fraction of the edit's own norm
    assert small_result["codes_changed"] == 0.0 and small_result["norm_survival"] < 0.5
    assert large_result["codes_changed"] > 0.5 and 0.7 < large_result["norm_survival"] < 1.3


def _survival_whole(weight, delta, quantize):
    """The diagnostics on the whole matrix at once, as the definition reads."""
    w, p = weight.double(), delta.double()
    before, codes_before = quantize(w.float())
    after, codes_after = quantize((w + p).float())
    return {"codes_changed": float((codes_before != codes_after).float().mean()),
            "norm_survival": float((after.double() - before.double()).norm() / p.norm())}


@pytest.mark.parametrize("name", ["rtn4", "gguf_q4_1", pytest.param("nf4", marks=needs_bitsandbytes)])
def test_edit_survival_in_row_chunks_equals_the_whole_matrix(monkeypatch, name):
    """Read chunk by chunk (64 rows here; an input width of 100 puts bitsandbytes' flat blocks of 64 across rows)
    and only where a row-sparse delta touches, the diagnostics equal those of the whole matrix."""
    import grom_core.quantization as quantization

    monkeypatch.setattr(quantization, "CHUNK_ROWS", 64)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(300, 100, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([3, 70, 71, 299])
    left, right = torch.randn(4, 2, generator=gen), torch.randn(2, 100, generator=gen)
    delta = ModuleDelta.from_factors("lm_head", left, right, row_index=rows, out_features=300)
    spec = quantizers()[name]
    got = edit_survival(w, delta, spec, head=True)
    want = _survival_whole(w, delta.full(), spec.quantizer(True))
    assert got["codes_changed"] == pytest.approx(want["codes_changed"], abs=1e-7)
    assert got["norm_survival"] == pytest.approx(want["norm_survival"], rel=1e-9)
    assert 0 < got["codes_changed"] < 0.02  # four rows of 300


@pytest.mark.parametrize("name", ["gguf_q4_1", pytest.param("nf4", marks=needs_bitsandbytes)])
def test_round_trip_in_row_chunks_equals_the_whole_matrix(tokenizer, monkeypatch, name):
    """`quantized` rounds each matrix a chunk of rows at a time (64 here, of the head's rows): the same weights as
    the whole matrix's round trip, the head in its own format. Inputs 64 wide: bitsandbytes' CPU dequantization
    (0.50) misplaces the scales of blocks that straddle rows, which no real model's widths make."""
    from conftest import random_llama

    import grom_core.quantization as quantization

    model = random_llama(tokenizer, hidden_size=64, intermediate_size=128)
    monkeypatch.setattr(quantization, "CHUNK_ROWS", 64)
    spec = quantizers()[name]
    head, down = model.lm_head.weight, model.model.layers[0].mlp.down_proj.weight
    assert head.shape[0] > 3 * 64
    want = {"head": spec.quantizer(True)(head.detach().clone())[0], "down": spec.quantize(down.detach().clone())[0]}
    with quantized(model, spec):
        assert torch.equal(head, want["head"]) and torch.equal(down, want["down"])
