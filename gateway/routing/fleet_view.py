"""The fleet as one request's routing sees it: per worker, the requests on it, the prompt tokens it
already holds of this request's prompt, the prompt tokens it has still to compute and its free KV blocks.
The router and its policy read the workers only through this view."""

import math
from collections import Counter

from diptych_common.prefix_hash import block_hashes
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import WorkerInfo
from gateway.routing.route import Phase, RouteRequest

QUEUED_REQUEST_TOKENS = 128  # the work one waiting request stands for, in prompt tokens


class FleetView:
    def __init__(self, board: LoadBoard, in_flight: Counter[str], prompting: Counter[str], request: RouteRequest):
        self.request = request
        self._board = board
        self._in_flight = in_flight
        self._prompting = prompting
        self._chains: dict[int, list[int]] = {}  # the prompt's block hashes, per block size

    def pending(self, worker: WorkerInfo) -> int:
        """Requests on the worker: its own report, or this gateway's count when that is higher (the
        report lags by up to 50 ms)."""
        load = self._board.fresh_load(worker.id)
        reported = 0
        if load is not None:
            reported = load.queue_depth + (load.active_sequences if worker.role != "prefill" else 0)
        return max(reported, self._in_flight[worker.id])

    def work(self, worker: WorkerInfo, phase: Phase) -> int:
        """The estimated work ahead of this request on the worker, in prompt tokens: what it would compute of
        the prompt (prefill) plus a fixed price per request on it."""
        queued = QUEUED_REQUEST_TOKENS * self.pending(worker)
        if phase is Phase.PREFILL:
            return len(self.request.prompt_token_ids) - self.matched_tokens(worker) + queued
        return queued

    def matched_tokens(self, worker: WorkerInfo) -> int:
        """Prompt tokens the worker holds for the request's organization: its published blocks (and those
        requests of this gateway left it since its last report) that match the prompt's leading blocks,
        named under the request's cache salt as the worker names them."""
        live = self._board.get(worker.id)
        if live is None or live.load is None or not live.load.block_size:
            return 0
        reported, finished = live.held_blocks()
        if not reported and not finished:
            return 0
        matched = 0
        for block in self.chain(live.load.block_size):
            if block not in reported and block not in finished:
                break
            matched += live.load.block_size
        return matched

    def chain(self, block_size: int) -> list[int]:
        """The prompt's block names under the request's cache salt."""
        if block_size not in self._chains:
            self._chains[block_size] = block_hashes(self.request.prompt_token_ids, block_size, self.request.cache_salt)
        return self._chains[block_size]

    def prompt_backlog(self, worker: WorkerInfo) -> int:
        """Prompt tokens the worker has still to compute: its report, or this gateway's count when that is
        higher (the report lags by up to 50 ms)."""
        load = self._board.fresh_load(worker.id)
        reported = load.prompt_tokens_pending if load is not None else 0
        return max(reported, self._prompting[worker.id])

    def free_blocks(self, worker: WorkerInfo) -> int:
        load = self._board.fresh_load(worker.id)
        return load.kv_blocks_free if load is not None else 0

    def has_room(self, worker: WorkerInfo) -> bool:
        """Whether the worker's free KV blocks hold the whole sequence (prompt and every output token)."""
        load = self._board.fresh_load(worker.id)
        if load is None or not load.kv_blocks_total or not load.block_size:
            return True  # no block accounting published: assume room
        tokens = len(self.request.prompt_token_ids) + self.request.max_tokens
        return load.kv_blocks_free >= math.ceil(tokens / load.block_size)
