"""`cache_control` breakpoints onto the prefix cache, in Anthropic's usage figures.

The prefix cache here needs no breakpoint: every prompt's full blocks are kept and shared within the
organization, and the platform reports how many prompt tokens it read from them (the chat API's
`cached_tokens`). A breakpoint only says how much of the prompt the client means to cache: the tokens the
whole prompt shares with the conversation cut after the last marked block (its tools, system and turns up to
that block, rendered by the same chat template). Of the prompt, then:

    cache_read_input_tokens      the cached tokens the platform reports
    cache_creation_input_tokens  the rest of the prompt up to the last breakpoint
    input_tokens                 the rest (Anthropic's input_tokens exclude both cache figures)

They add up to the prompt tokens billed; the ledger bills them as it bills a chat completion's (the cached
tokens at the cached price, every other prompt token at the input price): no figure here changes a bill.
"""

from gateway.fleet.registry import Registry
from gateway.planning.validation import plan_generation
from gateway.types import GenerationPlan, GenerationRequest, Usage


async def marked_tokens(prefix: GenerationRequest | None, plan: GenerationPlan, registry: Registry) -> int:
    """How many of the plan's prompt tokens lie up to the last cache breakpoint (`prefix`: the request cut
    there, `requests.MessagesRequest.cache_prefix`); tokenized off the event loop, on the tenant's threads."""
    if prefix is None:
        return 0
    cut = await plan_generation(prefix, registry, plan.organization_id)
    return shared_prefix_length(plan.prompt_token_ids, cut.prompt_token_ids)


def shared_prefix_length(first: list[int], second: list[int]) -> int:
    shared = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def usage_json(usage: Usage, marked: int) -> dict[str, int]:
    """Anthropic's usage of a request whose prompt has `marked` tokens up to its last breakpoint."""
    read = usage.cached_tokens
    creation = max(0, min(marked, usage.prompt_tokens) - read)
    return {
        "input_tokens": usage.prompt_tokens - read - creation,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
    }
