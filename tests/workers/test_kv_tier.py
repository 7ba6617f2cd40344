"""The shared KV tier: its store (memory LRU spilling to disk, bounds, integrity), its server's credential
and input checks, and workers sharing one real store process (a worker serves a prefix another computed by
fetching it, within one organization and one model only, and computes when the store is gone)."""

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diptych_common.prefix_hash import block_hashes
from diptych_common.proto.v1 import kv_tier_pb2, kv_tier_pb2_grpc, worker_pb2
from diptych_common.worker_credential import WorkerSecret
from diptych_server.stack import free_port
from tests.workers.conftest import prompts, wait_until
from tests.workers.serving import SECRET, Worker, sampling, split
from workers.engine.core import RequestFailed, RequestRejected
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.kv_connector.tier import TierConnector
from workers.kv_tier.blocks import TierKv, blocks_from_bytes, copy_blocks_out, tier_namespace
from workers.kv_tier.client import TierClient
from workers.kv_tier.server import tier_server
from workers.kv_tier.store import TierKey, TierStore, checksum
from workers.models.step import StepInput
from workers.runner.model_runner import ModelRunner
from workers.serving.server import Role

BLOCK = 1000  # bytes of a block in the store's own tests
NAMESPACE = "m/layers=1"


def block(n: int) -> bytes:
    return bytes([n % 251]) * BLOCK


def key(n: int, namespace: str = NAMESPACE) -> TierKey:
    return TierKey(namespace, n)


def put(store: TierStore, n: int) -> bool:
    return store.put(key(n), block(n), checksum(block(n)))


def disk_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kvb"))


# ---- the store ------------------------------------------------------------------------------------------


def test_memory_spills_its_least_recently_used_blocks_to_disk_and_reads_them_back(tmp_path):
    store = TierStore(3 * BLOCK, tmp_path, 10 * BLOCK)
    for n in range(5):
        assert put(store, n)
    stats = store.stats()
    assert (stats.memory_entries, stats.disk_entries, stats.spilled) == (3, 2, 2)
    assert len(disk_files(tmp_path)) == 2
    assert store.get(key(0)) == block(0)  # from disk, back to memory; the oldest in memory (2) spills
    stats = store.stats()
    assert (stats.memory_entries, stats.disk_entries, stats.hits) == (3, 2, 1)
    assert store.get(key(2)) == block(2)
    assert not put(store, 3)  # held already: kept, not stored twice
    assert store.present([key(n) for n in (0, 1, 2, 3, 4, 9, 5)]) == 5


def test_memory_and_disk_stay_within_their_bounds_least_recently_used_out(tmp_path):
    store = TierStore(4 * BLOCK, tmp_path, 6 * BLOCK)
    for n in range(40):
        put(store, n)
        if n % 3 == 0:
            store.get(key(0))  # kept in use: never evicted
        stats = store.stats()
        assert stats.memory_bytes <= 4 * BLOCK and stats.disk_bytes <= 6 * BLOCK
        assert len(disk_files(tmp_path)) == stats.disk_entries
    assert store.get(key(0)) == block(0)
    assert store.get(key(1)) is None  # the least recently used went first
    assert store.present([key(n) for n in range(31, 40)]) == 9  # with block 0, all that 10 blocks hold
    assert store.present([key(30)]) == 0
    assert store.stats().evicted == 40 - 10


def test_a_store_without_disk_drops_what_memory_cannot_hold(tmp_path):
    store = TierStore(2 * BLOCK)
    for n in range(5):
        put(store, n)
    stats = store.stats()
    assert (stats.memory_entries, stats.disk_entries, stats.evicted) == (2, 0, 3)
    assert store.get(key(4)) == block(4) and store.get(key(0)) is None


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another key's file"])
def test_a_damaged_file_on_disk_is_dropped_and_read_as_a_miss(tmp_path, damage):
    store = TierStore(1 * BLOCK, tmp_path, 10 * BLOCK)
    put(store, 1)
    put(store, 2)  # block 1 spills to disk
    (path,) = disk_files(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip a byte":
        raw[-7] ^= 0x40
    elif damage == "truncate":
        del raw[-10:]
    else:
        other = TierStore(1 * BLOCK, tmp_path / "other", 10 * BLOCK)
        other.put(key(3), block(1), checksum(block(1)))
        other.put(key(4), block(4), checksum(block(4)))
        (other_path,) = disk_files(tmp_path / "other")
        raw = bytearray(other_path.read_bytes())  # the same bytes, filed under another key
    path.write_bytes(bytes(raw))
    assert store.get(key(1)) is None
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.disk_entries) == (1, 1, 0)
    assert not path.exists()
    assert store.present([key(1)]) == 0


