"""Which body parameters the OpenAI-compatible endpoints take: every key is honoured or refused with a 400
naming it, never ignored (docs/api-parameters.md is the table). Here: the keys each endpoint knows, and
the refusals of OpenAI parameters this platform does not honour. Parameters that are honoured are read,
checked and refused where bad in `openai_api/requests.py`'s `to_generation_request` and `validation.py`.
"""

from dataclasses import dataclass
from typing import Any

COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "prompt_cache_key",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "user",
        # this platform's own
        "max_completion_tokens",
        "top_k",
        "ignore_eos",
        "priority",
    }
)
CHAT = COMMON | {
    "messages",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "verbosity",
    "safety_identifier",
}
COMPLETIONS = COMMON | {"prompt", "best_of", "echo", "suffix"}
EVERY = CHAT | COMPLETIONS
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
SERVICE_TIERS = ("auto", "default")  # what every request gets here


@dataclass(frozen=True)
class Refusal:
    message: str
    param: str | None


def refusal(body: dict[str, Any], chat: bool) -> Refusal | None:
    """The first parameter of `body` that this platform does not honour, or None."""
    known = CHAT if chat else COMPLETIONS
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key in body:
        if key not in known:
            return Refusal(f"{_quoted(key)} is not a parameter of {endpoint}; remove it", _named(key))
    for check in _CHECKS:
        found = check(body)
        if found is not None:
            return found
    return None


def _unsupported(body: dict[str, Any]) -> Refusal | None:
    """OpenAI parameters with no equivalent here; their default values are accepted."""
    unset: dict[str, tuple[Any, ...]] = {
        "audio": (None,),
        "prediction": (None,),
        "web_search_options": (None,),
        "metadata": (None, {}),
        "reasoning_effort": (None,),
        "verbosity": (None,),
        "suffix": (None, ""),
        "echo": (None, False),
        "store": (None, False),
        "safety_identifier": (None, ""),
        "functions": (None, []),
        "function_call": (None,),
    }
    advice = {
        "audio": "this platform answers in text only; remove audio",
        "prediction": "predicted outputs are not supported; remove prediction",
        "web_search_options": "web search is not supported; remove web_search_options",
        "metadata": "completions are not stored, so metadata has nothing to label; remove it",
        "reasoning_effort": "no model here reasons before answering; remove reasoning_effort",
        "verbosity": "verbosity is not supported; remove it, and use max_tokens to bound the answer",
        "suffix": "suffix (text after the insertion) is not supported; remove it",
        "echo": "echo is not supported; set it to false or remove it, and prepend the prompt yourself",
        "store": "completions are not stored; set store to false or remove it",
        "safety_identifier": "safety_identifier is not kept; send user, which labels the request in usage",
        "functions": "functions is deprecated; send tools instead",
        "function_call": "function_call is deprecated; send tool_choice instead",
    }
    for name, defaults in unset.items():
        if name in body and not any(_same(body[name], default) for default in defaults):
            return Refusal(advice[name], name)
    return None


def _modalities(body: dict[str, Any]) -> Refusal | None:
    value = body.get("modalities")
    if value is None or value == ["text"]:
        return None
    return Refusal('this platform answers in text only; set modalities to ["text"] or remove it', "modalities")


def _service_tier(body: dict[str, Any]) -> Refusal | None:
    value = body.get("service_tier")
    if value is None or value in SERVICE_TIERS:
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return Refusal(
        f"service_tier {shown} is not served here; send one of {', '.join(SERVICE_TIERS)} (every request is "
        'served in the "default" tier), and priority: "batch" to be served after interactive requests',
        "service_tier",
    )


def _best_of(body: dict[str, Any]) -> Refusal | None:
    value = body.get("best_of")
    n = body.get("n")
    if value is None or (_is_int(value) and value == (n if n is not None else 1)):
        return None
    return Refusal(
        "best_of must equal n (ranking extra candidates is not supported); remove best_of and use n", "best_of"
    )


def _stream_options(body: dict[str, Any]) -> Refusal | None:
    options = body.get("stream_options")
    if options is None:
        return None
    if not isinstance(options, dict):
        return Refusal('stream_options must be an object such as {"include_usage": true}', "stream_options")
    unknown = [key for key in options if key not in STREAM_OPTIONS]
    if unknown:
        return Refusal(
            f"stream_options.{unknown[0]} is not supported; only include_usage and continuous_usage_stats are",
            "stream_options",
        )
    if body.get("stream") is not True:
        return Refusal("stream_options is only allowed when stream is true", "stream_options")
    return None


def _max_tokens(body: dict[str, Any]) -> Refusal | None:
    given = [body.get(name) for name in ("max_tokens", "max_completion_tokens")]
    if None not in given and given[0] != given[1]:
        return Refusal(
            "max_tokens and max_completion_tokens differ; send one of them (max_completion_tokens is preferred)",
            "max_completion_tokens",
        )
    return None


_CHECKS = (_unsupported, _modalities, _service_tier, _best_of, _stream_options, _max_tokens)


def _same(value: object, default: object) -> bool:
    return type(value) is type(default) and value == default


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _named(key: str) -> str | None:
    """The unknown key as the error's param, when short and printable (it is the client's own text)."""
    return key if len(key) <= 64 and key.isprintable() else None


def _quoted(key: str) -> str:
    shown = key if len(key) <= 64 else key[:61] + "..."
    return repr(shown)
