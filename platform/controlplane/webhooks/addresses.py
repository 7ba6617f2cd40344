"""Where a webhook may go: an https URL (http where the operator allows it) whose host has public addresses
only, or addresses in the networks the operator allows (DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS). A name is
resolved and every address it has is checked, so that a name with one private address among public ones
is refused; the sender then connects to an address checked here, never resolving the name again."""

import ipaddress
import socket
from dataclasses import dataclass

import httpx
from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# IPv6 addresses that carry an IPv4 one a gateway may forward to: NAT64's well-known prefix.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class UnsafeDestination(Exception):
    """The URL is refused: why, in words the caller can act on."""


class HostUnresolved(UnsafeDestination):
    """The host has no address now: a later try may find one."""


@dataclass(frozen=True)
class Destination:
    """A checked URL: its host, and the addresses that host had when it was checked (in resolver order)."""

    url: httpx.URL
    host: str  # ASCII (an IDN in punycode), no brackets
    addresses: tuple[IPAddress, ...]


def checked_url(url: str) -> httpx.URL:
    """The URL parsed, if its form is one a webhook may have; its addresses are not checked here."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as error:
        raise UnsafeDestination(f"{url!r} is not a URL: {error}.") from None
    schemes = ("https", "http") if settings.DIPTYCH_WEBHOOKS_ALLOW_HTTP else ("https",)
    if parsed.scheme not in schemes:
        raise UnsafeDestination(
            f"The URL must start with {' or '.join(f'{scheme}://' for scheme in schemes)}, not {parsed.scheme!r}."
        )
    if not parsed.host:
        raise UnsafeDestination("The URL names no host.")
    if parsed.userinfo:
        raise UnsafeDestination("The URL must not hold a user name or password: the signature authenticates us.")
    if parsed.fragment:
        raise UnsafeDestination("The URL must not have a #fragment, which is never sent.")
    return parsed


def resolve(url: str) -> Destination:
    """The URL and its host's addresses, every one of them allowed; HostUnresolved when the host has none,
    UnsafeDestination when the URL or one address is refused."""
    parsed = checked_url(url)
    host = parsed.raw_host.decode("ascii")
    addresses = _addresses(host, parsed.port or (443 if parsed.scheme == "https" else 80))
    for address in addresses:
        check_address(address, host)
    return Destination(url=parsed, host=host, addresses=addresses)


def _addresses(host: str, port: int) -> tuple[IPAddress, ...]:
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise HostUnresolved(f"The host {host!r} does not resolve ({error}).") from None
    # An IPv6 address with a zone (fe80::1%eth0) is link-local, which the check refuses whatever the zone.
    unique = dict.fromkeys(ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found)
    if not unique:
        raise HostUnresolved(f"The host {host!r} has no address.")
    return tuple(unique)


def check_address(address: IPAddress, host: str) -> None:
    """Refuses an address that is not public, unless the operator allows its network."""
    if any(address in network for network in _allowed_networks()):
        return
    kind = refused_kind(address)
    if kind:
        shown = host if host == str(address) else f"{host} ({address})"
        raise UnsafeDestination(
            f"{shown} is {kind} address: webhooks go to public addresses only. The operator can allow "
            "others with DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS (or DIPTYCH_WEBHOOKS_ALLOW_PRIVATE=1)."
        )


def refused_kind(address: IPAddress) -> str:
    """What makes `address` not public (with its article: "a loopback"), or "" for a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return refused_kind(embedded)
    checks = [
        (address.is_unspecified, "an unspecified"),
        (address.is_loopback, "a loopback"),
        (address.is_link_local, "a link-local"),
        (address.is_multicast, "a multicast"),
        (address.is_private, "a private"),
        (address.is_reserved, "a reserved"),
        (not address.is_global, "a non-public"),
    ]
    return next((kind for refused, kind in checks if refused), "")


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(network, strict=False) for network in settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS]
