import pytest
import torch
from conftest import RETAIN

from grom_core.capture import collect
from grom_core.data import make_batches
from grom_core.errors import FingerprintMismatchError, NonFiniteError, ShapeMismatchError
from grom_core.fingerprint import weights_fingerprint
from grom_core.statistics import GramStats, accumulate

MODULES = ["model.layers.1.mlp.down_proj", "lm_head"]


def test_accumulated_gram_equals_the_gram_of_all_keys(tiny_llama, tokenizer):
    batches = make_batches(tokenizer, RETAIN[:20], batch_size=6)
    stats = accumulate(tiny_llama, batches, MODULES, fingerprint="fp", data_digest="dd")
    keys = collect(tiny_llama, batches, inputs=MODULES, early_stop=False)
    for name in MODULES:
        x = keys.inputs[name].double()
        assert stats[name].count == x.shape[0]
        assert torch.allclose(stats[name].gram, x.T @ x, rtol=1e-12, atol=1e-10)
        assert torch.allclose(stats[name].key_sum, x.sum(0), rtol=1e-12, atol=1e-10)
        assert stats[name].gram.dtype == torch.float64


def test_batches_by_length_keep_ids_pad_less_and_give_the_same_statistics(tiny_llama, tokenizer):
    from grom_core.data import Example

    examples = [Example(text=" ".join(["word"] * (1 + 7 * (i % 5)))) for i in range(20)] + RETAIN[:10]
    in_order = make_batches(tokenizer, examples, batch_size=4, first_id=100)
    by_length = make_batches(tokenizer, examples, batch_size=4, first_id=100, by_length=True)
    ids = torch.cat([b.example_ids for b in by_length])
    assert sorted(ids.tolist()) == list(range(100, 130)) and ids.tolist() != list(range(100, 130))
    for batch in by_length:  # each row is its example, whatever batch it landed in
        for row, example_id in enumerate(batch.example_ids.tolist()):
            alone = make_batches(tokenizer, [examples[example_id - 100]], batch_size=1)[0]
            n = int(alone.attention_mask.sum())
            assert batch.input_ids[row, :n].equal(alone.input_ids[0, :n]) and int(batch.attention_mask[row].sum()) == n
    width = sum(b.input_ids.numel() for b in by_length)
    assert width < sum(b.input_ids.numel() for b in in_order)
    first = accumulate(tiny_llama, in_order, MODULES, fingerprint="fp")
    second = accumulate(tiny_llama, by_length, MODULES, fingerprint="fp")
    for name in MODULES:  # the same keys up to float32 rounding (the model runs batches of other widths)
        assert first[name].count == second[name].count
        scale = float(first[name].gram.abs().max())
        assert torch.allclose(first[name].gram, second[name].gram, rtol=1e-5, atol=1e-6 * scale)


def test_merged_shards_equal_the_whole(tiny_llama, tokenizer):
    batches = make_batches(tokenizer, RETAIN[:24], batch_size=5)
    whole = accumulate(tiny_llama, batches, MODULES, fingerprint="fp")
    first = accumulate(tiny_llama, batches[:2], MODULES, fingerprint="fp", data_digest="a")
    second = accumulate(tiny_llama, batches[2:], MODULES, fingerprint="fp", data_digest="b")
    for name in MODULES:
        merged = first[name].merge(second[name], data_digest="whole")
        assert merged.count == whole[name].count and merged.data_digest == "whole"
        assert torch.allclose(merged.gram, whole[name].gram, rtol=1e-12, atol=1e-9)
        assert merged.merge(GramStats.empty(name, merged.dim, "fp")).count == merged.count
    assert first[MODULES[0]].merge(second[MODULES[0]]).data_digest not in ("a", "b", "")


def test_merge_refuses_other_models_and_modules():
    a = GramStats.empty("m", 3, fingerprint="one")
    with pytest.raises(FingerprintMismatchError):
        a.merge(GramStats.empty("m", 3, fingerprint="two"))
    with pytest.raises(ShapeMismatchError):
        a.merge(GramStats.empty("other", 3, fingerprint="one"))


def test_save_load_round_trip(tmp_path, tiny_llama, tokenizer):
    fp = weights_fingerprint(tiny_llama)
    stats = accumulate(tiny_llama, make_batches(tokenizer, RETAIN[:8]), MODULES, fingerprint=fp, data_digest="d")
    path = stats["lm_head"].save(tmp_path / "cache" / "lm_head.safetensors")
    back = GramStats.load(path, expect_fingerprint=fp)
    assert torch.equal(back.gram, stats["lm_head"].gram) and torch.equal(back.key_sum, stats["lm_head"].key_sum)
    assert (back.module, back.count, back.fingerprint, back.data_digest) == ("lm_head", stats["lm_head"].count, fp, "d")
    with pytest.raises(FingerprintMismatchError, match="recompute"):
        GramStats.load(path, expect_fingerprint="0" * 64)


def test_update_rejects_bad_keys():
    stats = GramStats.empty("m", 4)
    with pytest.raises(ShapeMismatchError):
        stats.update(torch.ones(3, 5))
    with pytest.raises(NonFiniteError):
        stats.update(torch.tensor([[1.0, float("inf"), 0.0, 0.0]]))
    assert stats.count == 0
