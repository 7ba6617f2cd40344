"""Structured outputs on real workers of the built-in model (random weights: only the grammar makes the
output valid): a JSON schema followed in colocated and split mode, after a migration, under sampling and
with drafting on; bad grammars and forbidden tokens refused; the grammar cache bounded."""

import json

import grpc
import jsonschema
import pytest
from transformers import AutoTokenizer

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import JSON_SCHEMA, Grammar, llguidance_tokenizer
from diptych_common.proto.v1 import worker_pb2
from diptych_common.worker_credential import WorkerSecret
from gateway.core.request_path import RequestPath
from gateway.core.trace import RequestTrace
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import ModelInfo, Registry, WorkerInfo
from gateway.routing.route import ServingMode
from gateway.routing.router import Router
from gateway.types import GenerationPlan, SamplingSpec
from tests.workers.serving import SECRET, Worker, split
from tests.workers.test_spec_decode import NGRAM
from workers.engine.core import EngineConfig
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler, GrammarRejected

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
PROMPTS = [[0, 5, 6, 7, 8], [0, 40, 41, 42, 43, 44, 45, 46, 47], [0, *list(range(100, 140))]]


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir)


@pytest.fixture(scope="session")
def grammars(tokenizer):
    return GrammarCompiler(llguidance_tokenizer(tokenizer, DIPTYCH_TINY.llama_config["vocab_size"], frozenset({EOS})))


@pytest.fixture
async def colocated(tiny_model, executor, grammars):
    worker = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False, grammars=grammars)
    await worker.start()
    yield worker
    await worker.stop()


@pytest.fixture
async def pair(tiny_model, executor, grammars):
    prefill = Worker(Role.PREFILL, tiny_model, executor, allow_shm=False, grammars=grammars)
    decode = Worker(Role.DECODE, tiny_model, executor, allow_shm=False, grammars=grammars)
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def constrained(max_tokens: int = 120, constraint: worker_pb2.Constraint | None = None, **fields):
    constraint = constraint or worker_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    return worker_pb2.SamplingParams(**{"temperature": 0.0, **fields}, max_tokens=max_tokens, constraint=constraint)


async def generate(worker, request_id: str, prompt: list[int], params) -> list[worker_pb2.TokenEvent]:
    work = worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=prompt, sampling=params)
    return [event async for event in worker.stub.Generate(work)]


def assert_valid(tokenizer, events, max_tokens: int = 120) -> dict:
    """The output is one JSON document the schema accepts, and the request stopped when it was complete."""
    token_ids = [event.token_id for event in events]
    value = json.loads(tokenizer.decode(token_ids, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)
    assert events[-1].finished and events[-1].finished_by_eos and len(token_ids) < max_tokens
    return value


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_a_colocated_output_follows_the_json_schema(colocated, tokenizer, prompt):
    assert_valid(tokenizer, await generate(colocated, "r", prompt, constrained()))


async def test_seeded_sampling_follows_the_schema_too(colocated, tokenizer):
    for seed in range(3):
        params = constrained(temperature=1.0, top_p=0.9, has_seed=True, seed=seed)
        assert_valid(tokenizer, await generate(colocated, f"s{seed}", PROMPTS[1], params))


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_a_split_output_follows_the_json_schema_across_the_hand_off(pair, colocated, tokenizer, prompt):
    """The decode worker's grammar consumed the prefill worker's first token before it constrained the
    second: the split output is the colocated one, token for token."""
    prefill_events, rest = await split(*pair, "r", prompt, 120, params=constrained())
    first = prefill_events[0].first_token
    events = [worker_pb2.TokenEvent(token_id=first.token_id), *rest]
    assert_valid(tokenizer, events)
    whole = await generate(colocated, "c", prompt, constrained())
    assert [e.token_id for e in events] == [e.token_id for e in whole]


async def test_a_migrated_call_continues_the_document_where_it_stopped(pair, colocated, tokenizer):
    """A re-run after a decode worker died: prefill on prompt + the tokens already produced, with
    tokens_already_generated; the grammar consumes those first, so the document goes on, not over."""
    prompt = PROMPTS[1]
    whole = [e.token_id for e in await generate(colocated, "c", prompt, constrained())]
    for produced in (1, 5, len(whole) - 2):
        params = constrained(tokens_already_generated=produced)
        prefill_events, rest = await split(*pair, f"m{produced}", prompt + whole[:produced], 120, params=params)
        continued = [prefill_events[0].first_token.token_id] + [e.token_id for e in rest]
        assert whole[:produced] + continued == whole
    # the last token alone is left: it completes the document on the re-run's first token
    params = constrained(tokens_already_generated=len(whole) - 1)
    events = await generate(colocated, "last", prompt + whole[:-1], params)
    assert [e.token_id for e in events] == whole[-1:] and events[-1].finished_by_eos


async def test_a_json_object_is_one_whole_object(colocated, tokenizer):
    events = await generate(colocated, "o", PROMPTS[0], constrained(300, worker_pb2.Constraint(json_object=True)))
    value = json.loads(tokenizer.decode([e.token_id for e in events], skip_special_tokens=True))
    assert isinstance(value, dict) and events[-1].finished_by_eos


async def test_a_constrained_request_gets_no_drafts(tiny_model, executor, grammars, tokenizer):
    """Drafts are verified against picks whose masks do not know them: a constrained request never gets any."""
    config = EngineConfig(num_kv_blocks=128, token_budget=64, speculative=NGRAM)
    worker = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False, config=config, grammars=grammars)
    await worker.start()
    try:
        prompt = [0] + [20, 21, 22, 23] * 8  # a prompt the n-gram proposer drafts from eagerly
        assert_valid(tokenizer, await generate(worker, "d", prompt, constrained()))
        assert worker.engine.draft_tokens_proposed == 0
    finally:
        await worker.stop()


