"""Connectors composed (`workers.kv_connector.multi`): each part gets its own part of a step's meta, every
part's wait for its saves comes before any part's loads, one part loads a request's blocks after its hit,
and a worker's server finds its hand-off part among them."""

import pytest

from workers.engine.connector import KvConnector, KvConnectorStats, NullConnector, TierStats
from workers.engine.kv_transfer import KvConnectorMeta, KvLoad
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.engine.schedule import SchedulerOutput
from workers.kv_connector.multi import MultiConnector, composed, parts_of


class Recording(KvConnector):
    """A part that records each call, in one journal shared with the other parts."""

    def __init__(self, name: str, journal: list[tuple], offers: int = 0, sent: int = 0) -> None:
        self.name, self.journal, self.offers, self.sent = name, journal, offers, sent

    def _note(self, *call) -> None:
        self.journal.append((self.name, *call))

    async def prepare(self, request):
        self._note("prepare", request.request_id)

    def discard(self, request):
        self._note("discard", request.request_id)

    def add_request(self, request):
        self._note("add_request", request.request_id)

    def num_external_tokens(self, request):
        return 0

    def blocks_after_hit(self, request, hit_blocks):
        return self.offers

    def load_after_hit(self, request, hit_blocks, block_ids):
        self._note("load_after_hit", hit_blocks, tuple(block_ids))

    def build_meta(self, out, kv):
        return KvConnectorMeta(loads=[KvLoad(self.name, [])])

    def request_preempted(self, request):
        self._note("request_preempted", request.request_id)

    def request_finished(self, request):
        self._note("request_finished", request.request_id)

    def step_done(self, meta):
        self._note("step_done", meta.loads[0].request_id)

    def before_update(self, out):
        self._note("before_update")

    async def after_update(self, out):
        self._note("after_update")

    def stats(self):
        tier = TierStats(hit_tokens=16) if self.name == "tier" else None
        return KvConnectorStats(sent_by_path={"tcp": self.sent}, tier=tier)

    async def close(self):
        self._note("close")

    def wait_for_save(self, meta):
        self._note("wait_for_save", meta.loads[0].request_id)

    def load_kv(self, meta, runner):
        self._note("load_kv", meta.loads[0].request_id)

    def save_kv(self, meta, runner):
        self._note("save_kv", meta.loads[0].request_id)


def request(request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(temperature=0.0))


def test_each_part_gets_its_own_meta_and_every_wait_for_save_runs_before_any_load():
    journal: list[tuple] = []
    multi = MultiConnector([Recording("a", journal), Recording("b", journal)])
    meta = multi.build_meta(SchedulerOutput(), kv=None)
    multi.wait_for_save(meta)
    multi.load_kv(meta, runner=None)
    multi.save_kv(meta, runner=None)
    multi.step_done(meta)
    assert journal == [
        ("a", "wait_for_save", "a"),
        ("b", "wait_for_save", "b"),
        ("a", "load_kv", "a"),
        ("b", "load_kv", "b"),
        ("a", "save_kv", "a"),
        ("b", "save_kv", "b"),
        ("a", "step_done", "a"),
        ("b", "step_done", "b"),
    ]


def test_the_first_part_that_offers_blocks_after_a_hit_loads_them_and_the_others_drop_theirs():
    journal: list[tuple] = []
    multi = MultiConnector([Recording("a", journal), Recording("b", journal, offers=2), Recording("c", journal, 3)])
    assert multi.blocks_after_hit(request(), hit_blocks=1) == 2
    multi.load_after_hit(request(), 1, [7, 8])
    assert journal == [
        ("a", "load_after_hit", 1, ()),
        ("b", "load_after_hit", 1, (7, 8)),
        ("c", "load_after_hit", 1, ()),
    ]


async def test_hooks_reach_every_part_and_stats_add_up():
    journal: list[tuple] = []
    multi = MultiConnector([Recording("hand-off", journal, sent=10), Recording("tier", journal, sent=5)])
    await multi.prepare(request())
    multi.discard(request())
    multi.before_update(SchedulerOutput())
    await multi.after_update(SchedulerOutput())
    multi.request_finished(request())
    await multi.close()
    for call in ("prepare", "discard", "before_update", "after_update", "request_finished", "close"):
        assert [name for name, called, *_ in journal if called == call] == ["hand-off", "tier"]
    stats = multi.stats()
    assert stats.sent_by_path == {"tcp": 15} and stats.tier == TierStats(hit_tokens=16)


def test_composed_gives_the_null_connector_the_one_or_a_multi_connector():
    journal: list[tuple] = []
    one, two = Recording("a", journal), Recording("b", journal)
    none = composed([])
    assert isinstance(none, NullConnector) and parts_of(none) == ()
    assert composed([one]) is one
    multi = composed([one, two])
    assert isinstance(multi, MultiConnector) and parts_of(multi) == (one, two) and parts_of(one) == (one,)
    with pytest.raises(ValueError, match="two connectors or more"):
        MultiConnector([one])
