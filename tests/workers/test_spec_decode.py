"""Speculative decoding: drafts are verified in one step, greedy output stays equal to `transformers`
generate token for token (prompt lookup and draft models, colocated and split), stops cut an accepted run
exactly where decoding one token at a time stops, and drafts count against the budget and KV blocks.

Prompt lookup only finds drafts where the continuation copies earlier tokens; the built-in models' random
weights copy nothing, so the tests that need accepted drafts run the benchmark's copying model (a
hand-set induction head, `bench.spec_decode.copying_model`) on prompts that repeat a block of tokens."""

import argparse
import asyncio
import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.spec_decode import copying_model
from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.prefix_hash import block_hash, chain_root
from diptych_common.proto.v1 import worker_pb2
from tests.workers.conftest import prefilled, prompts
from tests.workers.serving import Worker, sampling, split
from tests.workers.test_engine import assert_all_blocks_free, collect, greedy, settle
from workers.engine.core import Engine, EngineConfig
from workers.engine.kv_cache_manager import KVCacheManager, draft_blocks
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams, StopCriteria
from workers.engine.scheduler import Scheduler
from workers.models.step import StepInput
from workers.runner.decode_graphs import DecodeGraphs, DecodeGraphSpec
from workers.runner.model_runner import ModelRunner
from workers.serving.load import WorkerLoad
from workers.serving.server import Role
from workers.spec_decode.build import build_proposer
from workers.spec_decode.config import SpecConfig, add_cli_arguments, spec_config_from_args
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.ngram import NgramProposer
from workers.spec_decode.proposer import DraftRequest
from workers.spec_decode.verify import Verdict, verify

NGRAM = SpecConfig("ngram", num_draft_tokens=4)
SAME_MODEL_DRAFT = SpecConfig("draft", num_draft_tokens=3, draft_model="builtin:diptych-tiny")


