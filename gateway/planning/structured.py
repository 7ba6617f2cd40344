"""Structured outputs and tools at the door: checks response_format, tools, tool_choice and
parallel_tool_calls, and turns them into the grammar the workers make the output follow
(`diptych_common.grammar`) and the tools whose calls are read back out of it (`tools.py`). Every schema is
compiled here, against the model's tokenizer, and started as a worker starts it, so a bad one is the
client's 400, never a worker's failure after prefill."""

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from diptych_common.grammar import JSON_OBJECT, JSON_SCHEMA, Grammar, llguidance_grammar, llguidance_tokenizer
from gateway.planning.json_body import TooDeep, loads_nested
from gateway.planning.tokenization import run_off_loop, tokenizer_for
from gateway.planning.tools import tool_grammar
from gateway.types import ErrorKind, GatewayError, GenerationRequest, ResponseFormat, Tool, ToolChoice

MAX_TOOLS = 128  # validation.check_counts refuses more
MAX_SCHEMA_BYTES = 64 << 10  # a schema compiles in time proportional to its size
MAX_SCHEMA_DEPTH = 64  # how deep a schema's JSON may nest
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("auto", "none", "required", "function")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FORCED_STRETCHES = 8  # how far a grammar is started at the door: its forced tokens, up to its first choices
_LIMITS = LLParserLimits(verbose_errors=False)  # llguidance's errors without its parser's state


@dataclass(frozen=True)
class Structure:
    grammar: Grammar | None = None  # None: free text
    tools: tuple[Tool, ...] = ()  # the tools whose calls the output may hold
    tool_named: bool = False  # tool_choice named the one function to call


async def plan_structure(request: GenerationRequest, model_source: str, tenant: str) -> Structure:
    """The request's grammar and tools, its schemas read and compiled against the model's tokenizer off the
    event loop, on the tenant's share of its threads (128 tools of 64 KB are 8 MB of JSON). Raises
    GatewayError (INVALID_ARGUMENT) naming the parameter at fault."""
    if not request.tools and request.response_format is None:
        return _structure(request)  # nothing to read: free text
    return await run_off_loop(_checked_structure, request, model_source, tenant=tenant)


def _checked_structure(request: GenerationRequest, model_source: str) -> Structure:
    structure = _structure(request)
    if structure.grammar is not None:
        _check_schemas(request, structure, model_source)
    return structure


@lru_cache(maxsize=32)
def grammar_tokenizer(model_source: str) -> LLTokenizer:
    tokenizer = tokenizer_for(model_source)
    return llguidance_tokenizer(tokenizer, len(tokenizer), frozenset())


def _structure(request: GenerationRequest) -> Structure:
    text = _text_schema(request.response_format)
    tools = _tools(request)
    choice = request.tool_choice or ToolChoice()
    if not tools or choice.mode == "none":
        return Structure(_json_grammar(request.response_format), ())
    parallel = request.parallel_tool_calls is not False
    called = tuple(t for t in tools if choice.mode != "function" or t.name == choice.function)
    named = choice.mode == "function"
    return Structure(tool_grammar(called, choice.mode != "auto", parallel, text), tools, named)


