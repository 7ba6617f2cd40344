"""Asynchronous scheduling on the built-in model: the next step is scheduled while one runs, and every
output still equals `transformers` generate, and the same engine stepping one step at a time; a token
computed after its request ended is never handed out nor counted, and every block is freed once."""

import asyncio
import json
import threading
from collections import Counter

import jsonschema
import pytest
from transformers import AutoTokenizer

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import JSON_SCHEMA, Grammar, llguidance_tokenizer
from diptych_common.prefix_hash import block_hash, chain_root
from tests.workers.conftest import prompts, wait_until
from tests.workers.test_engine import assert_all_blocks_free, collect, greedy, settle
from tests.workers.test_request_isolation import FAILED_PREFIX, poison_logits
from tests.workers.test_structured_outputs import SCHEMA
from workers.engine import sampling as sampling_module
from workers.engine.core import Engine, EngineConfig, RequestFailed
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams, StopCriteria
from workers.runner.model_runner import ModelRunner
from workers.structured.compiler import GrammarCompiler


@pytest.fixture
def start_engine(tiny_model, executor):
    """Engines on the built-in model with stop criteria of the test's choosing; stopped after the test."""
    tasks = []

    def start(eos: frozenset[int] = frozenset(), context_length: int = 1024, **options) -> Engine:
        config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **options})
        runner = ModelRunner(tiny_model, config.num_kv_blocks, config.block_size)
        engine = Engine(runner, config, StopCriteria(eos, context_length), executor)
        tasks.append(asyncio.get_running_loop().create_task(engine.run()))
        return engine

    yield start
    for task in tasks:
        task.cancel()


def named_blocks(sequences: list[list[int]], block_size: int = 16) -> set[int]:
    """The prefix-cache names of every full block of each sequence."""
    names = set()
    for tokens in sequences:
        parent = chain_root("")
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = block_hash(parent, tokens[start : start + block_size])
            names.add(parent)
    return names


def count_passes(engine) -> list[int]:
    """Records the number of inputs of every forward pass the engine runs."""
    passes: list[int] = []
    original = engine.runner.execute

    def execute(inputs):
        passes.append(len(inputs))
        return original(inputs)

    engine.runner.execute = execute
    return passes


def count_frees(engine) -> Counter:
    """Counts, per request id, the frees that gave blocks back."""
    freed: Counter = Counter()
    original = engine.kv.free

    def free(request_id: str) -> None:
        if engine.kv.block_tables.get(request_id):
            freed[request_id] += 1
        original(request_id)

    engine.kv.free = free
    return freed


def add_greedy(engine, name: str, batch: list[list[int]], counts: list[int]) -> list:
    return [
        engine.add(EngineRequest(f"{name}{i}", p, greedy(n)))
        for i, (p, n) in enumerate(zip(batch, counts, strict=True))
    ]


async def test_requests_arriving_while_others_decode_match_generate(start_engine, reference):
    """Prompts of many lengths (chunked by a small budget), some arriving after others have tokens out,
    three of one prompt at once (what n choices are to the engine), each to its own max_tokens."""
    engine = start_engine(token_budget=48)
    assert engine.config.async_scheduling  # the default
    early = prompts([5, 40, 100, 17], salt=60)
    counts = [20, 9, 14, 30]
    handles = [
        engine.add(EngineRequest(f"e{i}", p, greedy(n))) for i, (p, n) in enumerate(zip(early, counts, strict=True))
    ]
    firsts = [await handle.outputs.get() for handle in handles]
    late = prompts([70, 3], salt=61) + prompts([33], salt=62) * 3
    late_counts = [12, 25, 7, 11, 16]
    late_handles = add_greedy(engine, "l", late, late_counts)
    rests = await asyncio.gather(*(collect(h) for h in handles + late_handles))
    for first, prompt, count, rest in zip(firsts, early, counts, rests[: len(early)], strict=True):
        assert [first.token_id, *rest] == reference(prompt, count)
    for prompt, count, output in zip(late, late_counts, rests[len(early) :], strict=True):
        assert output == reference(prompt, count)
    await settle(engine)
    assert_all_blocks_free(engine)
    assert engine.stats().tokens_generated == sum(counts) + sum(late_counts)