@pytest.mark.parametrize(
    "constraint, message",
    [
        (worker_pb2.Constraint(json_schema='{"type": "strnig"}'), "does not compile"),
        (worker_pb2.Constraint(json_schema="[1"), "does not compile"),
        (worker_pb2.Constraint(lark_grammar="start: nowhere"), "does not compile"),
    ],
)
async def test_a_grammar_that_does_not_compile_is_invalid_argument(colocated, constraint, message):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(colocated, "bad", PROMPTS[0], constrained(constraint=constraint))
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "SamplingParams.constraint" in raised.value.details() and message in raised.value.details()
    assert colocated.engine.stats().running == 0


async def test_tokens_already_produced_that_break_the_grammar_are_invalid_argument(colocated, tokenizer):
    produced = tokenizer("nope", add_special_tokens=False)["input_ids"]
    params = constrained(tokens_already_generated=len(produced))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(colocated, "bad", PROMPTS[0] + produced, params)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "do not follow the grammar" in raised.value.details()


async def test_a_worker_without_a_tokenizer_refuses_grammars(tiny_model, executor):
    worker = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False)
    await worker.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await generate(worker, "g", PROMPTS[0], constrained())
        assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await worker.stop()


def test_the_compiled_grammars_are_bounded_and_reused(tokenizer):
    compiler = GrammarCompiler(llguidance_tokenizer(tokenizer, 512, frozenset({EOS})), cache_size=2)
    schemas = [Grammar(JSON_SCHEMA, json.dumps({"type": "integer", "maximum": limit})) for limit in range(3)]
    for grammar in schemas:
        compiler.start(grammar, [])
    assert compiler.cached == 2
    digits = tokenizer("7", add_special_tokens=False)["input_ids"]
    with pytest.raises(GrammarRejected, match="do not follow"):
        compiler.start(schemas[2], digits)  # 7 > 2: refused by the cached grammar's copy
    assert compiler.start(schemas[2], tokenizer("2", add_special_tokens=False)["input_ids"]).complete
    assert not compiler.start(schemas[2], []).complete  # each request starts from a fresh copy


async def test_the_gateway_migrates_a_constrained_stream_without_breaking_the_document(
    tiny_model, executor, grammars, tokenizer, colocated
):
    """A decode worker stops mid-stream: the gateway re-runs prefill on prompt + the tokens produced, on
    another pair, and the grammar, past those tokens, continues the same document: neither repeated nor broken."""
    prompt = PROMPTS[2]
    whole = [e.token_id for e in await generate(colocated, "c", prompt, constrained())]
    prefill = Worker(Role.PREFILL, tiny_model, executor, allow_shm=False, grammars=grammars)
    decodes = {name: Worker(Role.DECODE, tiny_model, executor, allow_shm=False, grammars=grammars) for name in "ab"}
    for worker in (prefill, *decodes.values()):
        await worker.start()
    infos = {
        "p": WorkerInfo("p", "prefill", "m", "local", prefill.address, "ready", 0, 0),
        **{
            f"d-{n}": WorkerInfo(f"d-{n}", "decode", "m", "local", w.address, "ready", 0, 0) for n, w in decodes.items()
        },
    }
    by_id = {"p": prefill, **{f"d-{n}": w for n, w in decodes.items()}}
    channels = Channels(WorkerSecret(SECRET))
    board = LoadBoard(channels)
    registry = Registry(control_plane=None)
    registry.workers = list(infos.values())
    path = RequestPath(channels, board, Router(registry, board, ServingMode.SPLIT))
    stopped = []
    try:
        for worker_id, worker in by_id.items():
            board.report(infos[worker_id], worker.service.load().to_proto())
        grammar = Grammar(JSON_SCHEMA, json.dumps(SCHEMA))
        plan = GenerationPlan(
            request_id="exec_1",
            organization_id="org_1",
            model=ModelInfo("m", "builtin", 1024),
            tokenizer=None,
            prompt_token_ids=prompt,
            sampling=SamplingSpec(temperature=0.0, max_tokens=120, grammar=grammar),
            stop=[],
        )
        trace, tokens = RequestTrace(), []
        async for arrived in path.run(plan, trace):
            tokens.extend(event.token_id for event in arrived)
            if len(tokens) >= 2 and not stopped:  # the decode worker's first token: it stops now
                stopped.append(by_id[trace.decode.worker.id])
                await stopped[0].stop()
        assert trace.attempts == 2  # the stream moved
        assert tokens == whole
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    finally:
        await channels.close()
        for worker in (prefill, *decodes.values()):
            if worker not in stopped:
                await worker.stop()
