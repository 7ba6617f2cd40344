"""A conversation continued through the Responses API (`previous_response_id`: the stored conversation's token
ids, extended) against the same conversation resent whole through Chat Completions (its text rendered and
tokenized again), side by side in one run: the share of each prompt the prefix cache held, and the time to
the first token.

    .venv/bin/python -m bench.responses_continuation [--mode colocated|split|both] [--conversations 20]
        [--turns 8] [--reply-tokens 24] [--user-words 12]

The platform runs on this machine (`bench/live_platform.py`: the control plane, the mode's workers of the
built-in tiny model and its gateway, real processes). Each conversation's user turns are random words; the
Responses client sends each turn with the previous response's id, the Chat Completions client resends every
earlier message (its own replies as the text it received) with the new one. The two clients are two
organizations, so neither finds the other's blocks (prefix caches are salted per organization); their turns
alternate, one request at a time, greedy, each streamed. Turn 1 of each conversation is counted apart: neither
client has anything cached then. TTFT is measured at the client, from sending the request to its first text.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.live_platform import MODES, start_platform
from diptych_server.stack import REPO_ROOT

MODEL = "diptych-tiny"
WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "worker",
    "gateway",
    "prompt",
    "decode",
    "prefill",
    "turn",
    "reply",
    "question",
    "answer",
    "memory",
    "batch",
    "stream",
    "latency",
    "budget",
    "region",
    "fleet",
    "kernel",
    "tensor",
    "vector",
    "sample",
    "greedy",
    "context",
    "window",
    "history",
    "reuse",
    "store",
    "fetch",
    "route",
    "pin",
    "hash",
    "salt",
    "chain",
    "layer",
    "head",
    "value",
    "key",
    "query",
]


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str
    response_id: str = ""


@dataclass
class Figures:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, turn: Turn) -> None:
        self.ttft_s.append(turn.ttft_s)
        self.prompt_tokens += turn.prompt_tokens
        self.cached_tokens += turn.cached_tokens


def sse_events(response: httpx.Response):
    """The JSON of each `data:` line of a server-sent event stream; an error answer raises with its body."""
    if response.is_error:
        raise RuntimeError(f"{response.request.url.path} answered {response.status_code}: {response.read()[:500]!r}")
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            yield json.loads(line[5:])


def responses_turn(http: httpx.Client, text: str, previous_id: str | None, reply_tokens: int) -> Turn:
    body = {"model": MODEL, "input": text, "max_output_tokens": reply_tokens, "temperature": 0, "stream": True}
    if previous_id:
        body["previous_response_id"] = previous_id
    started, first = time.perf_counter(), None
    with http.stream("POST", "/responses", json=body) as response:
        for event in sse_events(response):
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter()
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    usage = final["usage"]
    text_out = "".join(part["text"] for item in final["output"] for part in item.get("content", []))
    return Turn(
        (first or time.perf_counter()) - started,
        usage["input_tokens"],
        usage["input_tokens_details"]["cached_tokens"],
        text_out,
        final["id"],
    )


def chat_turn(http: httpx.Client, messages: list[dict], reply_tokens: int) -> Turn:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": reply_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, parts = time.perf_counter(), None, []
    usage: dict = {}
    with http.stream("POST", "/chat/completions", json=body) as response:
        for chunk in sse_events(response):
            for choice in chunk.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    first = first or time.perf_counter()
                    parts.append(content)
            usage = chunk.get("usage") or usage
    return Turn(
        (first or time.perf_counter()) - started,
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        "".join(parts),
    )


def user_turns(rng: random.Random, turns: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "?" for _ in range(turns)]


def run_mode(platform, mode: str, args, other_key: str) -> dict[str, Figures]:
    figures = {name: Figures() for name in ("responses first", "responses continued", "chat first", "chat resent")}
    with platform.serving(mode):
        url = platform.http_urls[mode]
        responses_http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=120
        )
        chat_http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {other_key}"}, timeout=120)
        with responses_http, chat_http:
            warm = user_turns(random.Random(999), 2, args.user_words)  # each path, a turn and its next, uncounted
            first = responses_turn(responses_http, warm[0], None, args.reply_tokens)
            responses_turn(responses_http, warm[1], first.response_id, args.reply_tokens)
            messages = [{"role": "user", "content": warm[0]}]
            messages.append({"role": "assistant", "content": chat_turn(chat_http, messages, args.reply_tokens).text})
            chat_turn(chat_http, [*messages, {"role": "user", "content": warm[1]}], args.reply_tokens)
            for index in range(args.conversations):
                texts = user_turns(random.Random(index), args.turns, args.user_words)
                previous, messages = None, []
                for number, text in enumerate(texts):
                    order = ("responses", "chat") if (index + number) % 2 == 0 else ("chat", "responses")
                    for client in order:
                        if client == "responses":
                            turn = responses_turn(responses_http, text, previous, args.reply_tokens)
                            previous = turn.response_id
                            figures["responses first" if number == 0 else "responses continued"].add(turn)
                        else:
                            messages.append({"role": "user", "content": text})
                            turn = chat_turn(chat_http, messages, args.reply_tokens)
                            messages.append({"role": "assistant", "content": turn.text})
                            figures["chat first" if number == 0 else "chat resent"].add(turn)
                log(f"{mode}: conversation {index + 1}/{args.conversations} done")
    return figures


def second_organization_key(stack) -> str:
    """An API key of an organization of its own, so that the chat client shares no cache with the other."""
    code = (
        "from controlplane.tenancy.models import Scope\n"
        "from controlplane.tenancy.services import api_key_create, organization_ensure\n"
        "organization = organization_ensure(name='Chat bench', slug='chat-bench')\n"
        "print(api_key_create(organization=organization, name='chat', scopes=Scope.values).key)\n"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=REPO_ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not create the second organization:\n{result.stderr[-2000:]}")
    return result.stdout.strip().splitlines()[-1]


def report(mode: str, figures: dict[str, Figures]) -> None:
    print(f"\n{mode}: {'':<22}{'requests':>9}{'cached share':>14}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'mean ms':>9}")
    for name, each in figures.items():
        ttft = sorted(each.ttft_s)
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
        share = each.cached_tokens / each.prompt_tokens if each.prompt_tokens else 0.0
        print(
            f"{'':<{len(mode) + 2}}{name:<22}{len(ttft):>9}{share:>14.3f}{statistics.median(ttft) * 1000:>13.1f}"
            f"{p90 * 1000:>13.1f}{statistics.mean(ttft) * 1000:>9.1f}"
        )
    continued, resent = figures["responses continued"], figures["chat resent"]
    ratio = statistics.median(continued.ttft_s) / statistics.median(resent.ttft_s)
    computed = (continued.prompt_tokens - continued.cached_tokens, resent.prompt_tokens - resent.cached_tokens)
    indent = " " * (len(mode) + 2)
    print(f"{indent}continued / resent: TTFT p50 x{ratio:.2f}, prompt tokens computed {computed[0]} / {computed[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--user-words", type=int, default=12)
    args = parser.parse_args()
    modes = MODES if args.mode == "both" else (args.mode,)
    with tempfile.TemporaryDirectory(prefix="diptych-responses-bench-") as directory:
        platform = start_platform(Path(directory), MODEL, 1024, 1, 1, log)
        try:
            other_key = second_organization_key(platform.stack)
            results = {mode: run_mode(platform, mode, args, other_key) for mode in modes}
        finally:
            platform.stop()
    requests = 2 * args.conversations * args.turns
    print(
        f"\n{requests} requests per mode ({args.conversations} conversations x {args.turns} turns, each through both "
        f"APIs), replies of {args.reply_tokens} tokens, user turns of {args.user_words} words; {MODEL}"
    )
    for mode, figures in results.items():
        report(mode, figures)


if __name__ == "__main__":
    main()