def test_a_block_damaged_in_memory_is_dropped_and_read_as_a_miss():
    store = TierStore(4 * BLOCK)
    put(store, 1)
    entry = store._memory[key(1)]
    flipped = bytearray(entry.data)
    flipped[5] ^= 1
    store._memory[key(1)] = type(entry)(bytes(flipped), entry.checksum)
    assert store.get(key(1)) is None
    assert store.stats().corrupt == 1 and store.stats().memory_bytes == 0
    assert store.get_run([key(1)], 1 << 20) == []


def test_a_put_whose_bytes_do_not_match_their_checksum_is_refused():
    store = TierStore(4 * BLOCK)
    with pytest.raises(ValueError, match="do not match its checksum"):
        store.put(key(1), block(1), checksum(block(2)))
    assert store.stats().memory_entries == 0


def test_get_run_stops_at_the_first_miss_and_at_the_byte_limit():
    store = TierStore(10 * BLOCK)
    for n in (1, 2, 3, 5):
        put(store, n)
    run = store.get_run([key(n) for n in (1, 2, 3, 4, 5)], 1 << 20)
    assert [k.block_hash for k, _ in run] == [1, 2, 3]
    assert [k.block_hash for k, _ in store.get_run([key(n) for n in (1, 2, 3)], 2 * BLOCK)] == [1, 2]
    assert len(store.get_run([key(1)], 1)) == 1  # at least one block
    assert store.get_run([key(1, "another model")], 1 << 20) == []


def test_the_store_keeps_its_bounds_under_threads(tmp_path):
    store = TierStore(8 * BLOCK, tmp_path, 8 * BLOCK)

    def work(offset: int) -> None:
        for n in range(offset, offset + 60):
            put(store, n)
            store.get(key(n - 3))

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = store.stats()
    assert stats.memory_bytes == stats.memory_entries * BLOCK <= 8 * BLOCK
    assert stats.disk_bytes == stats.disk_entries * BLOCK <= 8 * BLOCK
    assert len(disk_files(tmp_path)) == stats.disk_entries and stats.corrupt == 0


def test_a_new_store_clears_the_entries_an_earlier_one_left_on_disk(tmp_path):
    old = TierStore(1 * BLOCK, tmp_path, 4 * BLOCK)
    for n in range(3):
        put(old, n)
    assert disk_files(tmp_path)
    TierStore(1 * BLOCK, tmp_path, 4 * BLOCK)
    assert disk_files(tmp_path) == []


# ---- the server, in process -------------------------------------------------------------------------------


@pytest.fixture
async def tier_in_process():
    store = TierStore(64 * BLOCK)
    server, _ = tier_server(store, WorkerSecret(SECRET))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    yield address, store
    await server.stop(None)


