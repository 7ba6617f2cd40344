"""Decides what each engine step computes: continuous batching under a token budget and KV memory.

Running requests go first, in admission order: a decoding request needs one token, a request still
in its prompt gets the next chunk of it (so a long prompt never stalls the others: it takes at most the
budget left after the decodes); a decoding request with drafts (speculative decoding) also takes them, as
far as the budget and free blocks allow. When a running request needs a block and none is free, the running
request of lowest priority, admitted last, is preempted, whichever it is (the one that needs the block
included): its blocks are freed, what it was given this step is withdrawn, and it waits to be
recomputed from its tokens. Waiting requests (interactive before batch, then arrival order) are admitted
while blocks, budget and batch slots last; a prompt's cached prefix blocks are reused, and a KV connector
may supply a request's first tokens' KV (then they are loaded, not computed).

The engine may schedule a step while the one before it still runs (asynchronous scheduling, see
`workers.engine.core`): a request whose token that step samples is not on the host yet counts it as a
placeholder (`EngineRequest.num_output_placeholders`), and decodes on from it; it gets no chunk when that
token is surely its last (a prefill-only request's first token, its max_tokens-th, the context's last), nor
once aborted (it leaves when the step holding it is done). `commit` records a step as launched: its tokens
count as computed from then on.
"""

import time
from collections import deque

