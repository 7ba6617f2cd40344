"""Prefill and decode workers' gRPC services in process, the KV moving between them on the data path."""

import asyncio
import secrets

import grpc
import pytest

from diptych_common.prefix_hash import block_hashes
from diptych_common.proto.v1 import worker_pb2
from tests.workers.conftest import all_blocks_free, prompts, wait_until
from tests.workers.serving import sampling, split


async def test_split_requests_match_generate_and_report_transfer_and_cache_hits(workers, reference):
    prefill, decode = workers
    batch = prompts([5, 40, 77, 120], salt=21)
    results = await asyncio.gather(*(split(prefill, decode, f"r{i}", p, 9) for i, p in enumerate(batch)))
    for prompt, (prefill_events, rest) in zip(batch, results, strict=True):
        first, delivered = prefill_events[0].first_token, prefill_events[1].kv_delivered
        assert [first.token_id] + [e.token_id for e in rest] == reference(prompt, 9)
        assert delivered.kv_bytes == -(-len(prompt) // 16) * prefill.engine.runner.layout.block_nbytes
        assert delivered.data_path == ("shm" if prefill.sender.allow_shm else "nixl" if prefill.sender.nixl else "tcp")
        assert rest[-1].finished and rest[-1].HasField("stats")
    moved = sum(prefill_events[1].kv_delivered.kv_bytes for prefill_events, _ in results)
    assert decode.engine.stats().kv_bytes_received == prefill.engine.stats().kv_bytes_sent == moved
    # The same long prompt again: its full blocks come from the prefix cache.
    prefill_events, rest = await split(prefill, decode, "again", batch[3], 9)
    assert prefill_events[0].first_token.cached_tokens == 112
    assert [prefill_events[0].first_token.token_id] + [e.token_id for e in rest] == reference(batch[3], 9)
    for worker in (prefill, decode):
        assert await wait_until(lambda worker=worker: all_blocks_free(worker.engine))


async def test_cached_prompts_are_shared_within_an_organization_only(workers, reference):
    prefill, decode = workers
    secret = prompts([256], salt=22)[0]
    await split(prefill, decode, "a1", [*secret, 1], 2, cache_salt="org-a")
    prefill_events, _ = await split(prefill, decode, "b1", [*secret, 2], 2, cache_salt="org-b")
    assert prefill_events[0].first_token.cached_tokens == 0
    prefill_events, _ = await split(prefill, decode, "a2", [*secret, 3], 2, cache_salt="org-a")
    assert prefill_events[0].first_token.cached_tokens == 256
    # The decode worker names the KV it received under the organization too: its Generate hits for
    # the same organization only.
    for salt, cached in (("org-c", 0), ("org-a", 256)):
        events = [
            e
            async for e in decode.stub.Generate(
                worker_pb2.GenerateWork(
                    request_id=f"g-{salt}",
                    prompt_token_ids=[*secret, 4],
                    sampling=sampling(2),
                    cache_salt=salt,
                )
            )
        ]
        assert events[0].stats.cached_tokens == cached


async def test_decode_workers_serve_generate_too(workers, reference):
    _, decode = workers
    prompt = prompts([33], salt=4)[0]
    events = [
        e
        async for e in decode.stub.Generate(
            worker_pb2.GenerateWork(request_id="g", prompt_token_ids=prompt, sampling=sampling(7))
        )
    ]
    assert [e.token_id for e in events] == reference(prompt, 7)
    assert events[0].HasField("stats") and events[-1].finished


async def test_a_wrong_transfer_token_fails_both_calls_with_clear_errors(workers):
    prefill, decode = workers
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(request_id="w", transfer_token=b"a" * 32, sampling=sampling(5), prompt_tokens=20),
        timeout=10,
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="w",
                prompt_token_ids=prompts([20])[0],
                sampling=sampling(5),
                decode_address=decode.address,
                transfer_token=b"b" * 32,
            )
        ):
            pass
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "PERMISSION_DENIED" in raised.value.details() and "token does not match" in raised.value.details()
    decode_call.cancel()
    assert await wait_until(lambda: all_blocks_free(prefill.engine))