def repeated_blocks(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Per length, a block of distinct tokens said three times and then begun again: a copying model's
    continuation is the block again."""
    rng = random.Random(seed)
    batch = []
    for length in lengths:
        block = rng.sample(range(3, 512), length)
        batch.append(block * 3 + block[: length // 3])
    return batch


@pytest.fixture(scope="session")
def copier():
    return copying_model()


def generate(model, prompt: list[int], count: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def start_engine(executor):
    """Starts engines on any model (256 blocks of 16 tokens, context 1024 unless told); stops them after."""
    tasks = []

    def start(model, stop: StopCriteria | None = None, **options) -> Engine:
        config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **options})
        runner = ModelRunner(model, config.num_kv_blocks, config.block_size)
        engine = Engine(runner, config, stop or StopCriteria(frozenset(), 1024), executor)
        tasks.append(asyncio.get_running_loop().create_task(engine.run()))
        return engine

    yield start
    for task in tasks:
        task.cancel()


async def run_batch(engine, batch, counts, params=greedy) -> list[list[int]]:
    handles = [
        engine.add(EngineRequest(f"r{i}", p, params(n))) for i, (p, n) in enumerate(zip(batch, counts, strict=True))
    ]
    return list(await asyncio.gather(*(collect(h) for h in handles)))


# ---- proposers, acceptance rule, settings ------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_recurring_run():
    proposer = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
    assert proposer.propose_one(tokens, 2) == [8, 9]  # "5 6 7" recurs at 0..2; "6 7" alone at 5..6 is shorter
    assert proposer.propose_one([1, 2, 3, 4, 2, 3], 3) == [4, 2, 3]
    assert NgramProposer(1, 2).propose_one([1, 2, 8, 1, 2, 9, 1, 2], 3) == [9, 1, 2]  # the latest occurrence
    assert proposer.propose_one([1, 2, 3, 4], 3) == []  # nothing recurs
    assert NgramProposer(2, 3).propose_one([1, 2, 3, 4, 9, 4], 3) == []  # a lone recurring token is too short
    assert proposer.propose_one([7, 8, 9, 7, 8, 9, 7], 5) == [8, 9, 7, 8, 9]  # a short period continues itself
    assert proposer.propose_one([1, 2, 1], 0) == []


def test_verify_keeps_the_longest_matching_run_of_drafts_and_one_pick_more():
    assert verify([4, 5, 6], [4, 5, 6, 7]) == Verdict([4, 5, 6, 7], 3)
    assert verify([4, 5, 6], [4, 9, 6, 7]) == Verdict([4, 9], 1)
    assert verify([4, 5, 6], [8, 5, 6, 7]) == Verdict([8], 0)
    assert verify([], [3]) == Verdict([3], 0)
    failure = RuntimeError("row 2 was not finite")
    assert verify([4, 5], [4, 9, failure]) == Verdict([4, 9], 1)  # a failed pick the verdict needs not
    assert verify([4, 5], [4, failure, 6]) is failure
    with pytest.raises(ValueError, match="2 drafts need 3 picks, not 2"):
        verify([4, 5], [4, 5])


def test_bad_speculative_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="'medusa' is not one of ngram, draft"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num_draft_tokens must be between 1 and 64, not 0"):
        SpecConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="1 <= ngram_min <= ngram_max, not 3 and 2"):
        SpecConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="'draft' needs a draft model"):
        SpecConfig("draft")
    different_vocabulary = SpecConfig("draft", draft_model="builtin:diptych-100m")
    with pytest.raises(ValueError, match="vocabulary has 32000 tokens, the served model's 512"):
        build_proposer(different_vocabulary, 512, "cpu", draft_blocks)
    with pytest.raises(ValueError, match="cannot end in 2 drafts"):
        StepInput([5, 6], 10, [0], True, num_draft_tokens=2)


def test_the_worker_flags_build_the_speculative_settings():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert spec_config_from_args(parser.parse_args([])) is None
    args = parser.parse_args(["--speculative", "ngram", "--num-draft-tokens", "6", "--ngram-max", "5"])
    assert spec_config_from_args(args) == SpecConfig("ngram", num_draft_tokens=6, ngram_max=5)
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "builtin:diptych-tiny"])
    assert spec_config_from_args(args) == SpecConfig("draft", draft_model="builtin:diptych-tiny")
    with pytest.raises(ValueError, match="--draft-model needs --speculative draft"):
        spec_config_from_args(parser.parse_args(["--draft-model", "builtin:diptych-tiny"]))


# ---- the runner and the scheduler ----------------------------------------------------------------------


def test_a_step_with_drafts_gives_each_position_the_logits_of_decoding_it_alone(tiny_model):
    verifying = ModelRunner(tiny_model, num_blocks=64, block_size=16)
    alone = ModelRunner(tiny_model, num_blocks=64, block_size=16)
    [first] = prefilled(verifying, [30])
    prefilled(alone, [30])
    drafts = [40, 41, 42]  # positions 30..33, over the sequence's two blocks and a third
    table = [*first.block_ids, 60]
    logits = verifying.execute([StepInput(first.token_ids + drafts, 30, table, True, len(drafts))])
    assert logits.shape == (4, tiny_model.config.vocab_size)
    one_at_a_time = [
        alone.execute([StepInput([token], 30 + offset, table, True)])[0]
        for offset, token in enumerate(first.token_ids + drafts)
    ]
    torch.testing.assert_close(logits, torch.stack(one_at_a_time), atol=1e-4, rtol=1e-4)
    graphs = DecodeGraphs(verifying, DecodeGraphSpec(max_batch=4, max_blocks=4, capture=False))
    assert graphs.covers([StepInput([5], 30, table, True)])
    assert not graphs.covers([StepInput([5, 40], 30, table, True, 1)])  # a step with drafts runs eagerly


def _decoding(scheduler: Scheduler, drafts_by_length: dict[int, list[int]]) -> list[EngineRequest]:
    """Requests whose prompts (one per length) are computed and whose first token is out, holding drafts."""
    requests = []
    for length in drafts_by_length:
        params = SamplingParams(temperature=0.0, max_tokens=100)
        requests.append(EngineRequest(f"r{length}", list(range(10, 10 + length)), params))
        scheduler.add(requests[-1])
    for chunk in scheduler.schedule().chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
    for request, drafts in zip(requests, drafts_by_length.values(), strict=True):
        request.output_token_ids.append(7)
        request.draft_token_ids = drafts
    return requests


def test_drafts_count_against_the_token_budget_and_get_blocks():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, token_budget=16)
    first, second = _decoding(scheduler, {6: [1, 2, 3, 4, 5], 4: [6, 7, 8]})
    scheduler.token_budget = 8
    out = scheduler.schedule()
    [a, b] = out.chunks
    assert (a.start, a.num_tokens, a.draft_token_ids) == (6, 6, [1, 2, 3, 4, 5])
    assert (b.start, b.num_tokens, b.draft_token_ids) == (4, 2, [6])  # the 2 tokens the budget has left
    assert a.samples and b.samples and out.num_tokens == 8
    assert len(kv.block_ids(first.request_id)) == kv.blocks_for(first.num_tokens + 5)  # blocks for every draft
    assert len(kv.block_ids(second.request_id)) == kv.blocks_for(second.num_tokens + 1)


def test_drafts_never_preempt_a_request():
    kv = KVCacheManager(4, 4)  # 16 tokens of KV
    scheduler = Scheduler(kv, token_budget=32)
    # 7 and 6 tokens (prompts and first tokens): two blocks each, the pool is full
    _, second = _decoding(scheduler, {6: [], 5: [1, 2, 3, 4, 5, 6]})
    out = scheduler.schedule()
    assert not out.preempted and second in scheduler.running
    assert [chunk.num_tokens for chunk in out.chunks] == [1, 3]  # the second's drafts: the room its blocks have
    assert out.chunks[1].draft_token_ids == [1, 2]


# ---- greedy output equals generate ---------------------------------------------------------------------


async def test_prompt_lookup_on_a_copying_model_matches_generate_and_accepts_most_drafts(start_engine, copier):
    engine = start_engine(copier, speculative=NGRAM, token_budget=64)
    batch = repeated_blocks([9, 17, 30, 45, 60])
    counts = [40, 23, 37, 50, 31]
    outputs = await run_batch(engine, batch, counts)
    assert outputs == [generate(copier, p, n) for p, n in zip(batch, counts, strict=True)]
    stats = engine.stats()
    assert stats.draft_tokens_proposed > 100
    assert stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed
    assert stats.tokens_generated == sum(counts)  # billing counts exactly the tokens emitted
    assert stats.steps < sum(counts) // 2
    reported = WorkerLoad("wrk_1", False, 0.0, stats).to_proto().speculative  # what Load and /metrics show
    assert (reported.draft_tokens_proposed, reported.draft_tokens_accepted) == (
        stats.draft_tokens_proposed,
        stats.draft_tokens_accepted,
    )
    await settle(engine)
    assert_all_blocks_free(engine)
    # Blocks filled by accepted drafts are named after the tokens they hold (all but the last token,
    # whose KV is computed by no step, have their KV).
    finished = [p + out[:-1] for p, out in zip(batch, outputs, strict=True)]
    assert set(engine.kv.cached_block_hashes()) == _chain_hashes(finished, engine.kv.block_size)


async def test_prompt_lookup_on_random_prompts_matches_generate(make_engine, reference):
    engine = make_engine(speculative=SpecConfig("ngram", num_draft_tokens=5, ngram_min=1), token_budget=48)
    batch = prompts([3, 9, 16, 17, 31, 48, 70, 100], salt=31)
    counts = [30, 25, 20, 40, 18, 26, 33, 21]
    outputs = await run_batch(engine, batch, counts)
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    assert engine.stats().draft_tokens_proposed > 0  # single tokens recur in random text: drafts were tried
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_the_target_model_as_its_own_draft_is_accepted_almost_always(make_engine, reference):
    engine = make_engine(speculative=SAME_MODEL_DRAFT, token_budget=64)
    batch = prompts([5, 20, 47, 90], salt=35)
    counts = [30, 21, 26, 35]
    outputs = await run_batch(engine, batch, counts)
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    stats = engine.stats()
    assert stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0
    await settle(engine)
    assert_all_blocks_free(engine)


@pytest.fixture(scope="session")
def other_draft_model(tmp_path_factory):
    """A smaller random model of the built-in tokenizer's vocabulary, saved as a model directory."""
    directory = tmp_path_factory.mktemp("draft-model")
    config = LlamaConfig(**{**DIPTYCH_TINY.llama_config, "hidden_size": 128, "num_hidden_layers": 2})
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir).save_pretrained(directory)
    return str(directory)


