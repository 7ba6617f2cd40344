"""The worker's Prometheus metrics come from its Load report, read at scrape time."""

from prometheus_client import CollectorRegistry, generate_latest

from diptych_common.proto.v1 import worker_pb2
from workers.metrics import LoadCollector


def test_the_load_report_becomes_metrics():
    load = worker_pb2.Load(
        worker_id="wrk_1", active_sequences=3, kv_blocks_free=10, kv_blocks_total=64, waiting_interactive=2,
        waiting_batch=5, kv_bytes_sent=1234,
    )
    load.prefix_cache.hits_tokens = 96
    registry = CollectorRegistry()
    registry.register(LoadCollector("prefill", lambda: load))
    text = generate_latest(registry).decode()
    assert 'diptych_worker_queue_depth{priority="batch",role="prefill",worker_id="wrk_1"} 5.0' in text
    assert 'diptych_worker_queue_depth{priority="interactive",role="prefill",worker_id="wrk_1"} 2.0' in text
    assert 'diptych_worker_active_sequences{role="prefill",worker_id="wrk_1"} 3.0' in text
    assert 'diptych_worker_kv_sent_bytes_total{role="prefill",worker_id="wrk_1"} 1234.0' in text
    assert 'diptych_worker_prefix_cache_hit_tokens_total{role="prefill",worker_id="wrk_1"} 96.0' in text
