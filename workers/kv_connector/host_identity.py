"""Which host a worker runs on, as the KV data path sees it: shared memory is for a prefill and a decode
worker of one host only, and reachability does not tell that. Two network namespaces of one machine (two
containers, two pods) may see the same /dev/shm and the same files, yet an operator means them as hosts
of their own, whose KV goes over the network.

A worker's host id is what the operator sets (`--host-id`, `DIPTYCH_HOST_ID`, or `host_id` of
`workers.serving.config.WorkerConfig`); by default a hash of the machine id and the inode of the worker's
network namespace, which two namespaces never share. Workers of one machine that should hand KV over
through shared memory across namespaces are given one host id.
"""

import hashlib
import os
import socket

HOST_ID_ENV = "DIPTYCH_HOST_ID"
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
NETWORK_NAMESPACE = "/proc/self/ns/net"


def host_id(configured: str = "") -> str:
    """`configured`, else DIPTYCH_HOST_ID, else `default_host_id()`."""
    return configured or os.environ.get(HOST_ID_ENV, "") or default_host_id()


def default_host_id() -> str:
    """16 hex digits of sha256(machine id, network namespace inode)."""
    try:
        namespace = os.stat(NETWORK_NAMESPACE).st_ino
    except OSError:
        namespace = 0  # no /proc: one namespace is all this process can tell
    seed = f"{machine_id()}:{namespace}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def machine_id() -> str:
    """The machine id systemd and D-Bus keep (the host name where neither file exists)."""
    for path in MACHINE_ID_FILES:
        try:
            with open(path) as file:
                if found := file.read().strip():
                    return found
        except OSError:
            continue
    return socket.gethostname()
