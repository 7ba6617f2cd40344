"""A request's calls to its workers in the worker API's messages, and their tokens back in the gateway's
types: the one place the request path meets protobuf."""

from diptych_common.grammar import JSON_OBJECT, JSON_SCHEMA, Grammar
from diptych_common.proto.v1 import worker_pb2
from gateway.fleet.token_streams import WorkerTokenStream
from gateway.types import GenerationPlan, Priority, SampledToken, SamplingSpec, WorkerLogprobs

_WORKER_PRIORITY = {Priority.INTERACTIVE: worker_pb2.PRIORITY_INTERACTIVE, Priority.BATCH: worker_pb2.PRIORITY_BATCH}


def decode_request(
    plan: GenerationPlan,
    attempt_id: str,
    prompt: list[int],
    sampling: worker_pb2.SamplingParams,
    transfer_token: bytes,
    stream: WorkerTokenStream | None,
) -> worker_pb2.DecodeRequest:
    """`prompt`: the request's prompt and the tokens it produced before (a moved stream's); `sampling`:
    `worker_sampling` after those."""
    return worker_pb2.DecodeRequest(
        request_id=attempt_id,
        transfer_token=transfer_token,
        sampling=sampling,
        prompt_tokens=len(prompt),
        priority=_WORKER_PRIORITY[plan.priority],
        cache_salt=plan.cache_salt,
        prompt_token_ids=prompt,  # the decode worker keeps what it holds of it; the rest is sent
        token_stream=stream.stream_id if stream is not None else "",
    )


def prefill_request(
    plan: GenerationPlan,
    attempt_id: str,
    prompt: list[int],
    sampling: worker_pb2.SamplingParams,
    transfer_token: bytes,
    decode_address: str,
) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=attempt_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        decode_address=decode_address,
        transfer_token=transfer_token,
        priority=_WORKER_PRIORITY[plan.priority],
        cache_salt=plan.cache_salt,
    )


def generate_work(
    plan: GenerationPlan, attempt_id: str, produced: list[int], stream: WorkerTokenStream | None
) -> worker_pb2.GenerateWork:
    return worker_pb2.GenerateWork(
        request_id=attempt_id,
        prompt_token_ids=plan.prompt_token_ids + produced,
        sampling=worker_sampling(plan.sampling, produced),
        priority=_WORKER_PRIORITY[plan.priority],
        cache_salt=plan.cache_salt,
        token_stream=stream.stream_id if stream is not None else "",
    )


def worker_sampling(sampling: SamplingSpec, produced: list[int]) -> worker_pb2.SamplingParams:
    """The request's sampling after `produced` tokens: max_tokens stays the request's budget in all (the
    tokens already produced count against it, as the worker knows from tokens_already_generated)."""
    return worker_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        has_seed=sampling.seed is not None,
        seed=sampling.seed or 0,
        max_tokens=sampling.max_tokens,
        ignore_eos=sampling.ignore_eos,
        tokens_already_generated=len(produced),
        constraint=_constraint(sampling.grammar),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logit_bias=dict(sampling.logit_bias),
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
    )


def _constraint(grammar: Grammar | None) -> worker_pb2.Constraint | None:
    if grammar is None:
        return None
    if grammar.kind == JSON_OBJECT:
        return worker_pb2.Constraint(json_object=True)
    if grammar.kind == JSON_SCHEMA:
        return worker_pb2.Constraint(json_schema=grammar.text)
    return worker_pb2.Constraint(lark_grammar=grammar.text)


def sampled(event: worker_pb2.TokenEvent | worker_pb2.FirstToken) -> SampledToken:
    return SampledToken(event.token_id, event.finished, event.finished_by_eos, _logprobs(event))


def _logprobs(event: worker_pb2.TokenEvent | worker_pb2.FirstToken) -> WorkerLogprobs | None:
    if not event.HasField("logprobs"):
        return None
    top = tuple((entry.token_id, entry.logprob) for entry in event.logprobs.top)
    return WorkerLogprobs(event.logprobs.logprob, top)
