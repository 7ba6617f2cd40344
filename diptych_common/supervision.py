"""A process started by `diptych up` stops when `up` dies, however it dies (SIGKILL included).

`up` names itself in the child's environment; the child, first thing, asks Linux to send it SIGTERM when
its parent goes (PR_SET_PDEATHSIG), then checks that its parent is still `up`: if `up` died before the
request was made, the child stops at once. SIGTERM, not SIGKILL, so that each process stops as it does
on any SIGTERM: the gunicorn master takes its workers with it, the Celery worker its beat process.
Elsewhere than on Linux this does nothing; `up` still stops its children on every exit it lives through.
"""

import ctypes
import os
import signal
import sys

SUPERVISOR_PID_ENV = "DIPTYCH_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


def supervisor_env() -> dict[str, str]:
    """What a child of this process needs in its environment to stop when this process dies."""
    return {SUPERVISOR_PID_ENV: str(os.getpid())}


def stop_with_supervisor() -> None:
    """Called first in every `diptych` process: ties it to the `up` that started it, if one did. The variable
    is removed so that the process's own children (which it stops itself) do not inherit it."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, "")
    if not supervisor or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(supervisor):
        sys.exit(f"diptych: the `diptych up` that started this process (pid {supervisor}) is gone")
