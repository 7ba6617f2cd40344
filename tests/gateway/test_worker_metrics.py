"""The worker's Prometheus metrics come from its Load report, read at scrape time."""

from prometheus_client import CollectorRegistry, generate_latest

from diptych_common.proto.v1 import worker_pb2
from workers.serving.metrics import LoadCollector, StepMetrics


def test_the_load_report_becomes_metrics():
    load = worker_pb2.Load(
        worker_id="wrk_1",
        active_sequences=3,
        kv_blocks_free=10,
        kv_blocks_total=64,
        waiting_interactive=2,
        waiting_batch=5,
        kv_bytes_sent=1234,
    )
    load.prefix_cache.hits_tokens = 96
    load.speculative.draft_tokens_proposed = 40
    load.speculative.draft_tokens_accepted = 31
    load.kv_tier.hit_tokens = 176
    load.kv_tier.blocks_dropped = 3
    registry = CollectorRegistry()
    registry.register(LoadCollector("prefill", lambda: load))
    text = generate_latest(registry).decode()
    assert 'diptych_worker_queue_depth{priority="batch",role="prefill",worker_id="wrk_1"} 5.0' in text
    assert 'diptych_worker_queue_depth{priority="interactive",role="prefill",worker_id="wrk_1"} 2.0' in text
    assert 'diptych_worker_active_sequences{role="prefill",worker_id="wrk_1"} 3.0' in text
    assert 'diptych_worker_kv_sent_bytes_total{role="prefill",worker_id="wrk_1"} 1234.0' in text
    assert 'diptych_worker_prefix_cache_hit_tokens_total{role="prefill",worker_id="wrk_1"} 96.0' in text
    assert 'diptych_worker_draft_tokens_proposed_total{role="prefill",worker_id="wrk_1"} 40.0' in text
    assert 'diptych_worker_draft_tokens_accepted_total{role="prefill",worker_id="wrk_1"} 31.0' in text
    assert 'diptych_worker_kv_tier_hit_tokens_total{role="prefill",worker_id="wrk_1"} 176.0' in text
    assert 'diptych_worker_kv_tier_blocks_dropped_total{role="prefill",worker_id="wrk_1"} 3.0' in text


def test_throughput_is_a_counter_that_rates_derive_from():
    load = worker_pb2.Load(
        worker_id="wrk_1", tokens_per_second=812.5, prompt_tokens_computed=9000, tokens_generated=4321
    )
    registry = CollectorRegistry()
    registry.register(LoadCollector("decode", lambda: load))
    text = generate_latest(registry).decode()
    assert "# TYPE diptych_worker_generated_tokens_total counter" in text
    assert 'diptych_worker_generated_tokens_total{role="decode",worker_id="wrk_1"} 4321.0' in text
    assert "# TYPE diptych_worker_prompt_tokens_computed_total counter" in text
    assert 'diptych_worker_prompt_tokens_computed_total{role="decode",worker_id="wrk_1"} 9000.0' in text
    assert "tokens_per_second" not in text  # a gauge of a recent rate: Prometheus derives rates itself


def test_engine_steps_become_histograms():
    registry = CollectorRegistry()
    steps = StepMetrics("decode", registry)
    steps.observe(32, 62.5)
    steps.observe(512, 625.0)
    text = generate_latest(registry).decode()
    assert 'diptych_worker_step_seconds_count{role="decode"} 2.0' in text
    assert 'diptych_worker_step_seconds_bucket{le="0.1",role="decode"} 1.0' in text
    assert 'diptych_worker_step_seconds_sum{role="decode"} 0.6875' in text
    assert 'diptych_worker_step_tokens_bucket{le="32.0",role="decode"} 1.0' in text
    assert 'diptych_worker_step_tokens_sum{role="decode"} 544.0' in text


def test_kv_bytes_show_by_direction_and_data_path():
    load = worker_pb2.Load(worker_id="wrk_1", kv_bytes_sent_by_path={"nixl": 4096, "shm": 512})
    registry = CollectorRegistry()
    registry.register(LoadCollector("prefill", lambda: load))
    text = generate_latest(registry).decode()
    labels = 'direction="sent",role="prefill",worker_id="wrk_1"'
    assert f'diptych_worker_kv_path_bytes_total{{data_path="nixl",{labels}}} 4096.0' in text
    assert f'diptych_worker_kv_path_bytes_total{{data_path="shm",{labels}}} 512.0' in text
    assert 'direction="received"' not in text  # a prefill worker receives none


def test_every_load_figure_is_a_metric_of_its_kind():
    collector = LoadCollector("decode", lambda: worker_pb2.Load(worker_id="wrk_1"))
    kinds = {family.name: family.type for family in collector.collect()}
    gauges = {"queue_depth", "active_sequences", "kv_blocks_free", "kv_blocks_total", "draining"}
    counters = {
        "prompt_tokens_computed",
        "generated_tokens",
        "kv_sent_bytes",
        "kv_received_bytes",
        "kv_path_bytes",
        "prefix_cache_hit_tokens",
        "prefix_cache_queried_tokens",
        "draft_tokens_proposed",
        "draft_tokens_accepted",
        "kv_tier_hit_tokens",
        "kv_tier_queried_tokens",
        "kv_tier_blocks_put",
        "kv_tier_blocks_dropped",
        "kv_tier_errors",
    }
    assert kinds == {f"diptych_worker_{name}": "gauge" for name in gauges} | {
        f"diptych_worker_{name}": "counter" for name in counters
    }
