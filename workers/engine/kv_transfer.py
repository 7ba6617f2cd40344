"""The KV hand-off's plain data: a request's part in it, as its call asked for it (carried by the engine's
requests, read by the connectors), and one step's loads and saves, which the scheduler's output carries."""

from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class KvLoad:
    """Write the KV the connector holds for a request into its blocks, before the step computes on them."""

    request_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class KvSave:
    """Blocks computed by the end of this step that leave now: the request's blocks first_block.."""

    request_id: str
    block_ids: list[int]
    first_block: int


@dataclass(frozen=True)
class KvConnectorMeta:
    """One step's KV hand-off, decided on the scheduler side, carried out on the worker side."""

    loads: list[KvLoad] = field(default_factory=list)
    saves: list[KvSave] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)  # requests whose blocks were freed since the last step

    def loads_kv(self) -> bool:
        """Whether the step writes KV from outside into the pool (a composed meta: any part's)."""
        return bool(self.loads)


# The meta of every step that moves no KV: one shared instance, which nothing mutates.
EMPTY_META = KvConnectorMeta()