async def test_the_store_refuses_calls_without_the_worker_secret(tier_in_process):
    address, store = tier_in_process
    put(store, 7)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kv_tier_pb2_grpc.KvTierStub(channel)
        keys = kv_tier_pb2.TierKeys(namespace=NAMESPACE, block_hashes=[7])
        for metadata in ((), (("authorization", "Bearer not-the-secret"),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Get(kv_tier_pb2.TierGetRequest(keys=keys), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await stub.Get(kv_tier_pb2.TierGetRequest(keys=keys), metadata=WorkerSecret(SECRET).metadata())
        assert [b.data for b in reply.blocks] == [block(7)] and reply.blocks[0].checksum == checksum(block(7))


async def test_the_store_refuses_bad_input_with_a_specific_error(tier_in_process):
    address, store = tier_in_process
    metadata = WorkerSecret(SECRET).metadata()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kv_tier_pb2_grpc.KvTierStub(channel)
        calls = [
            (stub.Lookup(kv_tier_pb2.TierKeys(block_hashes=[1]), metadata=metadata), "INVALID_ARGUMENT", "namespace"),
            (
                stub.Put(
                    kv_tier_pb2.TierPutRequest(
                        namespace=NAMESPACE, blocks=[kv_tier_pb2.TierBlock(block_hash=1, data=b"", checksum=0)]
                    ),
                    metadata=metadata,
                ),
                "INVALID_ARGUMENT",
                "holds 0 bytes",
            ),
            (
                stub.Put(
                    kv_tier_pb2.TierPutRequest(
                        namespace=NAMESPACE,
                        blocks=[kv_tier_pb2.TierBlock(block_hash=1, data=block(1), checksum=checksum(block(2)))],
                    ),
                    metadata=metadata,
                ),
                "DATA_LOSS",
                "do not match its checksum",
            ),
        ]
        for call, code, words in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code().name == code and words in refused.value.details()
    assert store.stats().memory_entries == 0


async def test_the_client_ships_puts_once_and_fetches_checked_runs(tier_in_process):
    address, _store = tier_in_process
    client = TierClient(address, NAMESPACE, BLOCK, WorkerSecret(SECRET))
    try:
        client.put([(n, block(n)) for n in range(4)])
        assert await client.flush()
        assert not client.wants(2)  # known to be held: not sent again
        client.put([(2, block(2))])
        assert await client.flush() and client.stats().blocks_put == 4
        assert await client.fetch([0, 1, 2, 9, 3]) == [block(0), block(1), block(2)]
        assert await client.lookup([0, 1, 2, 3, 4]) == 4
        client.put([(n, block(n)) for n in range(100, 140)])  # a run that a fetch asks for in parallel parts
        assert await client.flush()
        assert await client.fetch(list(range(100, 140))) == [block(n) for n in range(100, 140)]
        assert await client.fetch([*range(100, 125), 9, *range(126, 140)]) == [block(n) for n in range(100, 125)]
        other = TierClient(address, "another model", BLOCK, WorkerSecret(SECRET))
        assert await other.fetch([0, 1]) == []
        await other.close()
        short = TierClient(address, NAMESPACE, BLOCK - 1, WorkerSecret(SECRET))  # expects another layout
        assert await short.fetch([0]) == [] and short.stats().errors == 1
        await short.close()
    finally:
        await client.close()


async def test_puts_never_wait_for_a_store_that_does_not_answer_and_a_full_queue_drops():
    with socket.socket() as silent:  # takes connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        client = TierClient(address, NAMESPACE, BLOCK, WorkerSecret(SECRET), queue_bytes=2 * BLOCK, put_timeout_s=1.0)
        client.put([(n, block(n)) for n in range(10)])  # returns at once: the thread holds at most one batch
        assert client.stats().queue_full >= 10 - 2 - 2
        await client.close()  # waits for the put under way (1 s), drops the rest
    assert client.stats().blocks_dropped == 10 and client.stats().blocks_put == 0


# ---- workers sharing one store process -------------------------------------------------------------------


class StoreProcess:
    """`python -m workers.kv_tier.server`, holding the tests' worker secret."""

    def __init__(self, disk: Path, memory_mib: int = 64) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = disk.parent / "store.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.kv_tier.server",
                "--port",
                str(self.port),
                "--memory-mib",
                str(memory_mib),
                "--disk-dir",
                str(disk),
                "--disk-mib",
                "64",
            ],
            env={**os.environ, "DIPTYCH_WORKER_RPC_SECRET": SECRET},
            stderr=self.log.open("wb"),
        )

    async def wait_serving(self, timeout: float = 30.0) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = asyncio.get_running_loop().time() + timeout
            while asyncio.get_running_loop().time() < deadline:
                assert self.process.poll() is None, self.log.read_text(errors="replace")
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("the KV tier's store process did not serve in time")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
async def store(tmp_path):
    process = StoreProcess(tmp_path / "tier")
    await process.wait_serving()
    yield process
    process.stop()


@pytest.fixture
async def start_workers(tiny_model, executor):
    started: list[Worker] = []

    async def start(role: Role, address: str | None, model: str = "diptych-tiny") -> Worker:
        worker = Worker(role, tiny_model, executor, allow_shm=False, kv_tier=address or "", model_name=model)
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.stop()


async def generate(worker: Worker, request_id: str, prompt: list[int], count: int, salt: str = ""):
    """(tokens, cached tokens the first token's stats report)."""
    events = [
        e
        async for e in worker.stub.Generate(
            worker_pb2.GenerateWork(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling(count), cache_salt=salt
            )
        )
    ]
    return [e.token_id for e in events], events[0].stats.cached_tokens


async def shipped(worker: Worker) -> bool:
    assert worker.tier is not None
    return await worker.tier.flush()


async def test_a_worker_fetches_the_prefix_another_worker_computed(store, start_workers, reference):
    a = await start_workers(Role.COLOCATED, store.address)
    b = await start_workers(Role.COLOCATED, store.address)
    plain = await start_workers(Role.COLOCATED, None)
    shared = prompts([180], salt=31)[0]
    first = shared + prompts([20], salt=32)[0]
    second = shared + prompts([20], salt=33)[0]  # 90% of it is the first prompt's
    tokens, _ = await generate(a, "a", first, 8, salt="org-a")
    assert tokens == reference(first, 8)
    assert await shipped(a) and a.engine.stats().tier.blocks_put == (len(first) + 8 - 1) // 16  # every full block
    computed_before = b.engine.stats().prompt_tokens_computed
    tokens, cached = await generate(b, "b", second, 8, salt="org-a")
    stats = b.engine.stats()
    assert cached == stats.tier.hit_tokens == 176  # 11 full blocks of the shared 180 tokens
    assert b.service.load().to_proto().kv_tier.hit_tokens == 176  # what Load and /metrics show
    assert stats.prompt_tokens_computed - computed_before == len(second) - 176
    assert tokens == reference(second, 8) == (await generate(plain, "p", second, 8, salt="org-a"))[0]
    # The loaded blocks are named like computed ones: the next request hits them locally.
    tokens, cached = await generate(b, "b2", second, 8, salt="org-a")
    assert cached == 192 and b.engine.stats().tier.hit_tokens == 176 and tokens == reference(second, 8)


async def test_a_prefill_worker_sends_blocks_it_fetched_and_reports_them_as_cached(store, start_workers, reference):
    colocated = await start_workers(Role.COLOCATED, store.address)
    prefill = await start_workers(Role.PREFILL, store.address)
    decode = await start_workers(Role.DECODE, None)
    prompt = prompts([150], salt=41)[0]
    await generate(colocated, "c", prompt[:130], 1)
    assert await shipped(colocated)
    prefill_events, rest = await split(prefill, decode, "s", prompt, 9)
    first = prefill_events[0].first_token
    assert first.cached_tokens == prefill.engine.stats().tier.hit_tokens == 128  # billed as cached prefill
    assert [first.token_id] + [e.token_id for e in rest] == reference(prompt, 9)


async def test_a_prefill_worker_puts_every_full_block_of_its_prompt(store, start_workers):
    prefill = await start_workers(Role.PREFILL, store.address)
    decode = await start_workers(Role.DECODE, None)
    prompt = prompts([190], salt=42)[0]  # chunks of 64 tokens: the last one fills blocks 8 to 10
    await split(prefill, decode, "s", prompt, 2)  # its request finishes (hands off) in that last step
    assert await shipped(prefill)
    assert prefill.tier is not None
    assert await prefill.tier.client.lookup(block_hashes(prompt, 16)) == 190 // 16


async def test_another_organization_never_hits_the_tier(store, start_workers, reference):
    a = await start_workers(Role.COLOCATED, store.address)
    b = await start_workers(Role.COLOCATED, store.address)
    prompt = prompts([120], salt=51)[0]
    await generate(a, "a", prompt, 1, salt="org-a")
    assert await shipped(a)
    tokens, cached = await generate(b, "b", prompt, 4, salt="org-b")
    assert cached == 0 and b.engine.stats().tier.hit_tokens == 0
    assert b.engine.stats().tier.queried_tokens == 112 and tokens == reference(prompt, 4)
    _, cached = await generate(b, "b2", [*prompt, 5], 4, salt="org-a")
    assert cached == 112  # the same organization does


async def test_another_model_or_layout_never_hits_the_tier(store, start_workers):
    a = await start_workers(Role.COLOCATED, store.address)
    other_model = await start_workers(Role.COLOCATED, store.address, model="another-model")
    prompt = prompts([100], salt=61)[0]
    await generate(a, "a", prompt, 1)
    assert await shipped(a)
    _, cached = await generate(other_model, "o", prompt, 2)
    assert cached == 0 and other_model.engine.stats().tier.queried_tokens == 96
    layout = a.engine.runner.layout
    for other in (dataclasses.replace(layout, dtype=torch.bfloat16), dataclasses.replace(layout, block_size=8)):
        client = TierClient(store.address, tier_namespace("diptych-tiny", other), layout.block_nbytes, a.secret)
        assert await client.fetch(block_hashes(prompt, 16)) == []
        await client.close()


async def test_when_the_store_dies_workers_compute_instead(tmp_path, start_workers, reference):
    store = StoreProcess(tmp_path / "tier")
    await store.wait_serving()
    a = await start_workers(Role.COLOCATED, store.address)
    b = await start_workers(Role.COLOCATED, store.address)
    prompt = prompts([140], salt=71)[0]
    await generate(a, "a", prompt, 1)
    assert await shipped(a)
    store.stop()
    tokens, cached = await generate(b, "b", prompt, 6)
    assert tokens == reference(prompt, 6) and cached == 0
    assert b.engine.stats().tier.errors >= 1
    more = prompts([70], salt=72)[0]
    tokens, _ = await generate(a, "a2", more, 20)  # its puts fail: dropped, the request unharmed
    assert tokens == reference(more, 20)
    assert await wait_until(lambda: a.engine.stats().tier.blocks_dropped > 0, timeout=5.0)


# ---- admission ------------------------------------------------------------------------------------------


def tier_kv_for(model, prompt: list[int], first_block: int, count: int) -> TierKv:
    """The prompt's blocks first_block.. as another worker computed them (a prefill on a pool of its own)."""
    runner = ModelRunner(model, 32, 16)
    blocks = list(range(first_block + count))
    runner.execute([StepInput(prompt[: len(blocks) * 16], 0, blocks, False)])
    data = copy_blocks_out(runner, blocks[first_block:])
    hashes = block_hashes(prompt, 16)[first_block : first_block + count]
    return TierKv(first_block, hashes, blocks_from_bytes(data, runner.layout))


@pytest.fixture
async def engine_with_tier(make_engine, executor, tiny_model):
    """An engine whose tier connector is handed fetched blocks by the test (its store is never asked)."""
    engine = make_engine()
    layout = engine.runner.layout
    client = TierClient(
        f"127.0.0.1:{free_port()}", tier_namespace("diptych-tiny", layout), layout.block_nbytes, WorkerSecret(SECRET)
    )
    tier = TierConnector(client, engine.kv, engine.runner, executor)
    engine.attach_connector(tier)
    yield engine, tier
    await tier.close()


async def test_tier_blocks_load_after_a_local_hit_that_grew_and_are_dropped_when_it_shrank(
    engine_with_tier, tiny_model, reference
):
    engine, tier = engine_with_tier
    prompt = prompts([160], salt=81)[0]
    # Fetched after a local hit of 0 blocks; by admission the local hit reaches 3 blocks: only the rest load.
    warm = engine.add(
        EngineRequest("warm", prompt[:50], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    )
    await warm.outputs.get()
    tier.hold("r", tier_kv_for(tiny_model, prompt, 0, 8))
    request = EngineRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    handle = engine.add(request)
    tokens = [(await handle.outputs.get()).token_id for _ in range(6)]
    assert tokens == reference(prompt, 6)
    assert request.num_cached_tokens == 128  # 3 blocks hit locally, 5 loaded
    assert engine.stats().tier.hit_tokens == 80
    # Fetched after a local hit of 4 blocks that is gone by admission: the blocks would not follow it.
    other = prompts([100], salt=82)[0]
    tier.hold("s", tier_kv_for(tiny_model, other, 4, 2))
    request = EngineRequest("s", other, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    handle = engine.add(request)
    tokens = [(await handle.outputs.get()).token_id for _ in range(5)]
    assert tokens == reference(other, 5) and request.num_cached_tokens == 0 and not tier.holds("s")


async def test_a_request_refused_after_its_fetch_leaves_nothing_held(engine_with_tier, tiny_model):
    engine, tier = engine_with_tier
    prompt = prompts([60], salt=83)[0]
    for request_id, tokens in (("unknown-token", [*prompt, 10**6]), ("empty", [])):
        tier.hold(request_id, tier_kv_for(tiny_model, prompt, 0, 2))
        request = EngineRequest(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=2))
        try:
            handle = await engine.submit(request)
        except RequestRejected:
            pass
        else:
            assert isinstance(await handle.outputs.get(), RequestFailed)
        assert not tier.holds(request_id)
