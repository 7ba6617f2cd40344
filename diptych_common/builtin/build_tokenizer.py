"""Rebuilds the tokenizer files of the built-in models (`diptych-tiny`, `diptych-100m`).

The files are committed next to this script, so running it is only needed to change a tokenizer:

    python -m diptych_common.builtin.build_tokenizer [diptych-tiny|diptych-100m]
"""

import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

COMMITTED_DIR = Path(__file__).parent  # the tokenizer files of each built-in model, in a directory of its name
BUILT_TOKENIZERS = ("diptych-tiny", "diptych-100m")
VOCAB_SIZE = 512
VOCAB_SIZE_100M = 32000
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Tools are shown in a system turn first; an assistant's tool calls follow its content as `<tool_call>`
# and a JSON list of {"name", "arguments"} (what the gateway's grammar makes the model write); a tool's
# answer is a `tool` turn that names its call.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n"
    'To call tools, answer <tool_call> and a JSON list of {"name": ..., "arguments": {...}}.</s>\n{% endif %}'
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['tool_call_id'] %}[{{ message['tool_call_id'] }}] {% endif %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}<tool_call>{{ message['tool_calls'] | map(attribute='function') | list | tojson }}"
    "{% endif %}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A small, fixed corpus: the merges only need to be plausible, the model's weights are random.
CORPUS = """
Diptych serves large language models with the two phases of inference on separate fleets.
Prefill runs the prompt, builds the key and value cache and produces the first token.
Decode extends the cache one token at a time and streams the tokens to the client.
The gateway authenticates the request, tokenizes the prompt, picks a prefill worker and a decode
worker, and hands the cache from one to the other without carrying it. Every request is metered by
phase: input tokens, cached input tokens and output tokens are billed at their own prices.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def generate(prompt, max_tokens=16, temperature=0.0): return model(prompt)
{"role": "user", "content": "Write a haiku about the sea."} 0123456789 + - * / = < > ( ) [ ] { }
Once upon a time, in a land far away, there lived a model that answered every question.
"""


def pseudo_word_corpus(seed: int = 0, draws: int = 40000) -> list[str]:
    """Deterministic text with enough distinct words for a 32000-token vocabulary, each word repeated
    by a Zipf-like count so that the merges come out in a stable order. Built here, so nothing is downloaded."""
    rng = random.Random(seed)
    onsets = [
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "br",
        "cl",
        "dr",
        "fl",
        "gr",
        "pl",
        "pr",
        "st",
        "tr",
        "sh",
        "ch",
        "th",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]

    def word() -> str:
        return "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))

    words = sorted({word() for _ in range(draws)})
    return [CORPUS] * 4 + [" ".join([" " + w] * (1 + 2000 // (rank + 1))) for rank, w in enumerate(words)]


def build_tokenizer(
    vocab_size: int = VOCAB_SIZE, texts: list[str] | None = None, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts or [CORPUS] * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def write_tokenizer(name: str, directory: Path = COMMITTED_DIR) -> Path:
    """Writes the built-in model's tokenizer files into `directory`/`name`; returns that directory."""
    output_dir = directory / name
    if name == "diptych-tiny":
        build_tokenizer().save_pretrained(output_dir)
    elif name == "diptych-100m":
        tokenizer = build_tokenizer(VOCAB_SIZE_100M, pseudo_word_corpus(), model_max_length=2048)
        tokenizer.save_pretrained(output_dir)
        # On one line instead of pretty-printed: half the size for a 32000-token vocabulary.
        tokenizer.backend_tokenizer.save(str(output_dir / "tokenizer.json"), pretty=False)
    else:
        raise SystemExit(f"unknown built-in model {name!r}")
    return output_dir


if __name__ == "__main__":
    for model_name in sys.argv[1:] or ["diptych-tiny"]:
        print(f"wrote {write_tokenizer(model_name)}")