async def test_a_different_draft_model_is_mostly_rejected_and_output_still_matches(
    make_engine, reference, other_draft_model
):
    engine = make_engine(speculative=SpecConfig("draft", draft_model=other_draft_model), token_budget=64)
    batch = prompts([8, 33, 64], salt=33)
    counts = [28, 19, 33]
    outputs = await run_batch(engine, batch, counts)
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    stats = engine.stats()
    assert stats.draft_tokens_accepted < 0.5 * stats.draft_tokens_proposed
    # Only blocks full of accepted tokens were named: every name is one of the finished requests' chains.
    await settle(engine)
    assert_all_blocks_free(engine)
    assert set(engine.kv.cached_block_hashes()) <= _chain_hashes(
        [p + out[:-1] for p, out in zip(batch, outputs, strict=True)], engine.kv.block_size
    )
    assert len(engine.kv.cached_block_hashes()) == sum(
        (len(p) + n - 1) // 16 for p, n in zip(batch, counts, strict=True)
    )


def _chain_hashes(sequences: list[list[int]], block_size: int) -> set[int]:
    names = set()
    for tokens in sequences:
        parent = chain_root("")
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = block_hash(parent, tokens[start : start + block_size])
            names.add(parent)
    return names


async def test_a_tiny_kv_pool_preempts_requests_with_drafts_and_recomputes_exactly(start_engine, copier):
    engine = start_engine(copier, speculative=NGRAM, num_kv_blocks=14, token_budget=64, enable_prefix_caching=False)
    batch = repeated_blocks([12, 15, 18, 10], seed=3)
    counts = [60, 50, 45, 70]
    handles = [
        engine.add(EngineRequest(f"r{i}", p, greedy(n))) for i, (p, n) in enumerate(zip(batch, counts, strict=True))
    ]
    outputs = await asyncio.gather(*(collect(h) for h in handles))
    assert sum(h.request.num_preemptions for h in handles) > 0
    assert engine.stats().draft_tokens_accepted > 50
    assert outputs == [generate(copier, p, n) for p, n in zip(batch, counts, strict=True)]
    await settle(engine)
    assert_all_blocks_free(engine)


