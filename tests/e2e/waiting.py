"""Waiting on the live platform without sleeping for a fixed time."""

import time


def wait_for(condition, seconds: float = 15.0, interval: float = 0.1):
    """Polls `condition` until it returns something truthy or `seconds` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
