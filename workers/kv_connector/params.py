"""A request's part in a KV hand-off between workers, as its call asked for it: plain data that the engine's
requests carry and the connectors read."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """A decode worker's KV data port as a prefill worker reaches it."""

    host: str
    port: int
    same_host: bool  # its /dev/shm is ours: chunks go through shared memory
    nixl: bool = False  # it takes chunks written by NIXL (where both sides run an agent)


@dataclass(frozen=True)
class KvTransferParams:
    """A request's part in a KV hand-off between workers, as its call asked for it."""

    send_to: Peer | None = None  # stream the request's KV to this decode worker as it is computed
    transfer_token: bytes = b""  # ... with the one-time token that decode worker checks
    load_tokens: int = 0  # the KV of the first load_tokens tokens arrived from a prefill worker: load it
    traceparent: str = ""  # the trace context the KV hello carries to the decode worker (empty: untraced)