# ---- stops inside an accepted run ---------------------------------------------------------------------


async def test_end_of_sequence_inside_an_accepted_run_ends_the_request_there(start_engine, copier):
    [prompt] = repeated_blocks([20], seed=4)
    expected = generate(copier, prompt, 30)
    # Drafts are accepted four at a time (tokens 1-5, 6-10, 11-15 come in one step each): token 12 is
    # the second of its run, at position 78, so the two drafts after it would fill the KV block it ends in.
    eos_at = 12
    engine = start_engine(copier, stop=StopCriteria(frozenset([expected[eos_at]]), 1024), speculative=NGRAM)
    runs = _record_runs(engine)
    handle = engine.add(EngineRequest("eos", prompt, SamplingParams(temperature=0.0, max_tokens=30)))
    outputs = await _all_outputs(handle)
    assert [o.token_id for o in outputs] == expected[: eos_at + 1]
    assert outputs[-1].finished and outputs[-1].finished_by_eos and not any(o.finished for o in outputs[:-1])
    assert engine.stats().tokens_generated == eos_at + 1
    assert any(cut < len(verdict) for verdict, cut in runs)  # the stop did cut an accepted run
    await settle(engine)
    assert_all_blocks_free(engine)
    # The blocks named are those full of the request's own tokens, none past the stop.
    named = set(engine.kv.cached_block_hashes())
    assert named == _chain_hashes([prompt + expected[: eos_at + 1]], engine.kv.block_size)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 7, 11])