from workers.engine.connector import KvConnector, NullConnector
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import BATCH, INTERACTIVE, EngineRequest, RequestStatus
from workers.engine.schedule import ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        token_budget: int = 512,
        max_running: int = 64,
        context_length: int | None = None,
    ) -> None:
        if token_budget < 1 or max_running < 1:
            raise ValueError("the token budget and the batch size must be positive")
        self.kv = kv
        self.token_budget = token_budget
        self.max_running = max_running
        self.connector: KvConnector = NullConnector()  # until the engine attaches its own (Engine.attach_connector)
        self.context_length = context_length  # a request reaching it stops (None: no limit)
        self.running: list[EngineRequest] = []
        self._waiting: dict[int, deque[EngineRequest]] = {INTERACTIVE: deque(), BATCH: deque()}
        self._arrivals = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def waiting_count(self, priority: int) -> int:
        return len(self._waiting[priority])

    def fits_alone(self, num_tokens: int) -> bool:
        return self.kv.blocks_for(num_tokens) <= self.kv.num_blocks

    @property
    def prompt_tokens_pending(self) -> int:
        """The prompt tokens of queued and running requests not computed yet: the prefill work ahead."""
        queued = [request for queue in self._waiting.values() for request in queue]
        return sum(request.prompt_tokens_pending for request in self.running + queued)

    def add(self, request: EngineRequest) -> None:
        self._arrivals += 1
        request.arrival = self._arrivals
        request.status = RequestStatus.WAITING
        request.queued_ns = time.time_ns()
        self._waiting[self._queue_of(request)].append(request)

    def finish(self, request: EngineRequest) -> None:
        """Removes a request wherever it is and frees its blocks (finished, aborted or failed)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting[self._queue_of(request)].remove(request)
        request.status = RequestStatus.FINISHED
        self.kv.free(request.request_id)
        self.connector.request_finished(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.aborted or self._last_token_under_way(request):
                index += 1
                continue
            num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget)
            drafts = self._drafts_that_fit(request, budget)
            scheduled = True
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = max(self.running, key=lambda r: (r.priority, r.arrival))
                if self.running.index(victim) < index:
                    index -= 1  # the requests after it move up one place
                budget += self._preempt(victim, out)
                if victim is request:
                    scheduled = False  # the same index is now the next request
                    break
            if scheduled:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                index += 1
        if not out.preempted:
            self._admit(out, budget)
        if out.chunks:
            out.kv_connector_meta = self.connector.build_meta(out, self.kv)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """The step `out` is launched: its tokens count as computed (accepted drafts are added once verified),
        and each request it samples for holds a placeholder until the step's outputs are processed."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens - len(chunk.draft_token_ids)
            if chunk.samples:
                chunk.request.num_output_placeholders += 1

    def _last_token_under_way(self, request: EngineRequest) -> bool:
        """Whether the token a step under way samples for the request is surely its last."""
        if not request.num_output_placeholders:
            return False
        produced = request.sample_index + request.num_output_placeholders  # max_tokens counts a migration's too
        context = self.context_length is not None and request.num_tokens_with_placeholders >= self.context_length
        return request.prefill_only or produced >= request.sampling.max_tokens or context

    def _drafts_that_fit(self, request: EngineRequest, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: as many as the budget left after its last
        token allows, with blocks for them; when no block is free, those its blocks have room for (a draft
        never preempts a request)."""
        if request.num_tokens - request.num_computed_tokens != 1:
            return []  # still in its prompt (or recomputing it)
        drafts = request.draft_token_ids[: budget - 1]
        if drafts and not self.kv.allocate(request.request_id, request.num_tokens + len(drafts)):
            room = len(self.kv.block_ids(request.request_id)) * self.kv.block_size - request.num_tokens
            drafts = drafts[: max(0, room)]  # those the blocks it holds have room for
        return drafts

    def _preempt(self, request: EngineRequest, out: SchedulerOutput) -> int:
        """Frees the request's blocks and queues it at the front of its queue, to be recomputed; withdraws
        the chunk it was given this step, if any, and returns that chunk's tokens to the budget."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        withdrawn = sum(chunk.num_tokens for chunk in out.chunks if chunk.request is request)
        out.chunks = [chunk for chunk in out.chunks if chunk.request is not request]
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._waiting[self._queue_of(request)].appendleft(request)
        out.preempted.append(request)
        self.connector.request_preempted(request)
        return withdrawn

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_running:
            queue = self._waiting[INTERACTIVE] or self._waiting[BATCH]
            if not queue:
                return
            request = queue[0]
            external = self.connector.num_external_tokens(request)
            if external:
                if not self._admit_loaded(request, external, out):
                    return
            elif not self._admit_cached(request, budget):
                return
            queue.popleft()
            request.status = RequestStatus.RUNNING
            request.scheduled_ns = request.scheduled_ns or time.time_ns()  # its queueing ends (trace spans)
            self.running.append(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new

    def _admit_loaded(self, request: EngineRequest, external: int, out: SchedulerOutput) -> bool:
        """Admits a request whose first `external` tokens' KV the connector loads: its block table starts
        with the blocks this worker already held of its prompt (reserved when its KV was asked for; the
        sender sent only the blocks after them), fresh blocks follow, and the step loads only those the KV
        arrived for. False when the blocks are not free yet."""
        if not self.kv.allocate_reserved(request.request_id, request.num_tokens):
            return False
        request.num_computed_tokens = external
        out.loads.append(request)
        return True

    def _admit_cached(self, request: EngineRequest, budget: int) -> bool:
        """Admits a request from its prefix cache hit and the blocks right after it that the connector loads
        (fetched from the KV tier); those are cached prefill too, and billed as such. False when the blocks
        are not free yet."""
        hit = self.kv.find_prefix(request.all_token_ids, request.cache_salt)
        hit_blocks = len(hit.blocks)
        loaded = self.connector.blocks_after_hit(request, hit_blocks)
        cached = (hit_blocks + loaded) * self.kv.block_size
        num_new = min(request.num_tokens - cached, budget)
        if not self.kv.allocate(request.request_id, cached + num_new, hit):
            return False
        block_ids = self.kv.block_ids(request.request_id)[hit_blocks : hit_blocks + loaded] if loaded else []
        self.connector.load_after_hit(request, hit_blocks, block_ids)
        if request.num_preemptions == 0:
            self.kv.record_lookup(request.num_tokens, hit_blocks * self.kv.block_size)
            request.num_cached_tokens = cached
        request.num_computed_tokens = cached
        return True

    @staticmethod
    def _queue_of(request: EngineRequest) -> int:
        return BATCH if request.priority == BATCH else INTERACTIVE