async def test_a_stop_token_ends_a_request_and_the_token_after_it_is_never_handed_out(start_engine, reference):
    batch = prompts([12, 30, 55, 8], salt=63)
    full = [reference(prompt, 24) for prompt in batch]
    eos = full[1][9]  # the 10th token of the second request ends it; others end wherever it comes, if it does
    expected = [output[: output.index(eos) + 1] if eos in output else output for output in full]
    engine = start_engine(eos=frozenset([eos]), enable_prefix_caching=True)
    freed = count_frees(engine)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    handles = [engine.add(EngineRequest(f"s{i}", p, params)) for i, p in enumerate(batch)]
    outputs = await asyncio.gather(*(everything(h) for h in handles))
    assert [[o.token_id for o in output] for output in outputs] == expected
    for output, tokens in zip(outputs, expected, strict=True):
        assert output[-1].finished and not any(o.finished for o in output[:-1])
        assert output[-1].finished_by_eos == (tokens[-1] == eos)
    await settle(engine)
    assert_all_blocks_free(engine)
    assert engine.stats().tokens_generated == sum(map(len, expected))
    # blocks named are those full of tokens computed for the requests' own output, none past its last token
    named = named_blocks([p + out[:-1] for p, out in zip(batch, expected, strict=True)])
    assert set(engine.kv.cached_block_hashes()) == named
    assert set(freed) == {f"s{i}" for i in range(len(batch))} and set(freed.values()) == {1}


async def everything(handle) -> list:
    outputs = []
    while not outputs or not outputs[-1].finished:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        outputs.append(output)
    return outputs


async def test_aborts_mid_stream_end_the_stream_there_and_batch_mates_stay_exact(start_engine, reference):
    engine = start_engine(token_budget=64)
    freed = count_frees(engine)
    batch = prompts([20, 44, 9, 61], salt=64)
    handles = [engine.add(EngineRequest(f"a{i}", p, greedy(40))) for i, p in enumerate(batch)]
    for handle in handles:
        await handle.outputs.get()
    for _ in range(3):
        await handles[1].outputs.get()
    engine.abort("a1")
    engine.abort("a3")
    queued = {i: handles[i].outputs.qsize() for i in (1, 3)}
    survivors = await asyncio.gather(collect(handles[0]), collect(handles[2]))
    await settle(engine)
    assert {i: handles[i].outputs.qsize() for i in (1, 3)} == queued  # nothing came after the abort
    assert survivors[0] == reference(batch[0], 40)[1:] and survivors[1] == reference(batch[2], 40)[1:]
    assert_all_blocks_free(engine)
    assert set(freed.values()) == {1} and len(freed) == 4
    emitted = 2 * 40 + 1 + 3 + queued[1] + 1 + queued[3]
    assert engine.stats().tokens_generated == emitted


async def test_a_request_whose_logits_fail_fails_alone_and_its_next_token_is_discarded(start_engine, reference):
    engine = start_engine(token_budget=64)
    batch = prompts([6, 33, 70, 12], salt=65)
    handles = [engine.add(EngineRequest(f"r{i}", p, greedy(15))) for i, p in enumerate(batch[:3])]
    victim = engine.add(EngineRequest("victim", batch[3], greedy(15)))
    poison_logits(engine, "victim", at_sample=3)
    results = await asyncio.gather(*(collect(h) for h in handles), everything(victim), return_exceptions=True)
    assert results[:3] == [reference(p, 15) for p in batch[:3]]
    assert isinstance(results[3], RequestFailed) and str(results[3]).startswith(FAILED_PREFIX)
    assert "output token 2" in str(results[3])
    await settle(engine)
    assert_all_blocks_free(engine)
    assert engine.stats().tokens_generated == 3 * 15 + 2  # the victim's first two, nothing after