async def test_max_tokens_with_drafts_emits_exactly_that_many(start_engine, copier, max_tokens):
    [prompt] = repeated_blocks([14], seed=5)
    engine = start_engine(copier, speculative=NGRAM)
    handle = engine.add(EngineRequest("capped", prompt, greedy(max_tokens)))
    outputs = await _all_outputs(handle)
    assert [o.token_id for o in outputs] == generate(copier, prompt, max_tokens)
    assert [o.finished for o in outputs] == [False] * (max_tokens - 1) + [True]
    assert engine.stats().tokens_generated == max_tokens


async def test_the_context_length_stops_a_request_with_drafts_where_it_stops_without(start_engine, copier):
    [prompt] = repeated_blocks([16], seed=6)  # 69 tokens; a context of 80 leaves room for 11
    engine = start_engine(copier, stop=StopCriteria(frozenset(), 80), speculative=NGRAM)
    outputs = await _all_outputs(engine.add(EngineRequest("long", prompt, greedy(11))))
    assert [o.token_id for o in outputs] == generate(copier, prompt, 11)


def _record_runs(engine) -> list[tuple[list[int], int]]:
    """Records, for every verdict, its tokens and how many of them the engine kept before a stop."""
    runs = []
    original = engine._until_stop

    def until_stop(request, verdict):
        sampled = original(request, verdict)
        runs.append((verdict.tokens, len(sampled.tokens)))
        return sampled

    engine._until_stop = until_stop
    return runs


async def _all_outputs(handle) -> list:
    outputs = []
    while not outputs or not outputs[-1].finished:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        outputs.append(output)
    return outputs


# ---- sampling, prefill-only, migration ------------------------------------------------------------------


async def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(make_engine):
    # The tiny model's distributions are broad: a draft (its own greedy pick) is accepted only when the
    # seeded draw for that token index lands on it, and rejected drafts are replaced by that same draw.
    batch = prompts([7, 26, 51], salt=36)

    def seeded(count: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=11, max_tokens=count, ignore_eos=True)

    plain = await run_batch(make_engine(), batch, [40, 40, 40], seeded)
    speculative = make_engine(speculative=SAME_MODEL_DRAFT)
    assert await run_batch(speculative, batch, [40, 40, 40], seeded) == plain
    stats = speculative.stats()
    assert 0.1 * stats.draft_tokens_proposed < stats.draft_tokens_accepted < 0.9 * stats.draft_tokens_proposed


async def test_prefill_only_requests_never_draft(start_engine, copier):
    engine = start_engine(copier, speculative=NGRAM)
    [prompt] = repeated_blocks([20], seed=8)
    handle = engine.add(EngineRequest("prefill", prompt, greedy(10), prefill_only=True))
    assert await collect(handle) == generate(copier, prompt, 1)
    assert handle.request.draft_token_ids == [] and engine.stats().draft_tokens_proposed == 0


async def test_a_migrated_request_continues_exactly_with_drafts(start_engine, copier):
    [prompt] = repeated_blocks([13], seed=9)
    whole = generate(copier, prompt, 30)
    engine = start_engine(copier, speculative=NGRAM)
    migrated = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, tokens_already_generated=12)
    rest = await collect(engine.add(EngineRequest("moved", prompt + whole[:12], migrated)))
    assert rest == whole[12:]
    assert engine.stats().draft_tokens_accepted > 0


async def test_a_proposer_that_raises_leaves_its_requests_decoding_without_drafts(start_engine, copier):
    engine = start_engine(copier, speculative=NGRAM)
    proposer, calls = engine.proposer, []

    def propose(requests):
        calls.append(len(requests))
        if len(calls) % 2 == 0:
            raise RuntimeError("the draft model ran out of memory")
        return proposer.propose(requests)

    engine.proposer = type("Raising", (), {"propose": staticmethod(propose)})()
    [prompt] = repeated_blocks([15], seed=11)
    assert await collect(engine.add(EngineRequest("r", prompt, greedy(40)))) == generate(copier, prompt, 40)
    assert len(calls) > 4 and engine.stats().draft_tokens_accepted > 0


