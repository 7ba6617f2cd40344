"""Rebuilds the tokenizer files of the built-in `diptych-tiny` model.

The files are committed next to this script, so running it is only needed to change the tokenizer:

    python -m diptych_common.builtin.build_tokenizer
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OUTPUT_DIR = Path(__file__).parent / "diptych-tiny"

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


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
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
        model_max_length=1024,
    )


if __name__ == "__main__":
    build_tokenizer().save_pretrained(OUTPUT_DIR)
    print(f"wrote {OUTPUT_DIR}")
