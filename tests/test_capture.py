import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.capture import KeyCapture, capture, collect, supervised_mask
from grom_core.data import IGNORE_INDEX, Example, make_batches
from grom_core.errors import NonFiniteError, UnsupportedArchitectureError


def manual_inputs(model, module, batch):
    """The module's full (B, T, n) input from a hook-free reconstruction: a plain forward with a one-off hook."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    handle.remove()
    return seen["x"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_captures_exactly_the_inputs_at_supervised_positions(family, tiny_llama, tiny_gpt2, tokenizer):
    model = tiny_llama if family == "llama" else tiny_gpt2
    adapter = ModelAdapter.for_model(model)
    names = [adapter.down_proj_names[1], adapter.lm_head_name]
    batch = make_batches(tokenizer, FORGET[:5] + [Example(text="a short raw text")], batch_size=6)[0]
    with capture(model, inputs=names) as cap:
        got = cap.run(batch)
    mask = supervised_mask(batch)
    # every kept position predicts a supervised, non-padding token, and every such position is kept
    expected_mask = (batch.labels[:, 1:] != IGNORE_INDEX) & (batch.attention_mask[:, 1:] == 1)
    assert torch.equal(mask[:, :-1], expected_mask) and not mask[:, -1].any()
    assert got.size == int(expected_mask.sum()) == batch.num_supervised
    for name in names:
        full = manual_inputs(model, adapter.module(name), batch)
        assert torch.equal(got.inputs[name], full[mask])
        assert got.inputs[name].shape[1] == weight_out_in(adapter.module(name)).shape[1]
    rows, cols = mask.nonzero(as_tuple=True)
    assert torch.equal(got.next_tokens, batch.input_ids[rows, cols + 1])
    assert torch.equal(got.example_ids, batch.example_ids[rows])


def test_padding_never_captured(tiny_llama, tokenizer):
    short, long = Example(question="Hi?", answer="Yes."), FORGET[0]
    batch = make_batches(tokenizer, [short, long], batch_size=2)[0]
    assert (batch.attention_mask[0] == 0).any()  # the short example is padded
    with capture(tiny_llama, inputs=["lm_head"]) as cap:
        got = cap.run(batch)
    pad_start = int(batch.attention_mask[0].sum())
    assert not ((got.example_ids == 0) & (got.positions >= pad_start - 1)).any()


def test_early_stop_gives_the_same_keys_and_hooks_are_removed(tiny_llama, tokenizer):
    batches = make_batches(tokenizer, RETAIN[:6], batch_size=3)
    name = "model.layers.0.mlp.down_proj"
    calls = []
    head_hook = tiny_llama.lm_head.register_forward_hook(lambda *a: calls.append(1))
    early = collect(tiny_llama, batches, inputs=[name], early_stop=True)
    assert not calls  # the LM head never ran
    full = collect(tiny_llama, batches, inputs=[name], early_stop=False)
    head_hook.remove()
    assert len(calls) == 2 and torch.equal(early.inputs[name], full.inputs[name])
    assert not tiny_llama.model.layers[0].mlp.down_proj._forward_pre_hooks


def test_hooks_removed_after_an_error_and_non_finite_keys_refused(tiny_llama, tokenizer):
    batch = make_batches(tokenizer, FORGET[:2])[0]
    tiny_llama.model.layers[0].mlp.up_proj.weight.data[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="float32"), capture(tiny_llama, inputs=["lm_head"]) as cap:
        cap.run(batch)
    assert not tiny_llama.lm_head._forward_pre_hooks


def test_unknown_module_name_is_refused_before_hooking(tiny_llama):
    with pytest.raises(UnsupportedArchitectureError, match="model.layers.9"):
        KeyCapture(tiny_llama, inputs=["model.layers.9.mlp.down_proj"])
