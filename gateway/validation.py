"""Checks a Generate request and turns it into a plan the request path can run. Every refusal says
what to change."""

import hashlib
import re
import uuid
from dataclasses import dataclass

import grpc

from diptych._proto.v1 import inference_pb2
from diptych_common.proto.v1 import worker_pb2
from gateway.errors import GatewayError
from gateway.registry import ModelInfo, Registry
from gateway.tokenization import encode_chat, encode_prompt, tokenizer_for

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64
CHAT_ROLES = ("system", "user", "assistant")
MAX_IDEMPOTENCY_KEY_LENGTH = 255
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass(frozen=True)
class GenerationPlan:
    request_id: str
    organization_id: str
    model: ModelInfo
    tokenizer: object
    prompt_token_ids: list[int]
    sampling: worker_pb2.SamplingParams
    stop: list[str]
    priority: int = worker_pb2.PRIORITY_INTERACTIVE

    @property
    def cache_salt(self) -> str:
        """Prefix-cache blocks are shared within an organization only."""
        return self.organization_id


def plan_generation(request: inference_pb2.GenerateRequest, registry: Registry, organization_id: str) -> GenerationPlan:
    request_id = _request_id(request.request_id, request.idempotency_key, organization_id)
    if request.priority not in (inference_pb2.PRIORITY_INTERACTIVE, inference_pb2.PRIORITY_BATCH):
        raise _invalid(f"priority {request.priority} is unknown; use PRIORITY_INTERACTIVE or PRIORITY_BATCH")
    model = registry.models.get(request.model)
    if model is None:
        available = ", ".join(sorted(registry.models)) or "none"
        raise _invalid(f"model '{request.model}' does not exist; available models: {available}", grpc.StatusCode.NOT_FOUND)
    tokenizer = tokenizer_for(model.source)
    prompt = _prompt_token_ids(request, tokenizer)
    if len(prompt) >= model.context_length:
        raise _invalid(
            f"the prompt has {len(prompt)} tokens but {model.name} has a context length of "
            f"{model.context_length}, which must also hold at least one output token; shorten the prompt"
        )
    return GenerationPlan(
        request_id=request_id,
        organization_id=organization_id,
        model=model,
        tokenizer=tokenizer,
        prompt_token_ids=prompt,
        sampling=_sampling(request, model, len(prompt)),
        stop=_stop_strings(request.stop),
        priority=int(request.priority),
    )


def _request_id(client_id: str, idempotency_key: str, organization_id: str) -> str:
    """An idempotency key names one logical request of an organization across retries: the request id
    is derived from both, so the ledger (unique on request id and phase) bills a retried request once."""
    if idempotency_key:
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LENGTH or not idempotency_key.isprintable():
            raise _invalid(f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable characters")
        digest = hashlib.blake2b(f"{organization_id}\0{idempotency_key}".encode(), digest_size=16).hexdigest()
        return f"idem_{digest}"
    if not client_id:
        return f"req_{uuid.uuid4().hex}"
    if not _REQUEST_ID.fullmatch(client_id):
        raise _invalid("request_id must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-'")
    return client_id


def _prompt_token_ids(request: inference_pb2.GenerateRequest, tokenizer) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise _invalid("set one of prompt, prompt_token_ids or chat")
    if kind == "prompt":
        if not request.prompt:
            raise _invalid("prompt must not be empty")
        return encode_prompt(tokenizer, request.prompt)
    if kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        if not ids:
            raise _invalid("prompt_token_ids must not be empty")
        vocab_size = len(tokenizer)
        out_of_range = [i for i in ids if i >= vocab_size]
        if out_of_range:
            raise _invalid(f"prompt_token_ids holds {out_of_range[0]}, outside the vocabulary of size {vocab_size}")
        return ids
    return _chat_token_ids(request.chat.messages, tokenizer)


def _chat_token_ids(messages, tokenizer) -> list[int]:
    if not messages:
        raise _invalid("chat.messages must hold at least one message")
    if not tokenizer.chat_template:
        raise _invalid("this model has no chat template; send a completion prompt instead")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise _invalid(f"chat.messages[{index}].role is '{message.role}'; use one of {', '.join(CHAT_ROLES)}")
    return encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in messages])


def _sampling(request: inference_pb2.GenerateRequest, model: ModelInfo, prompt_length: int) -> worker_pb2.SamplingParams:
    room = model.context_length - prompt_length
    if request.HasField("max_tokens"):
        if request.max_tokens < 1:
            raise _invalid(f"max_tokens must be at least 1, got {request.max_tokens}")
        if request.max_tokens > room:
            raise _invalid(
                f"max_tokens is {request.max_tokens} but {model.name}'s context length of {model.context_length} "
                f"leaves room for at most {room} tokens after the {prompt_length}-token prompt; lower max_tokens"
            )
        max_tokens = request.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = request.temperature if request.HasField("temperature") else 1.0
    if not 0.0 <= temperature <= 2.0:
        raise _invalid(f"temperature must be between 0 and 2, got {temperature:g}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise _invalid(f"top_p must be greater than 0 and at most 1, got {top_p:g}")
    return worker_pb2.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=request.top_k,
        has_seed=request.HasField("seed"),
        seed=request.seed,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
    )


def _stop_strings(stop) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid(f"stop holds {len(stop)} strings; send at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise _invalid(f"each stop string must be 1 to {MAX_STOP_LENGTH} characters long")
    return list(stop)


def _invalid(message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> GatewayError:
    return GatewayError(code, message)
