"""The gateway's own types at its edges: protobuf lives only where a protocol is spoken (the gRPC front, the
worker calls); the gRPC front maps outputs into the contract's messages; the stored answer of an idempotency
key keeps the contract's JSON form; worker sampling parameters are built from the plan's; usage events keep
the JSON the control plane ingests."""

import ast
from datetime import UTC, datetime
from pathlib import Path

import pytest
from google.protobuf import json_format

from diptych_proto.v1 import inference_pb2
from gateway.accounts.auth import Caller
from gateway.accounts.idempotency import replayed_output, stored_response
from gateway.core.delivery import usage_events
from gateway.core.trace import PhaseRecord, RequestTrace
from gateway.core.worker_calls import worker_sampling
from gateway.fleet.registry import ModelInfo, WorkerInfo
from gateway.grpc_api.service import generate_response
from gateway.types import FinishReason, GenerationOutput, GenerationPlan, PhaseUsage, SamplingSpec, Usage

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
# Where each protocol is spoken: the public contract by the gRPC front (and its wiring in main.py), the
# worker contract where workers are called (request_path.py), their tokens read (token_streams.py) and
# their load reports read (live_load.py).
PROTOBUF_ALLOWED = {
    "diptych_proto": {"grpc_api/service.py"},
    "google.protobuf": {"grpc_api/service.py"},
    "diptych_common.proto": {
        "core/request_path.py",
        "core/worker_calls.py",
        "fleet/channels.py",
        "fleet/token_streams.py",
        "fleet/live_load.py",
    },
    "grpc_health": {"main.py"},
}


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_protobuf_is_imported_only_where_its_protocol_is_spoken():
    found = {
        (path.relative_to(GATEWAY).as_posix(), prefix)
        for path in sorted(GATEWAY.rglob("*.py"))
        for module in _imported_modules(path)
        for prefix in PROTOBUF_ALLOWED
        if module == prefix or module.startswith(prefix + ".")
    }
    allowed = {(name, prefix) for prefix, names in PROTOBUF_ALLOWED.items() for name in names}
    assert found <= allowed, found - allowed
    assert ("grpc_api/service.py", "diptych_proto") in found
    assert ("core/worker_calls.py", "diptych_common.proto") in found


USAGE = Usage(
    prompt_tokens=12,
    completion_tokens=3,
    cached_tokens=8,
    prefill=PhaseUsage(tokens=12, cached_tokens=8, kv_bytes=2**40 + 7, compute_ms=31, worker_id="prefill-0"),
    decode=PhaseUsage(tokens=3, cached_tokens=0, kv_bytes=0, compute_ms=9, worker_id="decode-0"),
)
OUTPUTS = [
    GenerationOutput("exec_1", "Hello", [9, 10, 11], FinishReason.STOP, USAGE),
    GenerationOutput("exec_2", "", [4], FinishReason.LENGTH, Usage(1, 1, 0, prefill=USAGE.prefill)),
    GenerationOutput("exec_3", "mid-stream", [5]),
]


@pytest.mark.parametrize("output", OUTPUTS)
def test_the_stored_answer_of_an_idempotency_key_is_the_contract_s_json(output):
    """Stored and replayed by the control plane for a day: the same JSON as the contract's GenerateResponse
    in proto3's JSON form, both ways, so that every gateway reads what any other stored."""
    message = generate_response(output)
    assert stored_response(output) == json_format.MessageToDict(message)
    assert replayed_output(json_format.MessageToDict(message)) == output


def test_the_grpc_front_maps_an_output_field_by_field():
    message = generate_response(OUTPUTS[0])
    assert (message.request_id, message.text, list(message.token_ids)) == ("exec_1", "Hello", [9, 10, 11])
    assert message.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert message.usage.prefill.kv_bytes == 2**40 + 7 and message.usage.decode.worker_id == "decode-0"
    delta = generate_response(OUTPUTS[2])
    assert delta.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED and not delta.HasField("usage")


@pytest.mark.parametrize(("seed", "has_seed"), [(None, False), (0, True), (2**64 - 1, True)])
def test_worker_sampling_is_built_from_the_plan_s_at_the_call(seed, has_seed):
    spec = SamplingSpec(temperature=0.5, top_p=0.25, top_k=7, seed=seed, max_tokens=20, ignore_eos=True)
    params = worker_sampling(spec, produced=[1, 2, 3])
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.25, 7, 20)
    assert params.has_seed is has_seed and params.seed == (seed or 0)
    assert params.ignore_eos and params.tokens_already_generated == 3


def test_usage_events_keep_the_json_the_control_plane_ingests():
    def worker(worker_id: str, role: str) -> WorkerInfo:
        return WorkerInfo(worker_id, role, "diptych-tiny", "eu", "127.0.0.1:1", "ready", 0, 0)

    at = [datetime(2030, 1, 1, 0, 0, second, tzinfo=UTC) for second in range(4)]
    trace = RequestTrace(
        prefill=PhaseRecord(worker("p1", "prefill"), at[0], at[1], compute_ms=30, kv_bytes=4096, cached_tokens=16),
        decode=PhaseRecord(worker("d1", "decode"), at[2], at[3], compute_ms=50, kv_bytes=4096, cached_tokens=4),
    )
    plan = GenerationPlan(
        request_id="exec_1",
        organization_id="org_1",
        model=ModelInfo("diptych-tiny", "builtin:diptych-tiny", 1024),
        tokenizer=None,
        prompt_token_ids=[1] * 40,
        sampling=SamplingSpec(),
        stop=[],
        client_request_id="label",
    )
    events = usage_events(plan, Caller("org_1", "key_1"), trace, completion_tokens=5)  # cached: prefill only
    common = {
        "request_id": "exec_1",
        "client_request_id": "label",
        "organization_id": "org_1",
        "api_key_id": "key_1",
        "model": "diptych-tiny",
        "region": "eu",
        "kv_bytes": 4096,
        "tier": "standard",
    }
    assert [event.to_wire() for event in events] == [
        {
            **common,
            "phase": "prefill",
            "worker_id": "p1",
            "tokens": 40,
            "cached_tokens": 16,
            "compute_ms": 30,
            "started_at": "2030-01-01T00:00:00+00:00",
            "finished_at": "2030-01-01T00:00:01+00:00",
        },
        {
            **common,
            "phase": "decode",
            "worker_id": "d1",
            "tokens": 5,
            "cached_tokens": 0,
            "compute_ms": 50,
            "started_at": "2030-01-01T00:00:02+00:00",
            "finished_at": "2030-01-01T00:00:03+00:00",
        },
    ]
    later_choice = usage_events(plan, Caller("org_1", "key_1"), trace, completion_tokens=5, bills_prompt=False)
    assert [event.to_wire() for event in later_choice] == [event.to_wire() for event in events[1:]]  # output only
    batch_runner = Caller("org_1", "key_2", kind="batch")
    assert {event.tier for event in usage_events(plan, batch_runner, trace, completion_tokens=5)} == {"batch"}
