"""The rate-limit state a client is told on every response after authentication, as OpenAI names it:

    x-ratelimit-limit-requests      x-ratelimit-limit-tokens
    x-ratelimit-remaining-requests  x-ratelimit-remaining-tokens
    x-ratelimit-reset-requests      x-ratelimit-reset-tokens

HTTP headers and gRPC metadata alike (lowercase names, text values). A caller can have up to three request
buckets (its organization's, its project's and its API key's) and up to six token buckets (input and output
tokens of each): each pair of headers reports the most constraining bucket of its family, the one with the fewest
units left (on a tie, the smaller limit), with that bucket's limit and the time until it is full again
("1s", "120ms", "6m0s"). Remaining values are right after this request's own take, its max_tokens
reserved as output tokens (the unused part is given back when it ends), and never below 0: a bucket that a
request overdrew (more output than its estimate, taken when it ended) says 0 until it has refilled. A family
with no limit at all is left out, and so are its three headers.
"""

from gateway.accounts.limits import BucketState

Metadata = tuple[tuple[str, str], ...]

_FAMILIES = (("requests", ("requests",)), ("tokens", ("input tokens", "output tokens")))


def rate_limit_metadata(states: list[BucketState]) -> Metadata:
    metadata: list[tuple[str, str]] = []
    for family, kinds in _FAMILIES:
        candidates = [state for state in states if state.kind in kinds]
        if not candidates:
            continue
        tightest = min(candidates, key=lambda state: (state.remaining, state.capacity))
        metadata += [
            (f"x-ratelimit-limit-{family}", str(tightest.capacity)),
            (f"x-ratelimit-remaining-{family}", str(max(0, tightest.remaining))),
            (f"x-ratelimit-reset-{family}", duration_text(tightest.reset_ms)),
        ]
    return tuple(metadata)


def duration_text(milliseconds: int) -> str:
    """Hours, minutes and seconds (up to three decimals): "0s", "120ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    if milliseconds <= 0:
        return "0s"
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    return f"{minutes}m{seconds}" if minutes else seconds
