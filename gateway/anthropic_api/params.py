"""Which body keys and headers the Messages API takes: every key is honoured or refused with a 400 naming it,
never ignored. Here: the keys each endpoint knows, the refusals of Anthropic features this platform does not
serve (extended thinking, containers, MCP servers, priority capacity, ...), and the anthropic-version and
anthropic-beta headers. The honoured keys are read and checked in `requests.py` and `conversation.py`."""

from typing import Any

from aiohttp import web

SERVED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "service_tier",
        "cache_control",
    }
)
# Anthropic's, accepted at their "off" values only (below).
UNSERVED = frozenset(
    {
        "thinking",
        "container",
        "mcp_servers",
        "context_management",
        "diagnostics",
        "inference_geo",
        "output_config",
        "speed",
    }
)
MESSAGES = SERVED | UNSERVED
COUNT_TOKENS = frozenset({"model", "messages", "system", "tools", "tool_choice", "cache_control"}) | UNSERVED
# The versions whose request and answer shapes these are: the one every Anthropic client sent until 2026, and
# the one anthropic 2.15 sends. A request without the header gets them too.
ANTHROPIC_VERSIONS = ("2023-06-01", "2026-10-21")
SERVICE_TIERS = ("auto", "standard_only")  # what every request gets here: standard capacity

_OFF: dict[str, tuple[object, ...]] = {  # each unserved key's values that ask for nothing
    "thinking": (None, {"type": "disabled"}),
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "diagnostics": (None,),
    "inference_geo": (None,),
    "output_config": (None, {}),
    "speed": (None, "standard"),
}
_ADVICE = {
    "thinking": 'no model here thinks before answering; remove thinking or send {"type": "disabled"}',
    "container": "containers (code execution) are not served; remove container",
    "mcp_servers": "MCP servers are not served; remove mcp_servers and send the tools as client tools",
    "context_management": "context management (editing the conversation on the server) is not served; remove it",
    "diagnostics": "diagnostics are not served; remove diagnostics",
    "inference_geo": "inference_geo is not served (the gateway's own region serves the request); remove it",
    "output_config": "output_config (effort, output formats) is not served; remove it",
    "speed": 'speed "fast" is not served; remove speed or send "standard"',
}
_UNSERVED_HEADERS = {
    "anthropic-beta": "beta features are not served; remove the anthropic-beta header",
    "anthropic-workspace-id": "workspaces are not served: the API key names the organization; remove workspace_id",
    "anthropic-user-profile-id": "user profiles are not served; remove user_profile_id, and label the request with "
    "metadata.user_id",
}


class BadRequest(Exception):
    """A body or header this API refuses, with what to change: a 400 `invalid_request_error` (413 for a body
    over the size limit)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def check_headers(request: web.Request) -> None:
    version = request.headers.get("anthropic-version")
    if version is not None and version not in ANTHROPIC_VERSIONS:
        raise BadRequest(
            f"anthropic-version {shown(version)} is not served; send one of {', '.join(ANTHROPIC_VERSIONS)}"
        )
    for name, advice in _UNSERVED_HEADERS.items():
        if request.headers.get(name, "").strip():
            raise BadRequest(f"{name} {shown(request.headers[name])}: {advice}")


def check_keys(body: dict[str, Any], known: frozenset[str], endpoint: str) -> None:
    """Refuses a key `known` lacks, an unserved key set to anything but its off value, and a service tier
    other than standard capacity."""
    for key in body:
        if key not in known:
            raise BadRequest(f"{shown(key)} is not a parameter of {endpoint}; remove it")
    for key in UNSERVED & body.keys():
        if not any(_same(body[key], off) for off in _OFF[key]):
            raise BadRequest(f"{key}: {_ADVICE[key]}")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise BadRequest(
            f"service_tier must be one of {', '.join(SERVICE_TIERS)}: requests here run on standard capacity"
        )


def shown(value: object) -> str:
    """A client's value, short enough to quote in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same(value: object, off: object) -> bool:
    return type(value) is type(off) and value == off
