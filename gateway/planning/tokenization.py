"""Tokenizers of the served models, loaded once per model source, and run off the event loop.

Tokenizing (and rendering a chat template, and compiling a grammar) costs time proportional to the
request: done in the event loop, one long prompt would stall every other stream the gateway serves.
`run_off_loop` runs such work on a small pool of threads instead, of which one tenant's requests hold at
most TENANT_THREADS at once, so that another tenant's always finds one free. Prompts are also bounded in
bytes before they get here (`validation.py`), and tokenized by the tokenizer's batch call, which lets go
of the GIL while it encodes: a prompt longer than the context is refused by its length before its tokens
become a Python list (that list, for 4 MiB of text, held the GIL for a third of a second).
"""

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar, TypeVarTuple

from transformers import AutoTokenizer

from diptych_common.builtin import tokenizer_dir_for
from gateway.types import Tokenizer

Result = TypeVar("Result")
Args = TypeVarTuple("Args")

TOKENIZER_THREADS = 4
TENANT_THREADS = 2  # of TOKENIZER_THREADS, the most one tenant's requests hold at once
TOKENIZER_THREAD_PREFIX = "diptych-tokenize"
# Below the event loop's thread and the workers in the CPU's queue: a core short, the loop streaming every
# tenant's tokens runs first, and a long prompt's tokenizing waits.
TOKENIZER_NICENESS = 10  # added to the process's


def _yield_the_cpu() -> None:
    if sys.platform == "linux":  # where a thread has a priority of its own
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + TOKENIZER_NICENESS))


_pool = ThreadPoolExecutor(
    max_workers=TOKENIZER_THREADS, thread_name_prefix=TOKENIZER_THREAD_PREFIX, initializer=_yield_the_cpu
)


class TooManyTokens(ValueError):
    """A text of `count` tokens, at least the limit it was encoded against."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


@dataclass
class _TenantShare:
    threads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(TENANT_THREADS))
    users: int = 0  # its jobs running or waiting: the share is dropped with the last


_shares: dict[str, _TenantShare] = {}


async def run_off_loop(function: Callable[[*Args], Result], *args: *Args, tenant: str | None = None) -> Result:
    """`function(*args)` on the tokenizer threads, awaited without blocking the event loop. With a
    `tenant`, it waits its turn among that tenant's jobs; its thread counts against the tenant until the
    job ends, even when the caller stopped waiting for it (a cancelled job still runs once started)."""
    loop = asyncio.get_running_loop()
    if tenant is None:
        return await loop.run_in_executor(_pool, functools.partial(function, *args))
    share = _shares.setdefault(tenant, _TenantShare())
    share.users += 1
    try:
        await share.threads.acquire()
    except BaseException:
        _leave(tenant, share, released=False)
        raise
    job = _pool.submit(function, *args)
    job.add_done_callback(functools.partial(_job_ended, loop, tenant, share))
    return await asyncio.wrap_future(job)


def _job_ended(loop: asyncio.AbstractEventLoop, tenant: str, share: _TenantShare, _job: Future[Any]) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(_leave, tenant, share, True)


def _leave(tenant: str, share: _TenantShare, released: bool) -> None:
    if released:
        share.threads.release()
    share.users -= 1
    if not share.users and _shares.get(tenant) is share:
        del _shares[tenant]


TOKENIZERS_KEPT = 32  # models' tokenizers kept loaded


@lru_cache(maxsize=TOKENIZERS_KEPT)
def tokenizer_for(source: str) -> Tokenizer:
    return AutoTokenizer.from_pretrained(tokenizer_dir_for(source))


_loaded: dict[str, Tokenizer] = {}  # source -> its tokenizer, once `model_tokenizer` loaded it


async def model_tokenizer(source: str) -> Tokenizer:
    """The source's tokenizer: loaded off the event loop the first time (it reads its files), and after that
    taken as it is, without a hop to a thread and back for every request."""
    tokenizer = _loaded.get(source)
    if tokenizer is None:
        tokenizer = _loaded[source] = await run_off_loop(tokenizer_for, source)
        while len(_loaded) > TOKENIZERS_KEPT:
            del _loaded[next(iter(_loaded))]
    return tokenizer


def encode_prompt(tokenizer: Tokenizer, prompt: str, limit: int | None = None) -> list[int]:
    """Tokenizes a completion prompt exactly as the model's tokenizer does by default. TooManyTokens when
    it has `limit` tokens or more."""
    return _token_ids(tokenizer, prompt, True, limit)


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    limit: int | None = None,
) -> list[int]:
    """The messages rendered with the model's chat template (which shows the model `tools`, when given),
    tokenized. TooManyTokens when they have `limit` tokens or more."""
    shown: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
    text = tokenizer.apply_chat_template(messages, tools=shown, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):  # what tokenize=False returns
        raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
    return _token_ids(tokenizer, text, False, limit)


def _token_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool, limit: int | None) -> list[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _encodes_plainly(tokenizer, backend):
        ids: list[int] = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        _check_length(len(ids), limit)
        return ids
    # What tokenizer(text) does, less what it adds (offsets, an attention mask, Python lists of each):
    # the batch call lets go of the GIL while it encodes; the single-text one does not.
    (encoding,) = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
    _check_length(len(encoding), limit)
    encoded: list[int] = encoding.ids
    return encoded


def _check_length(count: int, limit: int | None) -> None:
    if limit is not None and count >= limit:
        raise TooManyTokens(count)


def _encodes_plainly(tokenizer: Tokenizer, backend: Any) -> bool:
    """Whether the backend encodes as `tokenizer(text)` has it encode: no truncation or padding of its own
    (transformers turns them off for the call), special tokens split as transformers would split them."""
    split = getattr(tokenizer, "split_special_tokens", False)
    return backend.truncation is None and backend.padding is None and backend.encode_special_tokens == split
