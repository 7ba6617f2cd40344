"""Which network interface holds an address: UCX, under NIXL, opens a listener on every interface it may
use and names them all in the agent's metadata, so a worker told to serve on one address limits UCX to
the interface that holds it (`UCX_NET_DEVICES`).

The interfaces and their addresses come from the C library's `getifaddrs`, which sees every address of
every interface (secondary IPv4 addresses and IPv6 included), as `ip address` does.
"""

import ctypes
import ctypes.util
import ipaddress
import socket

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
LOOPBACK = "127.0.0.1"


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("address", ctypes.c_ubyte * 4)]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("flowinfo", ctypes.c_uint32),
        ("address", ctypes.c_ubyte * 16),
        ("scope_id", ctypes.c_uint32),
    ]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("address", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("broadcast_or_destination", ctypes.POINTER(_Sockaddr)),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, IpAddress]]:
    """Every (interface name, address) of this network namespace, IPv4 and IPv6."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: list[tuple[str, IpAddress]] = []
    try:
        entry = head
        while entry:
            found += _address_of(entry.contents)
            entry = entry.contents.next
    finally:
        libc.freeifaddrs(head)
    return found


def _address_of(entry: _Ifaddrs) -> list[tuple[str, IpAddress]]:
    if not entry.address or not entry.name:
        return []
    family = entry.address.contents.family
    if family == socket.AF_INET:
        raw = bytes(ctypes.cast(entry.address, ctypes.POINTER(_SockaddrIn)).contents.address)
        return [(entry.name.decode(), ipaddress.IPv4Address(raw))]
    if family == socket.AF_INET6:
        raw = bytes(ctypes.cast(entry.address, ctypes.POINTER(_SockaddrIn6)).contents.address)
        return [(entry.name.decode(), ipaddress.IPv6Address(raw))]
    return []


def interface_of(host: str) -> str | None:
    """The interface holding `host` (an address or a name that resolves to one); None where `host` means
    every interface (empty, 0.0.0.0, ::). Raises ValueError when no interface here holds it."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return None
    wanted = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host.strip("[]"), None)}
    for name, address in interface_addresses():
        if address in wanted:
            return name
    raise ValueError(f"no network interface of this host holds {host} ({', '.join(map(str, sorted(wanted, key=str)))})")
