"""One request's failure is that request's alone: a request whose sampling is degenerate, whose logits
are not finite or whose sampling raises never takes its batch-mates down (real forward passes on the
built-in model, batch-mates compared with `transformers` generate)."""

import asyncio

import grpc
import pytest

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from tests.workers.conftest import prompts
from tests.workers.test_engine import assert_all_blocks_free, collect, greedy, settle
from workers.engine import sampling as sampling_module
from workers.engine.core import RequestFailed
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.serving.server import Role, WorkerService, WorkerState

FAILED_PREFIX = "the request failed on this worker: "


def poison_logits(engine, victim: str, at_sample: int):
    """Wraps the runner so that the victim's row of logits is NaN from its `at_sample`-th sampled token on
    (counted from 1): the forward pass is real, only its output is poisoned."""
    original = engine.runner.execute
    sampled = 0

    def execute(inputs):
        nonlocal sampled
        logits = original(inputs).clone()  # out of inference mode, so that a row can be overwritten
        victim_blocks = engine.kv.block_tables.get(victim)
        sampling_inputs = [step for step in inputs if step.sample]
        for row, step in enumerate(sampling_inputs):
            if victim_blocks and step.block_ids[0] == victim_blocks[0].block_id:
                sampled += 1
                if sampled >= at_sample:
                    logits[row] = float("nan")
        return logits

    engine.runner.execute = execute


async def test_a_temperature_too_small_to_divide_by_is_greedy_and_its_batch_mates_run_on(make_engine, reference):
    engine = make_engine(token_budget=64)
    batch = prompts([5, 17, 40, 9], salt=21)
    handles = [engine.add(EngineRequest(f"r{i}", p, greedy(12))) for i, p in enumerate(batch[:3])]
    tiny = SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True)
    handles.append(engine.add(EngineRequest("tiny-temperature", batch[3], tiny)))
    outputs = await asyncio.gather(*(collect(h) for h in handles))
    assert outputs == [reference(p, 12) for p in batch]
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_non_finite_logits_fail_that_request_alone(make_engine, reference):
    engine = make_engine(token_budget=64)
    batch = prompts([6, 33, 70, 12], salt=22)
    handles = [engine.add(EngineRequest(f"r{i}", p, greedy(15))) for i, p in enumerate(batch[:3])]
    victim = engine.add(EngineRequest("victim", batch[3], greedy(15)))
    poison_logits(engine, "victim", at_sample=3)
    results = await asyncio.gather(*(collect(h) for h in handles), collect(victim), return_exceptions=True)
    assert results[:3] == [reference(p, 15) for p in batch[:3]]
    failure = results[3]
    assert isinstance(failure, RequestFailed)
    assert str(failure).startswith(FAILED_PREFIX) and "output token 2" in str(failure) and "NaN" in str(failure)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_a_request_whose_sampling_raises_fails_alone(make_engine, reference, monkeypatch):
    engine = make_engine(token_budget=64)
    original = sampling_module.seeded_fraction

    def raising_for_seed_13(seed, token_index):
        if seed == 13 and token_index == 4:
            raise RuntimeError("injected sampling failure")
        return original(seed, token_index)

    monkeypatch.setattr(sampling_module, "seeded_fraction", raising_for_seed_13)
    batch = prompts([8, 25, 50], salt=23)
    greedy_handles = [engine.add(EngineRequest(f"r{i}", p, greedy(10))) for i, p in enumerate(batch)]
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    survivor = engine.add(EngineRequest("seeded", batch[0], seeded))
    victim = engine.add(EngineRequest("victim", batch[1], SamplingParams(temperature=0.8, seed=13, max_tokens=10)))
    results = await asyncio.gather(
        *(collect(h) for h in greedy_handles), collect(survivor), collect(victim), return_exceptions=True
    )
    assert results[:3] == [reference(p, 10) for p in batch]
    assert len(results[3]) == 10
    assert isinstance(results[4], RequestFailed)
    assert str(results[4]).startswith(FAILED_PREFIX) and "injected sampling failure" in str(results[4])
    await settle(engine)
    assert_all_blocks_free(engine)


@pytest.fixture
async def colocated(make_engine):
    engine = make_engine(token_budget=64)
    server = grpc.aio.server()
    service = WorkerService(WorkerState(Role.COLOCATED, "colocated-0"), engine)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channel = grpc.aio.insecure_channel(address)
    yield engine, worker_pb2_grpc.WorkerStub(channel)
    await channel.close()
    await server.stop(None)


async def test_a_failed_request_ends_its_call_with_internal_and_the_reason(colocated, reference):
    engine, stub = colocated
    sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = prompts([10, 20], salt=24)
    poison_logits(engine, "victim", at_sample=2)
    mate = stub.Generate(worker_pb2.GenerateWork(request_id="mate", prompt_token_ids=batch[0], sampling=sampling))
    victim = stub.Generate(worker_pb2.GenerateWork(request_id="victim", prompt_token_ids=batch[1], sampling=sampling))

    async def tokens(call):
        return [event.token_id async for event in call]

    mate_tokens, failure = await asyncio.gather(tokens(mate), tokens(victim), return_exceptions=True)
    assert mate_tokens == reference(batch[0], 8)
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() is grpc.StatusCode.INTERNAL
    assert failure.details().startswith(FAILED_PREFIX)


async def test_a_token_outside_the_vocabulary_fails_that_request_before_it_runs(make_engine, reference):
    engine = make_engine(token_budget=64)
    batch = prompts([7, 30], salt=25)
    mates = [engine.add(EngineRequest(f"r{i}", p, greedy(6))) for i, p in enumerate(batch)]
    stranger = engine.add(EngineRequest("stranger", [5, 6, 512, 7], greedy(6)))
    results = await asyncio.gather(*(collect(h) for h in mates), collect(stranger), return_exceptions=True)
    assert results[:2] == [reference(p, 6) for p in batch]
    assert isinstance(results[2], RequestFailed)
    assert str(results[2]).startswith(FAILED_PREFIX) and "token 2" in str(results[2]) and "512" in str(results[2])
    await settle(engine)
    assert_all_blocks_free(engine)
