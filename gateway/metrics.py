"""The gateway's Prometheus metrics."""

from prometheus_client import Counter, Histogram

REQUESTS = Counter("diptych_gateway_requests_total", "Generate requests by outcome", ["model", "mode", "code"])
OUTPUT_TOKENS = Counter("diptych_gateway_output_tokens_total", "Output tokens streamed to clients", ["model"])
WORKER_BYTES_RECEIVED = Counter(
    "diptych_gateway_worker_bytes_received_total",
    "Bytes of worker responses the gateway received; KV caches move between workers and never count here",
)
TIME_TO_FIRST_TOKEN = Histogram(
    "diptych_gateway_time_to_first_token_seconds", "From request arrival to the first token", ["model", "mode"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