# ---- served: colocated and split ----------------------------------------------------------------------


def _speculating(worker: Worker, spec: SpecConfig) -> Worker:
    """The worker's engine with speculative decoding on (the test harness builds engines without it)."""
    engine = worker.engine
    engine.config = replace(engine.config, speculative=spec)
    engine.proposer = build_proposer(spec, engine.runner.config.vocab_size, "cpu", draft_blocks)
    return worker


async def test_split_and_colocated_serving_with_drafts_match_generate(copier, executor):
    batch = repeated_blocks([10, 21, 40], seed=10)
    count = 36
    prefill = _speculating(Worker(Role.PREFILL, copier, executor, allow_shm=False), NGRAM)
    decode = _speculating(Worker(Role.DECODE, copier, executor, allow_shm=False), NGRAM)
    colocated = _speculating(Worker(Role.COLOCATED, copier, executor, allow_shm=False), NGRAM)
    workers = (prefill, decode, colocated)
    for worker in workers:
        await worker.start()

    async def served_split(index: int, prompt: list[int]) -> list[int]:
        prefill_events, rest = await split(prefill, decode, f"s{index}", prompt, count)
        return [prefill_events[0].first_token.token_id] + [event.token_id for event in rest]

    async def served_colocated(index: int, prompt: list[int]) -> list[int]:
        work = worker_pb2.GenerateWork(request_id=f"c{index}", prompt_token_ids=prompt, sampling=sampling(count))
        return [event.token_id async for event in colocated.stub.Generate(work)]

    try:
        split_outputs = await asyncio.gather(*(served_split(i, p) for i, p in enumerate(batch)))
        colocated_outputs = await asyncio.gather(*(served_colocated(i, p) for i, p in enumerate(batch)))
    finally:
        for worker in workers:
            await worker.stop()
    expected = [generate(copier, p, count) for p in batch]
    assert split_outputs == expected and colocated_outputs == expected
    assert prefill.engine.stats().draft_tokens_proposed == 0
    for worker in (decode, colocated):
        stats = worker.engine.stats()
        assert stats.draft_tokens_accepted > 0.8 * stats.draft_tokens_proposed > 0


# ---- the draft model's own pool ----------------------------------------------------------------------


def test_the_draft_model_proposes_its_greedy_continuation_batched_and_after_rejections(tiny_model):
    proposer = DraftModelProposer(tiny_model, tiny_model.config.vocab_size, draft_blocks)
    first, second = prompts([21, 40], salt=5)
    assert proposer.propose([DraftRequest("a", first, 4), DraftRequest("b", second, 3)]) == [
        generate(tiny_model, first, 4),
        generate(tiny_model, second, 3),
    ]
    # "a" kept one draft, the target picked another token than its second, and one more token followed:
    # its KV up to the kept draft stays, the rest is computed again
    kept = generate(tiny_model, first, 2)
    extended = first + kept[:1] + [(kept[1] + 1) % tiny_model.config.vocab_size, 7]
    assert proposer.propose([DraftRequest("a", extended, 4)]) == [generate(tiny_model, extended, 4)]
    # "b" did not draft in that step: its blocks went back
    assert proposer.kv.block_tables.keys() == {"a"}
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks - proposer.kv.blocks_for(len(extended) + 3)


def test_a_request_the_draft_pool_has_no_room_for_gets_no_drafts(tiny_model):
    proposer = DraftModelProposer(tiny_model, tiny_model.config.vocab_size, draft_blocks, kv_cache_mib=0)  # one block
    short, long = prompts([9, 40], salt=6)
    assert proposer.propose([DraftRequest("long", long, 4), DraftRequest("short", short, 4)]) == [
        [],
        generate(tiny_model, short, 4),
    ]
    assert proposer.kv.block_tables.keys() == {"short"}
