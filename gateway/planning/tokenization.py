"""Tokenizers of the served models, loaded once per model source, and run off the event loop.

Tokenizing (and rendering a chat template) costs time proportional to the prompt: done in the event
loop, one long prompt would stall every other stream the gateway serves. `run_off_loop` runs such work
on a small pool of threads instead; prompts are also bounded in bytes before they get here
(`validation.py`).
"""

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from transformers import AutoTokenizer

from diptych_common.builtin import tokenizer_dir_for

TOKENIZER_THREADS = 4
TOKENIZER_THREAD_PREFIX = "diptych-tokenize"
_pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix=TOKENIZER_THREAD_PREFIX)


async def run_off_loop(function, *args):
    """`function(*args)` on the tokenizer threads, awaited without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(function, *args))


@lru_cache(maxsize=32)
def tokenizer_for(source: str):
    return AutoTokenizer.from_pretrained(tokenizer_dir_for(source))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Tokenizes a completion prompt exactly as the model's tokenizer does by default."""
    return tokenizer(prompt)["input_ids"]


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The messages rendered with the model's chat template (which shows the model `tools`, when given), tokenized."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
