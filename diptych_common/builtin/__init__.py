"""Built-in models: a model shipped with Diptych, named `builtin:<name>` in the catalog.

Their tokenizers are committed files; their weights are built from a config and a seed, so
they need no download. Only plain data lives here: the workers build the torch model.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_SOURCE_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    seed: int
    llama_config: dict[str, Any] = field(default_factory=dict)  # LlamaConfig keyword arguments, each of its own type
    tokenizer: str = ""  # the committed tokenizer directory it uses: its own name when empty

    @property
    def tokenizer_dir(self) -> Path:
        return Path(__file__).parent / (self.tokenizer or self.name)


DIPTYCH_TINY = BuiltinModel(
    name="diptych-tiny",
    seed=0,
    llama_config=dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Far above the usual 0.02: random weights at 0.02 give near-constant greedy text,
        # which would make token-for-token equality tests weak.
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    ),
)

# The benchmark's model: the shape of a small production Llama (100 M parameters with tied embeddings).
DIPTYCH_100M = BuiltinModel(
    name="diptych-100m",
    seed=0,
    llama_config=dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
    ),
)

# The GPU benchmark's model: the shape of a 1B-class production Llama (16 layers of 2048, grouped-query attention
# with 8 KV heads, 1.0 B parameters with tied embeddings), on diptych-100m's tokenizer. 2 GB in bfloat16.
DIPTYCH_1B = BuiltinModel(
    name="diptych-1b",
    seed=0,
    tokenizer="diptych-100m",
    llama_config=dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
    ),
)

BUILTIN_MODELS = {model.name: model for model in (DIPTYCH_TINY, DIPTYCH_100M, DIPTYCH_1B)}


def builtin_model_for(source: str) -> BuiltinModel | None:
    """The built-in model a catalog source names, or None when the source is a local directory."""
    if not source.startswith(BUILTIN_SOURCE_PREFIX):
        return None
    name = source.removeprefix(BUILTIN_SOURCE_PREFIX)
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {sorted(BUILTIN_MODELS)}") from None


def tokenizer_dir_for(source: str) -> Path:
    builtin = builtin_model_for(source)
    return builtin.tokenizer_dir if builtin else Path(source)
