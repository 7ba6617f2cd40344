"""A JSON-schema constrained stream whose decode worker is killed (SIGKILL) mid-stream: the gateway
migrates it to another pair, whose grammar continues the same document, so the answer is the one an
undisturbed run gives, token for token, and valid against the schema. Its own fleet (`fleet` of
test_gateway_fleet: two prefill and two decode workers), since it kills a process."""

import json
import signal

import jsonschema
from transformers import AutoTokenizer

from diptych_common.builtin import DIPTYCH_TINY
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.test_gateway_fleet import fleet, long_prompt, request, serving_decode_worker

__all__ = ["fleet"]  # the fixture, imported to run here on a fleet of this module's own

ORDER = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "blue"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    },
    "minItems": 25,
    "maxItems": 25,
}
MAX_TOKENS = 800


async def constrained_stream(fleet, prompt: list[int], kill_after: int | None = None):
    """The stream's tokens and its last response; with `kill_after`, the decode worker serving it is
    killed once that many tokens arrived (returned too)."""
    response_format = inference_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(ORDER))
    received, last, killed = [], None, None
    async with fleet.channel() as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(prompt, MAX_TOKENS, response_format=response_format), metadata=fleet.auth, timeout=180
        )
        async for response in call:
            received.extend(response.token_ids)
            last = response
            if kill_after is not None and killed is None and len(received) >= kill_after:
                killed = serving_decode_worker(fleet)
                fleet.stack.stop_process(killed, signal.SIGKILL)
    return received, last, killed


async def test_a_constrained_stream_survives_its_decode_worker_s_death_with_its_document_whole(fleet):
    tokenizer = AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir)
    prompt = long_prompt(11, 40)
    expected, _, _ = await constrained_stream(fleet, prompt)
    migrations_before = fleet.metric("diptych_gateway_decode_migrations_total")
    received, last, killed = await constrained_stream(fleet, prompt, kill_after=20)
    assert killed is not None and len(received) > 20
    assert received == expected  # the document went on where it stopped: nothing repeated, nothing broken
    assert last.finish_reason == inference_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(tokenizer.decode(received, skip_special_tokens=True)), ORDER)
    assert fleet.metric("diptych_gateway_decode_migrations_total") == migrations_before + 1
    fleet.workers.pop(killed)
