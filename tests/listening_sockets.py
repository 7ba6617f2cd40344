"""The TCP sockets a process listens on, read from /proc: its socket inodes (/proc/PID/fd) matched against
the listening entries of its network namespace (/proc/PID/net/tcp and tcp6)."""

import ipaddress
import os
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN state, in /proc/net/tcp's hexadecimal


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((str(_address(address)), int(port, 16)))
    return found


def non_loopback_addresses_exist() -> bool:
    """Whether this host has an address beyond loopback, where a listener on it would show."""
    from workers.kv_connector.interfaces import interface_addresses

    return any(not address.is_loopback and not address.is_link_local for _, address in interface_addresses())


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hexadecimal: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp writes each 32-bit word of an address in host (little-endian) byte order; an IPv4
    address mapped into IPv6 (a dual-stack socket bound to one) reads as the IPv4 address."""
    raw = bytes.fromhex(hexadecimal)
    address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address
