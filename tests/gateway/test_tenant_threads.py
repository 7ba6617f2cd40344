"""A request's costly CPU work (tokenizing, rendering a chat, reading and compiling its schemas) runs off the
event loop that streams every tenant's tokens, on threads of which one tenant holds at most its share; a
prompt longer than the context is refused by its length before its tokens become a Python list (building
that list holds the GIL). How long the loop still stalls is `bench/costly_bodies.py`'s to measure."""

import asyncio
import json
import threading
import tracemalloc

import pytest

from gateway.planning import structured, validation
from gateway.planning.tokenization import (
    TENANT_THREADS,
    TOKENIZER_THREAD_PREFIX,
    TOKENIZER_THREADS,
    TooManyTokens,
    encode_chat,
    encode_prompt,
    model_tokenizer,
    tokenizer_for,
)
from tests.gateway.harness import MODEL, ControlPlaneInMemory, in_process_gateway, post_json

SOURCES = ["builtin:diptych-tiny", "builtin:diptych-100m"]
KEYS = {"dip_key_a": "org_a", "dip_key_b": "org_b"}  # API key -> its tenant
TEXT = "the quick brown fox jumps over the lazy dog, 12 times; ünïcödé too. "


class TwoTenants(ControlPlaneInMemory):
    async def verify_api_key(self, api_key: str) -> dict | None:
        tenant = KEYS.get(api_key)
        return None if tenant is None else {"api_key_id": f"key_{tenant}", "organization_id": tenant}


class HeldEncoder:
    """Wraps encode_prompt: a prompt starting "held" waits in its thread until released, and counts while
    it waits; the loop is told each time one starts."""

    def __init__(self, encode, loop: asyncio.AbstractEventLoop) -> None:
        self._encode = encode
        self._loop = loop
        self.release = threading.Event()
        self.held = 0
        self.holding = asyncio.Event()  # TENANT_THREADS of them wait at once
        self.threads: set[str] = set()

    def __call__(self, tokenizer, prompt: str, limit: int) -> list[int]:
        self.threads.add(threading.current_thread().name)
        if prompt.startswith("held"):
            self._loop.call_soon_threadsafe(self._started)
            assert self.release.wait(timeout=30)
        return self._encode(tokenizer, prompt, limit)

    def _started(self) -> None:
        self.held += 1
        if self.held >= TENANT_THREADS:
            self.holding.set()


def _completion(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()


async def test_one_tenant_holds_at_most_its_share_of_the_tokenizer_threads(tmp_path, monkeypatch):
    """Tenant A sends as many requests as there are threads, each of whose tokenizing waits: it holds its
    share of them, and tenant B's request still finds a free one and is answered."""
    encoder = HeldEncoder(validation.encode_prompt, asyncio.get_running_loop())
    monkeypatch.setattr(validation, "encode_prompt", encoder)
    async with in_process_gateway(tmp_path, TwoTenants()) as gateway:
        tenant_a = {"Authorization": "Bearer dip_key_a"}
        held = [
            asyncio.create_task(post_json(gateway, "/v1/completions", _completion(f"held {i}"), tenant_a))
            for i in range(TOKENIZER_THREADS)
        ]
        try:
            await asyncio.wait_for(encoder.holding.wait(), 30)  # a hang guard, not a timing
            other = post_json(gateway, "/v1/completions", _completion("hi"), {"Authorization": "Bearer dip_key_b"})
            status, payload = await asyncio.wait_for(other, 30)
            assert status == 503, payload  # past the door: the harness has no workers
            assert encoder.held == TENANT_THREADS
        finally:
            encoder.release.set()
            answers = await asyncio.gather(*held)
    assert [status for status, _ in answers] == [503] * TOKENIZER_THREADS
    assert encoder.held == TOKENIZER_THREADS
    assert all(name.startswith(TOKENIZER_THREAD_PREFIX) for name in encoder.threads)


async def test_schemas_are_read_and_compiled_on_the_tokenizer_threads(tmp_path, monkeypatch):
    threads: list[str] = []
    problem = structured.grammar_problem

    def recording(grammar, model_source):
        threads.append(threading.current_thread().name)
        return problem(grammar, model_source)

    monkeypatch.setattr(structured, "grammar_problem", recording)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    async with in_process_gateway(tmp_path) as gateway:
        status, payload = await post_json(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 503, payload
    assert threads and all(name.startswith(TOKENIZER_THREAD_PREFIX) for name in threads)


@pytest.mark.parametrize("source", SOURCES)
def test_a_prompt_is_tokenized_exactly_as_the_model_s_tokenizer_does(source):
    tokenizer = tokenizer_for(source)
    assert encode_prompt(tokenizer, TEXT * 20) == tokenizer(TEXT * 20)["input_ids"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert encode_chat(tokenizer, messages) == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("source", SOURCES)
def test_a_prompt_over_the_limit_is_refused_before_its_tokens_become_a_list(source):
    tokenizer = tokenizer_for(source)
    text = TEXT * 16_000  # about a MiB, a few hundred thousand tokens
    count = len(tokenizer(text)["input_ids"])
    tracemalloc.start()
    try:
        with pytest.raises(TooManyTokens) as refused:
            encode_prompt(tokenizer, text, 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.count == count
    # a list of that many token ids is 8 bytes a pointer and an int object each
    assert peak < count, f"{peak >> 10} KiB of Python objects made to refuse {count} tokens"


async def test_a_loaded_tokenizer_is_taken_without_a_hop_to_a_thread():
    """The first request for a model loads its tokenizer on a thread (it reads files); every later one
    takes it as it is: its coroutine ends at its first step, having waited for nothing."""
    source = f"builtin:{MODEL}"
    loaded = await model_tokenizer(source)
    later = model_tokenizer(source)
    with pytest.raises(StopIteration) as done:
        later.send(None)
    assert done.value.value is loaded