async def test_a_request_whose_seeded_draw_raises_fails_alone(start_engine, reference, monkeypatch):
    engine = start_engine(token_budget=64)
    original = sampling_module.seeded_fraction

    def raising_for_seed_13(seed: int, token_index: int) -> float:
        if seed == 13 and token_index == 4:
            raise RuntimeError("injected sampling failure")
        return original(seed, token_index)

    monkeypatch.setattr(sampling_module, "seeded_fraction", raising_for_seed_13)
    batch = prompts([8, 25, 50], salt=66)
    greedy_handles = [engine.add(EngineRequest(f"r{i}", p, greedy(10))) for i, p in enumerate(batch)]
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    survivor = engine.add(EngineRequest("seeded", batch[0], seeded))
    victim = engine.add(EngineRequest("victim", batch[1], SamplingParams(temperature=0.8, seed=13, max_tokens=10)))
    results = await asyncio.gather(
        *(collect(h) for h in greedy_handles), collect(survivor), collect(victim), return_exceptions=True
    )
    assert results[:3] == [reference(p, 10) for p in batch]
    alone = start_engine(async_scheduling=False)
    assert results[3] == await collect(alone.add(EngineRequest("seeded", batch[0], seeded)))
    assert isinstance(results[4], RequestFailed) and "injected sampling failure" in str(results[4])
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_blocks_freed_by_finished_requests_go_to_waiting_ones_exactly(start_engine, reference):
    """A pool that holds two requests at a time: each one admitted takes blocks the finished ones freed
    while a step that still computed for them may have run."""
    engine = start_engine(num_kv_blocks=8, token_budget=64, enable_prefix_caching=False)
    batch = prompts([40, 30, 45, 20, 35, 25], salt=67)
    counts = [9, 14, 6, 17, 8, 12]
    outputs = await asyncio.gather(
        *(
            collect(engine.add(EngineRequest(f"q{i}", p, greedy(n))))
            for i, (p, n) in enumerate(zip(batch, counts, strict=True))
        )
    )
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    await settle(engine)
    assert_all_blocks_free(engine)
    assert engine.stats().prompt_tokens_computed >= sum(map(len, batch))


