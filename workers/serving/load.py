"""A worker's load, in one shape: the engine's stats plus what the worker itself knows (its id, whether it
drains, its recent rate). The gRPC `Load` (what the gateway routes on, and what the metrics show) and the
heartbeat's load report (what the control plane records) are both derived from it."""

import time
from collections import deque
from dataclasses import dataclass

from diptych_common.proto.v1 import worker_pb2
from workers.engine.core import EngineStats


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    draining: bool
    tokens_per_second: float  # prompt tokens on a prefill worker, generated tokens elsewhere
    engine: EngineStats

    def to_proto(self) -> worker_pb2.Load:
        stats = self.engine
        return worker_pb2.Load(
            worker_id=self.worker_id,
            queue_depth=stats.waiting,
            active_sequences=stats.running,
            kv_bytes_received=stats.kv_bytes_received,
            kv_bytes_sent=stats.kv_bytes_sent,
            kv_bytes_received_by_path=stats.kv_bytes_received_by_path,
            kv_bytes_sent_by_path=stats.kv_bytes_sent_by_path,
            tokens_per_second=self.tokens_per_second,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            block_size=stats.block_size,
            waiting_interactive=stats.waiting_interactive,
            waiting_batch=stats.waiting_batch,
            prompt_tokens_pending=stats.prompt_tokens_pending,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            tokens_generated=stats.tokens_generated,
            draining=self.draining,
            prefix_cache=worker_pb2.PrefixCacheSummary(
                version=stats.prefix_cache_version,
                block_hashes=stats.prefix_cache_hashes,
                hits_tokens=stats.prefix_cache_hit_tokens,
                queried_tokens=stats.prefix_cache_queried_tokens,
            ),
            speculative=worker_pb2.SpeculativeSummary(
                draft_tokens_proposed=stats.draft_tokens_proposed,
                draft_tokens_accepted=stats.draft_tokens_accepted,
            ),
            kv_tier=worker_pb2.KvTierSummary(
                hit_tokens=stats.tier.hit_tokens,
                queried_tokens=stats.tier.queried_tokens,
                blocks_put=stats.tier.blocks_put,
                blocks_dropped=stats.tier.blocks_dropped,
                errors=stats.tier.errors,
            ),
        )

    def heartbeat(self) -> dict[str, int | float]:
        """The load a heartbeat carries to the control plane."""
        return {
            "queue_depth": self.engine.waiting,
            "active_sequences": self.engine.running,
            "kv_blocks_free": self.engine.kv_blocks_free,
            "kv_blocks_total": self.engine.kv_blocks_total,
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


class RateMeter:
    """Tokens per second over the last `window` seconds, from running totals."""

    def __init__(self, window: float = 10.0) -> None:
        self._window = window
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int) -> float:
        now = time.monotonic()
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        first_time, first_total = self._samples[0]
        return (total - first_total) / (now - first_time) if now - first_time > 0.1 else 0.0