def _text_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The schema the answer follows when it is not a tool call (None: any text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type not in RESPONSE_FORMATS:
        raise _invalid(
            f"response_format.type is '{response_format.type[:40]}'; use one of {', '.join(RESPONSE_FORMATS)}"
        )
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.name and not _NAME.fullmatch(response_format.name):
        raise _invalid("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
    return _schema(response_format.schema, "response_format.json_schema.schema")


def _json_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar(JSON_OBJECT)
    return Grammar(JSON_SCHEMA, response_format.schema)


def _schema(text: str, where: str) -> dict[str, Any]:
    if not text:
        raise _invalid(f"{where} is required: a JSON schema object")
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise _invalid(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes of JSON; send a smaller schema")
    try:
        schema = loads_nested(text, MAX_SCHEMA_DEPTH)
    except TooDeep:
        raise _invalid(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON; send a flatter schema") from None
    except ValueError as error:
        raise _invalid(f"{where} is not valid JSON ({error}); send a JSON schema object") from None
    if not isinstance(schema, dict):
        raise _invalid(f"{where} must be a JSON schema object, not {type(schema).__name__}")
    return schema


def _tools(request: GenerationRequest) -> tuple[Tool, ...]:
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice is not None:
            raise _invalid("tool_choice is set but tools is empty; send tools, or remove tool_choice")
        if request.parallel_tool_calls is not None:
            raise _invalid("parallel_tool_calls is set but tools is empty; send tools, or remove parallel_tool_calls")
        return ()
    if request.chat is None:
        raise _invalid("tools need a chat (messages): the chat template shows the model its tools")
    names = _tool_names(tools)
    if choice is not None:
        if choice.mode not in TOOL_CHOICES:
            raise _invalid(f"tool_choice is '{choice.mode[:40]}'; use auto, none, required or a function")
        if choice.mode == "function" and choice.function not in names:
            raise _invalid(
                f"tool_choice names the function '{choice.function[:64]}', which is not in tools; "
                f"name one of {', '.join(sorted(names))}"
            )
    return tools


def _tool_names(tools: tuple[Tool, ...]) -> set[str]:
    """The tools' names, each checked to be well formed and given once, and each tool's parameters schema."""
    names: set[str] = set()
    for index, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise _invalid(f"tools[{index}].function.name must be 1 to 64 letters, digits, '_' or '-'")
        if tool.name in names:
            raise _invalid(f"tools[{index}].function.name '{tool.name}' is given twice; name each tool once")
        names.add(tool.name)
        if tool.parameters:
            _schema(tool.parameters, f"tools[{index}].function.parameters")
    return names


@lru_cache(maxsize=256)
def grammar_problem(grammar: Grammar, model_source: str) -> str | None:
    """Why a worker could not follow `grammar` for the model's tokenizer, or None; remembered, so that the
    schema a client sends with every request is checked once per gateway rather than on each.

    It is compiled as a worker compiles it (LLMatcher lets go of the GIL while it compiles, where
    LLMatcher.validate_grammar held it for a third of a second on 8 tools of 60 KB), then started: the first
    token's mask, and each stretch of tokens the grammar forces, up to its first choices. A schema that
    admits no value (`{"$ref": "#"}`) or whose parse blows up fails there, where it failed on a worker after
    prefill."""
    try:
        compiled = llguidance_grammar(grammar)
    except ValueError as error:
        return f"it is not valid JSON: {error}"
    matcher = LLMatcher(grammar_tokenizer(model_source), compiled, log_level=0, limits=_LIMITS)
    for _ in range(FORCED_STRETCHES):
        if matcher.is_error():
            break
        matcher.compute_bitmask()
        forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
        if not forced:
            break
        matcher.consume_tokens(forced)
    return _described(matcher.get_error()) if matcher.is_error() else None


def _described(error: str) -> str:
    """llguidance's error, without the state it may append; an empty choice said in words."""
    error = error.split("\n<", 1)[0].strip()
    if error == "NoExtensionBias":
        return 'no JSON value satisfies it (a schema that only refers to itself, such as {"$ref": "#"}, admits none)'
    return error


def _check_schemas(request: GenerationRequest, structure: Structure, model_source: str) -> None:
    """Compiles the response format's schema and every tool's parameters: the first that fails is refused."""
    checks: list[tuple[str, Grammar]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_schema":
        checks.append(("response_format.json_schema.schema", Grammar(JSON_SCHEMA, response_format.schema)))
    for index, tool in enumerate(request.tools):
        if tool.parameters:
            checks.append((f"tools[{index}].function.parameters", Grammar(JSON_SCHEMA, tool.parameters)))
    for where, grammar in checks:
        error = grammar_problem(grammar, model_source)
        if error is not None:
            raise _invalid(f"{where} is not a schema this platform can follow: {error[:300]}; fix the schema")
    if request.tools and structure.grammar is not None:  # each tool's schema is now part of the list of calls
        error = grammar_problem(structure.grammar, model_source)
        if error is not None:
            raise _invalid(
                f"tools: the tools' parameters do not combine into one grammar ({error[:300]}); make each "
                "parameters schema self-contained (no $ref outside it)"
            )


def _invalid(message: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_ARGUMENT, message)
