"""Facts about other processes on this machine."""

import os


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts: signalling it is refused, not
    unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
