"""Progress lines of a long benchmark run on stderr, each with the seconds since the program started."""

import sys
import time

_started = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _started:7.1f} s] {message}", file=sys.stderr, flush=True)
