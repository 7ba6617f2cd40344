"""A worker's Prometheus metrics, read at scrape time from the same Load report the gateway routes on
(`WorkerLoad.to_proto()`, from the engine's stats: the two never disagree), served over HTTP when the
worker is given a metrics port.

Engine steps are the exception: their durations and sizes are observed as they happen, into histograms.

Wiring: `serve_metrics(port, host, role, lambda: service.load().to_proto(), engine)` once the worker's
service exists.
"""

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from diptych_common.proto.v1 import worker_pb2

if TYPE_CHECKING:
    from workers.engine.core import Engine


LoadValue = Callable[[worker_pb2.Load], float]

# (name, help, the value in the worker's Load) of each metric the Load gives as one number
_GAUGES: tuple[tuple[str, str, LoadValue], ...] = (
    ("diptych_worker_active_sequences", "Sequences running on this worker", lambda load: load.active_sequences),
    ("diptych_worker_kv_blocks_free", "Free KV cache blocks", lambda load: load.kv_blocks_free),
    ("diptych_worker_kv_blocks_total", "KV cache blocks in all", lambda load: load.kv_blocks_total),
    (
        "diptych_worker_draining",
        "1 while the worker finishes its work and takes no new",
        lambda load: int(load.draining),
    ),
)
# Throughput as counters: rate(diptych_worker_generated_tokens_total[1m]) is tokens per second.
_COUNTERS: tuple[tuple[str, str, LoadValue], ...] = (
    (
        "diptych_worker_prompt_tokens_computed",
        "Prompt tokens whose KV this worker computed (prefix-cache and KV-tier hits excluded)",
        lambda load: load.prompt_tokens_computed,
    ),
    ("diptych_worker_generated_tokens", "Output tokens this worker sampled", lambda load: load.tokens_generated),
    ("diptych_worker_kv_sent_bytes", "KV cache bytes sent to decode workers", lambda load: load.kv_bytes_sent),
    (
        "diptych_worker_kv_received_bytes",
        "KV cache bytes received from prefill workers",
        lambda load: load.kv_bytes_received,
    ),
    (
        "diptych_worker_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
        lambda load: load.prefix_cache.hits_tokens,
    ),
    (
        "diptych_worker_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        lambda load: load.prefix_cache.queried_tokens,
    ),
    (
        "diptych_worker_draft_tokens_proposed",
        "Draft tokens verified (speculative decoding)",
        lambda load: load.speculative.draft_tokens_proposed,
    ),
    (
        "diptych_worker_draft_tokens_accepted",
        "Draft tokens equal to the model's own pick (speculative decoding)",
        lambda load: load.speculative.draft_tokens_accepted,
    ),
    (
        "diptych_worker_kv_tier_hit_tokens",
        "Prompt tokens loaded from the shared KV tier",
        lambda load: load.kv_tier.hit_tokens,
    ),
    (
        "diptych_worker_kv_tier_queried_tokens",
        "Prompt tokens asked of the shared KV tier",
        lambda load: load.kv_tier.queried_tokens,
    ),
    (
        "diptych_worker_kv_tier_blocks_put",
        "KV blocks shipped to the shared KV tier",
        lambda load: load.kv_tier.blocks_put,
    ),
    (
        "diptych_worker_kv_tier_blocks_dropped",
        "KV blocks not shipped to the shared KV tier (queue full or tier unreachable)",
        lambda load: load.kv_tier.blocks_dropped,
    ),
    (
        "diptych_worker_kv_tier_errors",
        "Failed shared KV tier calls and damaged blocks",
        lambda load: load.kv_tier.errors,
    ),
)
_LABELS = ["role", "worker_id"]


class LoadCollector(Collector):
    def __init__(self, role: str, load: Callable[[], worker_pb2.Load]) -> None:
        self._role = role
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        values = [self._role, load.worker_id]
        queue = GaugeMetricFamily(
            "diptych_worker_queue_depth",
            "Requests waiting on this worker, by priority class",
            labels=[*_LABELS, "priority"],
        )
        queue.add_metric([*values, "interactive"], load.waiting_interactive)
        queue.add_metric([*values, "batch"], load.waiting_batch)
        yield queue
        for name, help_text, value in _GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=_LABELS)
            gauge.add_metric(values, value(load))
            yield gauge
        for name, help_text, value in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=_LABELS)
            counter.add_metric(values, value(load))
            yield counter
        by_path = CounterMetricFamily(
            "diptych_worker_kv_path_bytes",
            "KV cache bytes moved between workers, by direction and data path (tcp, shm, nixl)",
            labels=[*_LABELS, "direction", "data_path"],
        )
        for direction, moved in (("sent", load.kv_bytes_sent_by_path), ("received", load.kv_bytes_received_by_path)):
            for data_path, nbytes in sorted(moved.items()):
                by_path.add_metric([*values, direction, data_path], nbytes)
        yield by_path


class StepMetrics:
    """Duration and size of every engine step, observed through `Engine.on_step`."""

    def __init__(self, role: str, registry: CollectorRegistry = REGISTRY) -> None:
        self._seconds = Histogram(
            "diptych_worker_step_seconds",
            "Duration of an engine step (one forward pass and its sampling)",
            ["role"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        ).labels(role)
        self._tokens = Histogram(
            "diptych_worker_step_tokens",
            "Tokens computed in an engine step (prompt chunks and decoding tokens)",
            ["role"],
            buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 2048),
            registry=registry,
        ).labels(role)

    def observe(self, tokens: int, step_ms: float) -> None:
        self._seconds.observe(step_ms / 1000)
        self._tokens.observe(tokens)


def serve_metrics(
    port: int | None, host: str, role: str, load: Callable[[], worker_pb2.Load], engine: "Engine"
) -> None:
    """Registers the load collector and the step histograms (fed by `engine`) and serves /metrics on
    `port` (nothing when port is None or 0)."""
    if not port:
        return
    REGISTRY.register(LoadCollector(role, load))
    engine.on_step = StepMetrics(role).observe
    start_http_server(port, addr=host)
