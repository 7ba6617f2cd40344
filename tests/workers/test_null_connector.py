"""The connector interface's defaults and the null connector: a connector defines only what it needs (four
hooks at least), an engine with no connector attached has the null one, and an engine whose connector
moves no KV never calls its per-step hooks."""

import pytest

from tests.workers.conftest import all_blocks_free, prompts, wait_until
from workers.engine.connector import KvConnector, KvConnectorStats, NullConnector, TierStats
from workers.engine.kv_transfer import EMPTY_META, KvConnectorMeta, KvLoad
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.engine.schedule import SchedulerOutput
from workers.kv_connector.multi import MultiMeta


class Minimal(KvConnector):
    """A connector that defines only the hooks every connector must."""

    def build_meta(self, out, kv) -> KvConnectorMeta:
        return KvConnectorMeta()

    def request_finished(self, request) -> None:
        pass

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats()

    async def close(self) -> None:
        pass


class NoPerStepHooks(NullConnector):
    """A null connector whose per-step hooks fail the step they are called in."""

    def step_done(self, meta) -> None:
        raise AssertionError("step_done called")

    def before_update(self, out) -> None:
        raise AssertionError("before_update called")

    async def after_update(self, out) -> None:
        raise AssertionError("after_update called")

    def wait_for_save(self, meta) -> None:
        raise AssertionError("wait_for_save called")

    def load_kv(self, meta, runner) -> None:
        raise AssertionError("load_kv called")

    def save_kv(self, meta, runner) -> None:
        raise AssertionError("save_kv called")


def request(request_id: str = "r", length: int = 20) -> EngineRequest:
    return EngineRequest(request_id, prompts([length])[0], SamplingParams(temperature=0.0, max_tokens=4))


async def test_a_connector_defining_only_the_four_required_hooks_does_nothing_in_the_others():
    connector = Minimal()
    await connector.prepare(request())
    await connector.after_update(SchedulerOutput())
    assert connector.moves_kv
    assert connector.add_request(request()) is None
    assert connector.num_external_tokens(request()) == 0
    assert connector.blocks_after_hit(request(), hit_blocks=3) == 0


def test_a_connector_must_define_build_meta_request_finished_stats_and_close():
    with pytest.raises(TypeError, match=r"build_meta.*close.*request_finished.*stats"):
        KvConnector()


def test_the_null_connector_moves_nothing_and_every_step_shares_one_empty_meta():
    null = NullConnector()
    assert not null.moves_kv
    assert null.build_meta(SchedulerOutput(), kv=None) is EMPTY_META and not EMPTY_META.loads_kv()
    assert null.stats() == KvConnectorStats() and null.stats().sent_by_path is not null.stats().sent_by_path


def test_a_composed_meta_loads_kv_when_any_part_does():
    loading = KvConnectorMeta(loads=[KvLoad("r", [1])])
    assert MultiMeta(parts=(EMPTY_META, loading)).loads_kv()
    assert not MultiMeta(parts=(EMPTY_META, KvConnectorMeta())).loads_kv()


async def test_an_engine_without_a_connector_has_the_null_one_and_reports_no_kv_moved(make_engine):
    engine = make_engine()
    assert isinstance(engine.connector, NullConnector) and engine.scheduler.connector is engine.connector
    handle = await engine.submit(request())
    assert handle.kv_sent is None
    assert await wait_until(lambda: all_blocks_free(engine))
    stats = engine.stats()
    assert stats.kv_bytes_sent == stats.kv_bytes_received == 0 and stats.tier == TierStats()


async def test_an_engine_whose_connector_moves_no_kv_skips_its_per_step_hooks(make_engine):
    engine = make_engine(token_budget=16)
    engine.attach_connector(NoPerStepHooks())
    handles = [await engine.submit(request(f"r{i}", 40 + i)) for i in range(3)]  # chunked prompts, then decodes
    for handle in handles:
        while not (output := await handle.outputs.get()).finished:
            assert not isinstance(output, Exception), output
        assert not isinstance(output, Exception), output
    assert engine.steps_run > 3 and await wait_until(lambda: all_blocks_free(engine))
