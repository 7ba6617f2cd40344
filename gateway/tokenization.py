"""Tokenizers of the served models, loaded once per model source."""

from functools import lru_cache

from transformers import AutoTokenizer

from diptych_common.builtin import tokenizer_dir_for


@lru_cache(maxsize=32)
def tokenizer_for(source: str):
    return AutoTokenizer.from_pretrained(tokenizer_dir_for(source))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Tokenizes a completion prompt exactly as the model's tokenizer does by default."""
    return tokenizer(prompt)["input_ids"]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
