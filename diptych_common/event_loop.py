"""The event loop the serving processes (gateway, workers) run on: uvloop's.

Every token crosses gRPC streams and the gateway's HTTP answers as a message of its own, so the loop's
cost per callback is paid several times per token; uvloop's is a fraction of asyncio's own loop
(`python -m bench.serving_cost`, docs/benchmarks.md: "Host CPU per output token").
"""

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def serve_forever(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` to its end on a new uvloop event loop, as asyncio.run would."""
    return uvloop.run(main)