async def test_load_is_published_at_once_and_on_change_with_the_prefix_summary(workers):
    prefill, decode = workers
    watch = prefill.stub.WatchLoad(worker_pb2.LoadRequest())
    first = await anext(aiter(watch))
    assert first.kv_blocks_total == 128 and first.kv_blocks_free == 128 and first.block_size == 16
    prompt = prompts([64], salt=30)[0]
    await split(prefill, decode, "p", prompt, 3)
    async for load in watch:
        if len(load.prefix_cache.block_hashes) == 4:
            break
    assert list(load.prefix_cache.block_hashes) == block_hashes(prompt, 16)
    assert load.prefix_cache.queried_tokens == 64 and load.prefix_cache.version > first.prefix_cache.version
    report = prefill.service.load_report()  # the heartbeat's report comes from the same shape
    assert (report["kv_blocks_free"], report["kv_blocks_total"], report["queue_depth"]) == (128, 128, 0)
    prefill.service.set_draining(True)
    async for load in watch:
        if load.draining:
            break
    watch.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await split(prefill, decode, "late", prompt, 3)
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in raised.value.details()


async def test_roles_are_enforced(workers):
    prefill, decode = workers
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await prefill.stub.GetKvEndpoint(worker_pb2.KvEndpointRequest())
    assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    endpoint = await decode.stub.GetKvEndpoint(worker_pb2.KvEndpointRequest())
    assert endpoint.data_port == decode.receiver.port and endpoint.block_size == 16


# Cancellation: each request below needs about a thousand tokens, far more than the worker computes
# within the bound its blocks must be free in; only the cancel frees them.


async def test_cancelling_a_generate_call_frees_its_blocks_at_once(workers):
    _, decode = workers
    call = decode.stub.Generate(
        worker_pb2.GenerateWork(request_id="long", prompt_token_ids=prompts([24], salt=40)[0], sampling=sampling(1000))
    )
    await call.read()
    assert not all_blocks_free(decode.engine)
    call.cancel()
    assert await wait_until(lambda: all_blocks_free(decode.engine), timeout=2.0)
    assert decode.engine.stats().tokens_generated < 1000


async def test_cancelling_a_decode_call_frees_its_blocks_at_once(workers):
    prefill, decode = workers
    prompt = prompts([24], salt=41)[0]
    token = secrets.token_bytes(32)
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="long",
            transfer_token=token,
            sampling=sampling(1000),
            prompt_tokens=len(prompt),
        )
    )
    events = [
        e
        async for e in prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="long",
                prompt_token_ids=prompt,
                sampling=sampling(1000),
                decode_address=decode.address,
                transfer_token=token,
            )
        )
    ]
    assert events[-1].HasField("kv_delivered")
    await decode_call.read()
    decode_call.cancel()
    assert await wait_until(lambda: all_blocks_free(decode.engine), timeout=2.0)
    assert decode.engine.stats().tokens_generated < 1000


async def test_cancelling_a_prefill_call_frees_its_blocks_at_once_and_aborts_its_transfer(workers):
    prefill, decode = workers
    prompt = prompts([1000], salt=42)[0]  # 16 steps of 64 tokens
    token = secrets.token_bytes(32)
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="long",
            transfer_token=token,
            sampling=sampling(8),
            prompt_tokens=len(prompt),
        )
    )
    prefill_call = prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id="long",
            prompt_token_ids=prompt,
            sampling=sampling(8),
            decode_address=decode.address,
            transfer_token=token,
        )
    )
    assert await wait_until(lambda: prefill.engine.stats().prompt_tokens_computed > 0, timeout=10.0)
    prefill_call.cancel()
    assert await wait_until(lambda: all_blocks_free(prefill.engine), timeout=2.0)
    assert prefill.engine.stats().prompt_tokens_computed < len(prompt)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode_call.read()
    assert raised.value.code() is grpc.StatusCode.ABORTED
    assert "the prefill request was cancelled" in raised.value.details()
    assert all_blocks_free(decode.engine)
