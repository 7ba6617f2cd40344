"""The gateway's Prometheus metrics."""

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

REQUESTS = Counter(
    "diptych_gateway_requests_total", "Generate requests by outcome", ["model", "mode", "code", "protocol"]
)
OUTPUT_TOKENS = Counter("diptych_gateway_output_tokens_total", "Output tokens streamed to clients", ["model"])
PROMPT_TOKENS = Counter(
    "diptych_gateway_prompt_tokens_total", "Prompt tokens of the requests that ran (once per request)", ["model"]
)
REQUEST_DURATION = Histogram(
    "diptych_gateway_request_duration_seconds",
    "From a generating request's arrival to its answer's last byte, refusals and failures included",
    ["model", "api", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
WORKER_BYTES_RECEIVED = Counter(
    "diptych_gateway_worker_bytes_received_total",
    "Bytes of worker responses the gateway received; KV caches move between workers and never count here",
)
TIME_TO_FIRST_TOKEN = Histogram(
    "diptych_gateway_time_to_first_token_seconds",
    "From request arrival to the first token",
    ["model", "mode"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "diptych_gateway_inter_token_latency_seconds",
    "Between consecutive output tokens of a stream",
    ["model"],
    buckets=_LATENCY_BUCKETS,
)
QUEUE_DEPTH = Gauge(
    "diptych_gateway_worker_queue_depth",
    "Requests waiting on the workers of a role, from their live load reports",
    ["role"],
)
KV_TRANSFER_BYTES = Counter(
    "diptych_gateway_kv_transfer_bytes_total", "KV cache bytes the prefill workers reported delivered to decode workers"
)
KV_TRANSFER_SECONDS = Histogram(
    "diptych_gateway_kv_transfer_seconds",
    "KV cache transfer time reported by the prefill workers",
    buckets=_LATENCY_BUCKETS,
)
ROUTING_DECISIONS = Counter(
    "diptych_gateway_routing_decisions_total",
    "Routes chosen: split, split_skipped (prefill on the decode worker itself) or colocated",
    ["model", "decision"],
)
ROUTED_REQUESTS = Counter(
    "diptych_gateway_routed_requests_total",
    "Routes chosen (one per attempt), by the region of their workers ('prefill>decode' for a pair across two) "
    "and local: 'true' when every worker is in the gateway's own --region (any region when it has none)",
    ["region", "local"],
)
PREFIX_CACHE_MATCHED_TOKENS = Counter(
    "diptych_gateway_prefix_matched_tokens_total",
    "Prompt tokens the chosen prefill worker already held in its prefix cache, by the workers' published block hashes",
)
RETRIES = Counter("diptych_gateway_retries_total", "Worker calls retried on another worker after a failure", ["phase"])
MIGRATIONS = Counter(
    "diptych_gateway_decode_migrations_total",
    "Streams moved to another decode worker mid-way (prefill re-run on prompt plus the tokens already sent)",
)
RATE_LIMITED = Counter("diptych_gateway_rate_limited_total", "Requests refused by a rate limit", ["scope", "kind"])
USAGE_SPOOLED = Gauge(
    "diptych_gateway_usage_events_spooled", "Usage events waiting in the local spool for the control plane"
)
IDEMPOTENCY_KEYS_HELD_ALONE = Gauge(
    "diptych_gateway_idempotency_keys_held_alone",
    "Idempotency keys this gateway claimed, stored or freed while the control plane was unreachable, not yet "
    "handed over to it",
)
IDEMPOTENCY_OUTAGE_CLAIMS = Counter(
    "diptych_gateway_idempotency_outage_claims_total",
    "Requests with an idempotency key that ran under a claim this gateway made alone (control plane unreachable)",
)
IDEMPOTENCY_HANDOVER_CONFLICTS = Counter(
    "diptych_gateway_idempotency_handover_conflicts_total",
    "Keys claimed in an outage that the control plane had given to another execution when handed over: the "
    "key's request ran twice (each run billed as delivered)",
)
# Per-phase autoscaling (gateway/autoscale/signals.py): the scaling decision and the signals behind it, per fleet.
_FLEET = ["model", "role", "region"]
AUTOSCALE_DESIRED_REPLICAS = Gauge(
    "diptych_autoscale_desired_replicas", "Replicas the scaling decision wants for the fleet", _FLEET
)
AUTOSCALE_CURRENT_REPLICAS = Gauge(
    "diptych_autoscale_current_replicas",
    "Ready workers of the fleet reporting fresh load, as the decision counted",
    _FLEET,
)
AUTOSCALE_QUEUE_PER_WORKER = Gauge(
    "diptych_autoscale_queue_per_worker", "Requests waiting per ready worker of the fleet", _FLEET
)
AUTOSCALE_KV_UTILISATION = Gauge(
    "diptych_autoscale_kv_utilisation", "Share of the fleet's KV cache blocks in use", _FLEET
)
AUTOSCALE_SLO_ATTAINMENT = Gauge(
    "diptych_autoscale_slo_attainment",
    "Share of this gateway's recent requests meeting the SLO target (ttft: the prefill's fleet, tpot: the decode's)",
    [*_FLEET, "slo"],
)


@dataclass
class RequestRecord:
    """What the request being answered came to: its model (a registered name, else "") and its outcome (a
    gRPC status name, as `diptych_gateway_requests_total`'s code), written where it is counted."""

    arrived: float = field(default_factory=time.monotonic)
    model: str = ""
    outcome: str = ""


_CURRENT_REQUEST: ContextVar[RequestRecord | None] = ContextVar("diptych_current_request", default=None)


def count_request(model: str, mode: str, outcome: str, protocol: str) -> None:
    """Counts a generating request once, where it ended: refused at the door, or after it ran."""
    REQUESTS.labels(model, mode, outcome, protocol).inc()
    record = _CURRENT_REQUEST.get()
    if record is not None:
        record.model, record.outcome = model, outcome


@contextmanager
def timed_request(api: str, outcome_otherwise: str = "CANCELLED") -> Iterator[RequestRecord]:
    """Observes `diptych_gateway_request_duration_seconds` once, when the block ends, with the outcome the
    request was counted with (else the one the block set on the record, else `outcome_otherwise`)."""
    record = RequestRecord()
    token = _CURRENT_REQUEST.set(record)
    try:
        yield record
    finally:
        with suppress(ValueError):  # an async generator (a gRPC stream) closed from another context
            _CURRENT_REQUEST.reset(token)
        outcome = record.outcome or outcome_otherwise
        REQUEST_DURATION.labels(record.model, api, outcome).observe(time.monotonic() - record.arrived)
