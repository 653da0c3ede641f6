import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grom_core.adapter import ModelAdapter, is_conv1d, weight_out_in
from grom_core.errors import UnsupportedArchitectureError
from grom_core.fingerprint import weights_fingerprint


def test_llama_modules(tiny_llama):
    adapter = ModelAdapter.for_model(tiny_llama)
    assert adapter.down_proj_names == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    assert adapter.lm_head_name == "lm_head" and adapter.final_norm_name == "model.norm"
    assert adapter.norm_kind == "rms" and not adapter.lm_head_is_tied()
    u = adapter.unembedding()
    expected = tiny_llama.lm_head.weight.double() * tiny_llama.model.norm.weight.double()
    assert torch.equal(u, expected.detach())


def test_gpt2_modules_conv1d_orientation_and_tied_head(tiny_gpt2):
    adapter = ModelAdapter.for_model(tiny_gpt2)
    assert adapter.down_proj_names[0] == "transformer.h.0.mlp.c_proj"
    module = adapter.module(adapter.down_proj_names[0])
    assert is_conv1d(module)
    assert weight_out_in(module).shape == (32, 128)  # [out, in] although Conv1D stores [in, out]
    assert module.weight.shape == (128, 32)
    assert adapter.norm_kind == "layer"
    assert adapter.lm_head_is_tied()
    before = weights_fingerprint(tiny_gpt2)
    assert adapter.untie_lm_head()
    assert not adapter.lm_head_is_tied() and tiny_gpt2.config.tie_word_embeddings is False
    assert weights_fingerprint(tiny_gpt2) == before  # untying changes no number
    tiny_gpt2.lm_head.weight.data[0, 0] += 1.0
    assert tiny_gpt2.transformer.wte.weight[0, 0] != tiny_gpt2.lm_head.weight[0, 0]
    assert not adapter.untie_lm_head()


def test_gpt_neox_and_qwen2(tokenizer):
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4))
    adapter = ModelAdapter.for_model(neox)
    assert adapter.down_proj_names == ["gpt_neox.layers.0.mlp.dense_4h_to_h", "gpt_neox.layers.1.mlp.dense_4h_to_h"]
    assert adapter.final_norm_name == "gpt_neox.final_layer_norm" and adapter.lm_head_name == "lm_head"
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert ModelAdapter.for_model(qwen).down_proj_names[1] == "model.layers.1.mlp.down_proj"


def test_unknown_architecture_says_how_to_name_by_hand(tiny_llama):
    tiny_llama.config.model_type = "mystery"
    with pytest.raises(UnsupportedArchitectureError, match="ModelAdapter.from_names"):
        ModelAdapter.for_model(tiny_llama)
    adapter = ModelAdapter.from_names(tiny_llama, layers="model.layers", down_proj="mlp.down_proj",
                                      final_norm="model.norm")
    assert adapter.num_layers == 3 and adapter.lm_head_name == "lm_head"


def test_wrong_hand_names_are_named(tiny_llama):
    with pytest.raises(UnsupportedArchitectureError, match="model.blocks"):
        ModelAdapter.from_names(tiny_llama, layers="model.blocks", down_proj="mlp.down_proj", final_norm="model.norm")
    with pytest.raises(UnsupportedArchitectureError, match="mlp.out"):
        ModelAdapter.from_names(tiny_llama, layers="model.layers", down_proj="mlp.out", final_norm="model.norm")
    with pytest.raises(UnsupportedArchitectureError, match="only nn.Linear"):
        ModelAdapter.from_names(tiny_llama, layers="model.layers", down_proj="mlp.act_fn", final_norm="model.norm")
