"""The engine on the built-in model: greedy tokens equal `transformers` generate whatever the batching,
and every KV block is free again however requests end."""

import asyncio

import pytest
import torch

from tests.workers.conftest import all_blocks_free, prompts, wait_until
from workers.engine.connector import KvConnector, KvConnectorStats
from workers.engine.core import RequestRejected
from workers.engine.kv_transfer import KvConnectorMeta, KvLoad, KvSave, KvTransferParams, Peer
from workers.engine.request import BATCH, EngineRequest, FinishReason
from workers.engine.sampling import SamplingParams
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvChunk, KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.timeouts import KvTimeouts
from workers.runner.kv_pool import kv_layout_of


def greedy(count: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)


async def collect(handle) -> list[int]:
    tokens = []
    while True:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        tokens.append(output.token_id)
        if output.finished or handle.request.prefill_only:
            return tokens


async def settle(engine) -> None:
    """Waits (2 s at most) until no request runs or waits."""
    await wait_until(lambda: not engine.stats().running and not engine.stats().waiting)


def assert_all_blocks_free(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(block.ref_count == 0 for block in engine.kv.pool.blocks)
    assert not engine.kv.block_tables and not engine.output.handles


async def run_all(engine, batch, counts, **request_options):
    handles = [
        engine.add(EngineRequest(f"r{i}", p, greedy(n), **request_options))
        for i, (p, n) in enumerate(zip(batch, counts, strict=True))
    ]
    return await asyncio.gather(*(collect(h) for h in handles)), handles


async def test_many_concurrent_mixed_length_prompts_match_generate(make_engine, reference):
    engine = make_engine(token_budget=64)
    batch = prompts([3, 9, 16, 17, 31, 48, 70, 100, 130, 5])
    counts = [12, 20, 8, 15, 10, 18, 9, 14, 11, 25]
    outputs, _ = await run_all(engine, batch, counts)
    for prompt, count, output in zip(batch, counts, outputs, strict=True):
        assert output == reference(prompt, count)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_requests_joining_a_running_batch_match_generate(make_engine, reference):
    engine = make_engine(token_budget=48)
    early = engine.add(EngineRequest("early", prompts([40])[0], greedy(30)))
    first = await early.outputs.get()
    late_prompts = prompts([7, 90], salt=1)
    late = [engine.add(EngineRequest(f"late{i}", p, greedy(10))) for i, p in enumerate(late_prompts)]
    rest = await asyncio.gather(collect(early), *(collect(h) for h in late))
    assert [first.token_id] + rest[0] == reference(prompts([40])[0], 30)
    for prompt, output in zip(late_prompts, rest[1:], strict=True):
        assert output == reference(prompt, 10)


async def test_prompts_longer_than_the_budget_are_chunked_and_still_exact(make_engine, reference):
    engine = make_engine(token_budget=32)
    batch = prompts([200, 150, 4])
    outputs, _ = await run_all(engine, batch, [6, 6, 6])
    assert outputs == [reference(p, 6) for p in batch]
    assert engine.stats().steps >= 350 // 32


async def test_a_shared_prefix_is_computed_once_and_reported(make_engine, reference):
    engine = make_engine(token_budget=512)
    prefix = prompts([64], salt=3)[0]
    first = [*prefix, 11, 12, 13]
    await run_all(engine, [first], [5])
    second = [*prefix, 21, 22, 23, 24, 25]
    outputs, handles = await run_all(engine, [second], [7])
    assert outputs[0] == reference(second, 7)
    assert handles[0].request.num_cached_tokens == 64
    assert engine.kv.hits_tokens == 64 and engine.kv.queried_tokens == len(first) + len(second)
    # A prompt that is wholly cached still computes its last token.
    outputs, handles = await run_all(engine, [prefix], [4])
    assert outputs[0] == reference(prefix, 4)
    assert handles[0].request.num_cached_tokens == 48
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_a_tiny_kv_pool_preempts_and_recomputes_exactly(make_engine, reference):
    engine = make_engine(num_kv_blocks=12, token_budget=64, enable_prefix_caching=False)
    batch = prompts([40, 35, 50, 20, 45], salt=5)
    counts = [40, 40, 30, 40, 30]
    outputs, handles = await run_all(engine, batch, counts)
    assert sum(h.request.num_preemptions for h in handles) > 0
    for prompt, count, output in zip(batch, counts, outputs, strict=True):
        assert output == reference(prompt, count)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_interactive_requests_are_admitted_before_batch_ones(make_engine):
    engine = make_engine(max_running=1, token_budget=512)
    batch_handles = [
        engine.add(EngineRequest(f"b{i}", prompts([10], salt=i)[0], greedy(3), priority=BATCH)) for i in range(2)
    ]
    interactive = engine.add(EngineRequest("i0", prompts([10], salt=9)[0], greedy(3)))
    finished_order = []

    async def track(handle):
        await collect(handle)
        finished_order.append(handle.request.request_id)

    await asyncio.gather(*(track(h) for h in [*batch_handles, interactive]))
    assert finished_order.index("i0") < finished_order.index("b1")


class CaptureConnector(KvConnector):
    """Another implementation of the connector interface, in memory: it saves the blocks of requests that
    ask to send, as they are computed, into one tensor per request, and loads such a tensor into the
    blocks of requests that ask to load (what a KV store would do, minus the store)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.saved: dict[str, torch.Tensor] = {}  # request id → [layers, 2, blocks, block_size, heads, dim]
        self.saves: list[tuple[int, int]] = []  # (first block, count) of every save, in order
        self.to_load: dict[str, KvChunk] = {}
        self._blocks_saved: dict[str, int] = {}
        self.finished: list[tuple[str, FinishReason]] = []

    def add_request(self, request):
        if request.kv_transfer is not None and request.kv_transfer.send_to is not None:
            self._blocks_saved[request.request_id] = 0
        return None

    def num_external_tokens(self, request) -> int:
        chunk = self.to_load.get(request.request_id)
        return request.kv_transfer.load_tokens if chunk is not None and request.num_preemptions == 0 else 0

    def build_meta(self, out, kv) -> KvConnectorMeta:
        saves = []
        for chunk in out.chunks:
            request_id = chunk.request.request_id
            if request_id not in self._blocks_saved:
                continue
            computed = chunk.start + chunk.num_tokens
            done = computed >= len(chunk.request.prompt_token_ids)
            upto = kv.blocks_for(computed) if done else computed // kv.block_size
            if upto > self._blocks_saved[request_id]:
                first = self._blocks_saved[request_id]
                saves.append(KvSave(request_id, kv.block_ids(request_id)[first:upto], first))
                self._blocks_saved[request_id] = upto
        loads = [KvLoad(request.request_id, kv.block_ids(request.request_id)) for request in out.loads]
        return KvConnectorMeta(loads=loads, saves=saves)

    def request_finished(self, request) -> None:
        self.finished.append((request.request_id, request.finish_reason))

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats()

    async def close(self) -> None:
        pass

    def load_kv(self, meta, runner) -> None:
        for load in meta.loads:
            chunk = self.to_load[load.request_id]
            runner.write_blocks(load.block_ids[: chunk.data.shape[2]], chunk.data)

    def save_kv(self, meta, runner) -> None:
        for save in meta.saves:
            lay = self.layout
            data = torch.empty(lay.num_layers, 2, len(save.block_ids), lay.block_size, lay.kv_heads, lay.head_dim)
            runner.read_blocks(save.block_ids, data)
            previous = self.saved.get(save.request_id)
            self.saved[save.request_id] = data if previous is None else torch.cat([previous, data], dim=2)
            self.saves.append((save.first_block, len(save.block_ids)))


async def test_kv_saved_during_a_chunked_prefill_is_loaded_by_another_engine_and_continues_exactly(
    make_engine, reference
):
    """What a prefill and a decode worker do through the connector interface, minus the wire: a chunked
    prefill saves its blocks as they are computed; another engine loads them and decodes on."""
    prefill, decode = make_engine(token_budget=32), make_engine()
    prefill_side, decode_side = CaptureConnector(prefill.runner.layout), CaptureConnector(decode.runner.layout)
    prefill.attach_connector(prefill_side)
    decode.attach_connector(decode_side)
    prompt = prompts([77], salt=7)[0]
    sending = KvTransferParams(send_to=Peer("in memory", 0, False), transfer_token=b"t")  # it keeps the KV
    first = await collect(prefill.add(EngineRequest("p", prompt, greedy(10), prefill_only=True, kv_transfer=sending)))
    assert prefill_side.saves == [(0, 2), (2, 2), (4, 1)]  # full blocks as each chunk completes, the tail last
    assert prefill_side.finished == [("p", FinishReason.HANDED_OFF)]
    decode_side.to_load["d"] = KvChunk(0, prefill_side.saved["p"])
    request = EngineRequest(
        "d", prompt, greedy(10), output_token_ids=list(first), kv_transfer=KvTransferParams(load_tokens=77)
    )
    tokens = first + await collect(decode.add(request))
    assert tokens == reference(prompt, 10)
    assert decode.stats().prompt_tokens_computed == 0  # the prompt was loaded, never computed
    await settle(decode)
    assert_all_blocks_free(decode)


@pytest.fixture
def data_port(tiny_model):
    timeouts = KvTimeouts(arrival_s=10.0, hello_answer_s=12.0)
    receiver = KvReceiver(KvInbox(timeouts), kv_layout_of(tiny_model.config, 16, torch.float32), timeouts=timeouts)
    receiver.start()
    yield receiver
    receiver.close()


async def test_kv_still_to_be_sent_survives_the_reuse_of_its_blocks(make_engine, reference, data_port):
    """The decode request registers only after the prefill finished and another request overwrote every
    block of the pool: the chunks not sent yet were copied out before that step (the TCP path sends
    straight from the pool), so the decode worker still continues exactly."""
    prefill = make_engine(num_kv_blocks=8, enable_prefix_caching=False)
    sender = KvSender(prefill.runner.layout, allow_shm=False)
    prefill.attach_connector(PrefillConnector(sender))
    decode = make_engine()
    decode.attach_connector(DecodeConnector(data_port))
    prompt = prompts([40], salt=50)[0]  # 3 blocks
    params = KvTransferParams(send_to=Peer(data_port.host, data_port.port, False), transfer_token=b"t" * 32)
    handle = prefill.add(EngineRequest("a", prompt, greedy(10), prefill_only=True, kv_transfer=params))
    first = await collect(handle)
    await collect(prefill.add(EngineRequest("b", prompts([120], salt=51)[0], greedy(1))))  # all 8 blocks
    received = await asyncio.wrap_future(decode.connector.expect("a", b"t" * 32, len(prompt)))
    request = EngineRequest(
        "a",
        received.prompt_token_ids,
        greedy(10),
        output_token_ids=[received.first_token_id],
        kv_transfer=KvTransferParams(load_tokens=received.num_tokens),
    )
    rest = await collect(decode.add(request))
    decode.connector.forget("a")
    assert first + rest == reference(prompt, 10)
    assert (await asyncio.wrap_future(handle.kv_sent)).nbytes == 3 * prefill.runner.layout.block_nbytes
    sender.close()


async def test_an_aborted_request_frees_its_blocks_at_once_running_or_queued(make_engine):
    """Requests of 900 tokens cannot finish within the wait: only the abort frees their blocks."""
    engine = make_engine(max_running=1)
    running = engine.add(EngineRequest("running", prompts([30])[0], greedy(900)))
    engine.add(EngineRequest("queued", prompts([40], salt=1)[0], greedy(900)))
    await running.outputs.get()
    assert engine.stats().running == 1 and engine.stats().waiting == 1
    engine.abort("queued")  # before it ever ran
    engine.abort("running")  # while decoding
    assert await wait_until(lambda: all_blocks_free(engine), timeout=2.0)
    assert engine.stats().tokens_generated < 900
    assert_all_blocks_free(engine)


async def test_a_later_interactive_request_keeps_running_when_an_earlier_batch_one_is_preempted(make_engine, reference):
    """Six blocks hold both prompts, not both continuations: the batch request admitted first is the one
    preempted when the interactive one needs a block, and both still match generate."""
    engine = make_engine(num_kv_blocks=6, token_budget=64, enable_prefix_caching=False)
    batch_prompt, interactive_prompt = prompts([30], salt=12)[0], prompts([30], salt=13)[0]
    batch = engine.add(EngineRequest("batch", batch_prompt, greedy(60), priority=BATCH))
    first = await batch.outputs.get()  # admitted, and running, before the interactive request arrives
    interactive = engine.add(EngineRequest("interactive", interactive_prompt, greedy(60)))
    outputs = await asyncio.gather(collect(batch), collect(interactive))
    assert interactive.request.num_preemptions == 0 and batch.request.num_preemptions > 0
    assert [first.token_id] + outputs[0] == reference(batch_prompt, 60)
    assert outputs[1] == reference(interactive_prompt, 60)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_every_block_is_free_after_cancels_failures_and_finishes(make_engine, monkeypatch):
    engine = make_engine(num_kv_blocks=40, token_budget=64)
    batch = prompts([30, 60, 90, 20, 45, 70], salt=11)
    handles = [engine.add(EngineRequest(f"r{i}", p, greedy(25))) for i, p in enumerate(batch)]
    engine.abort("r5")  # before it ran
    await handles[1].outputs.get()
    engine.abort("r1")  # while decoding
    original = engine.runner.execute
    calls = 0

    def failing_once(inputs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected failure")
        return original(inputs)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    results = await asyncio.gather(*(collect(h) for h in handles[:1] + handles[2:5]), return_exceptions=True)
    assert any(isinstance(r, RuntimeError) for r in results)
    await settle(engine)
    assert_all_blocks_free(engine)
    # The aborted requests got nothing more (r1 at most the token of a step already under way).
    assert handles[5].outputs.empty() and handles[1].outputs.qsize() <= 1
    # The engine keeps serving after a failed step.
    assert len(await collect(engine.add(EngineRequest("after", batch[0], greedy(5))))) == 5


async def test_requests_that_can_never_fit_are_rejected_with_the_reason(make_engine):
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(RequestRejected, match="KV memory"):
        engine.add(EngineRequest("big", prompts([60])[0], greedy(20)))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add(EngineRequest("empty", [], greedy(2)))
    assert_all_blocks_free(engine)


async def test_seeded_sampling_continues_after_a_migration(make_engine):
    engine = make_engine()
    prompt = prompts([20], salt=2)[0]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    whole = await collect(engine.add(EngineRequest("a", prompt, seeded)))
    # A migrated request re-runs prefill on prompt + the 3 tokens already sent and continues at index 3.
    migrated = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, tokens_already_generated=3)
    rest = await collect(engine.add(EngineRequest("b", prompt + whole[:3], migrated)))
    assert rest == whole[3:]


async def test_an_identical_prompt_of_another_organization_gets_no_cached_tokens(make_engine, reference):
    engine = make_engine(token_budget=512)
    secret = prompts([256], salt=4)[0]
    await run_all(engine, [[*secret, 1]], [2], cache_salt="org-a")
    outputs, handles = await run_all(engine, [[*secret, 2]], [3], cache_salt="org-b")
    assert handles[0].request.num_cached_tokens == 0
    assert outputs[0] == reference([*secret, 2], 3)
    _, handles = await run_all(engine, [[*secret, 3]], [2], cache_salt="org-a")
    assert handles[0].request.num_cached_tokens == 256  # the same organization still hits
