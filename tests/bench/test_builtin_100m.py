"""The benchmark's built-in model `diptych-100m`: its tokenizer covers exactly the model's vocabulary and
its shape is the 100 M-parameter Llama the benchmark claims."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from diptych_common.builtin import BUILTIN_MODELS, DIPTYCH_100M, builtin_model_for


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_every_builtin_tokenizer_covers_its_model_vocabulary(name):
    model = BUILTIN_MODELS[name]
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_dir)
    assert len(tokenizer) == model.llama_config["vocab_size"]
    assert tokenizer.bos_token_id == model.llama_config["bos_token_id"]
    assert tokenizer.eos_token_id == model.llama_config["eos_token_id"]
    assert tokenizer.pad_token_id == model.llama_config["pad_token_id"]
    text = "The cache moves from prefill to decode, and 42 tokens follow."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_100m_has_the_shape_the_benchmark_reports():
    assert builtin_model_for("builtin:diptych-100m") is DIPTYCH_100M
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**DIPTYCH_100M.llama_config))
    parameters = sum(p.numel() for p in model.parameters())
    assert 99e6 < parameters < 101e6
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        12,
        768,
        12,
        4,
    )


def test_1b_has_the_shape_of_a_1b_class_llama():
    model_spec = builtin_model_for("builtin:diptych-1b")
    assert model_spec is not None
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_spec.llama_config))
    parameters = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < parameters < 1.1e9
    assert model_spec.tokenizer_dir.name == "diptych-100m"