def mixed_requests() -> list[EngineRequest]:
    """Greedy, seeded, penalized, biased and logprob-asking requests, all added before the first step."""
    batch = prompts([14, 37, 60, 9, 25, 48], salt=68)
    options = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 3, "top_k": 40},
        {"temperature": 0.0, "frequency_penalty": 1.2, "presence_penalty": 0.4, "logprobs": True, "top_logprobs": 3},
        {"temperature": 1.1, "seed": 8, "top_p": 0.8, "logit_bias": ((7, 3.0),)},
        {"temperature": 0.7, "seed": 21, "presence_penalty": -0.5, "logprobs": True},
        {"temperature": 0.0, "logit_bias": ((11, 1.5), (300, -2.0)), "logprobs": True, "top_logprobs": 5},
    ]
    counts = [17, 23, 12, 30, 19, 26]
    return [
        EngineRequest(f"m{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, **option))
        for i, (prompt, option, n) in enumerate(zip(batch, options, counts, strict=True))
    ]


async def run_mixed(engine):
    """(each output's tokens and logprobs, the engine's counts, the blocks it named) of `mixed_requests`."""
    executed = count_passes(engine)
    handles = [engine.add(request) for request in mixed_requests()]
    outputs = await asyncio.gather(*(everything(h) for h in handles))
    await settle(engine)
    assert await wait_until(lambda: engine.stats().steps == len(executed))  # no step under way any more
    assert_all_blocks_free(engine)
    stats = engine.stats()
    return (
        [[(o.token_id, o.logprobs) for o in output] for output in outputs],
        (stats.tokens_generated, stats.prompt_tokens_computed, stats.steps),
        set(engine.kv.cached_block_hashes()),
    )


async def test_async_and_sync_scheduling_produce_the_same_outputs_and_counts(start_engine):
    """Every request added before the first step: both modes run the same steps (none for a token after a
    request's last), so tokens, logprobs, token counts and the blocks named are identical."""
    one_at_a_time = await run_mixed(start_engine(async_scheduling=False, token_budget=40))
    ahead = await run_mixed(start_engine(async_scheduling=True, token_budget=40))
    assert ahead == one_at_a_time
    tokens, (generated, computed, _), named = ahead
    assert generated == sum(map(len, tokens)) and computed == sum(len(r.prompt_token_ids) for r in mixed_requests())
    sequences = [r.prompt_token_ids + [t for t, _ in out[:-1]] for r, out in zip(mixed_requests(), tokens, strict=True)]
    assert named == named_blocks(sequences)


@pytest.mark.parametrize("mode", [True, False], ids=["async", "sync"])
async def test_the_next_step_is_scheduled_while_a_step_runs_only_with_async_scheduling(start_engine, reference, mode):
    """Each forward pass waits for the engine to schedule the step after it: with asynchronous scheduling
    that happens while the pass runs; one step at a time, only once it is done (the wait times out)."""
    engine = start_engine(async_scheduling=mode)
    schedules = 0
    scheduled = threading.Condition()
    original_schedule, original_execute = engine.scheduler.schedule, engine.runner.execute
    overlapped = []

    def schedule():
        nonlocal schedules
        out = original_schedule()
        with scheduled:
            schedules += 1
            scheduled.notify_all()
        return out

    def execute(inputs):
        with scheduled:
            wanted = len(overlapped) + 2  # this step's schedule and the next one's
            overlapped.append(scheduled.wait_for(lambda: schedules >= wanted, timeout=10.0 if mode else 0.2))
        return original_execute(inputs)

    engine.scheduler.schedule = schedule
    engine.runner.execute = execute
    batch = prompts([10, 21], salt=69)
    outputs = await asyncio.gather(
        *(collect(engine.add(EngineRequest(f"o{i}", p, greedy(5)))) for i, p in enumerate(batch))
    )
    assert outputs == [reference(p, 5) for p in batch]
    assert len(overlapped) == 5
    assert all(overlapped) if mode else not any(overlapped)


async def test_a_prefill_only_request_is_never_scheduled_past_its_first_token(start_engine, reference):
    engine = start_engine(token_budget=32)
    steps: list[list[tuple[int, int]]] = []
    original = engine.runner.execute

    def execute(inputs):
        steps.append([(step.start, len(step.token_ids)) for step in inputs])
        return original(inputs)

    engine.runner.execute = execute
    decoding = engine.add(EngineRequest("d", prompts([10], salt=70)[0], greedy(12)))
    await decoding.outputs.get()
    prompt = prompts([50], salt=71)[0]
    first = await collect(engine.add(EngineRequest("p", prompt, greedy(12), prefill_only=True)))
    await collect(decoding)
    assert first == reference(prompt, 1)
    # nothing was computed at or past its prompt's end (the decoding request never gets that far)
    assert sum(length for step in steps for start, length in step if length > 1) == 10 + len(prompt)
    assert not any(start >= len(prompt) for step in steps for start, _ in step)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_a_request_following_a_grammar_steps_in_turn_and_its_batch_mates_stay_exact(
    start_engine, reference, tiny_model
):
    """The grammar's next mask needs the token through the matcher on the host: the steps it samples in are
    not run ahead of (its document is the one decoding one step at a time makes), its batch-mates' are."""
    grammars = GrammarCompiler(
        llguidance_tokenizer(
            AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir), tiny_model.config.vocab_size, frozenset({1})
        )
    )
    schema = Grammar(JSON_SCHEMA, json.dumps(SCHEMA))
    documents = []
    for mode in (False, True):
        engine = start_engine(eos=frozenset({1}), async_scheduling=mode, token_budget=48)
        mates = prompts([20, 45], salt=72)
        handles = add_greedy(engine, f"g{mode}", mates, [30, 30])
        request = EngineRequest("json", [0, 5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=120))
        request.constraint = grammars.start(schema, [])
        constrained = engine.add(request)
        tokens, *outputs = await asyncio.gather(collect(constrained), *(collect(h) for h in handles))
        assert outputs == [reference(p, 30) for p in mates]
        documents.append(tokens)
        await settle(engine)
        assert_all_blocks_free(engine)
    assert documents[0] == documents[1]
    text = AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir).decode(documents[1], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
