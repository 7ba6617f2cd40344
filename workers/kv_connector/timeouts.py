"""The KV hand-off's clocks, in one place, each in the order it must keep with the others (checked when
they are made): a wait that covers another must outlast it, or the inner one's clear error never shows."""

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KvTimeouts:
    endpoint_s: float = 5.0  # a prefill worker's wait for the decode worker's GetKvEndpoint answer
    io_s: float = 5.0  # either side: a transfer that makes no progress this long fails
    hello_s: float = 5.0  # the receiver: a peer's whole hello must arrive within it
    arrival_s: float = 5.0  # the receiver: a transfer that came before its decode request waits for it this long
    hello_answer_s: float = 10.0  # the sender: the wait for the hello's answer, which waits for the arrival
    kv_wait_s: float = 30.0  # the decode call: the wait for its KV, which covers the sender's hello and answer

    def __post_init__(self) -> None:
        for clock in fields(self):
            if not getattr(self, clock.name) > 0:
                raise ValueError(f"KV timeouts: {clock.name} must be above 0, not {getattr(self, clock.name)}")
        if not self.hello_answer_s > self.arrival_s:
            raise ValueError(
                f"KV timeouts: the sender's wait for the hello's answer ({self.hello_answer_s} s) must outlast the "
                f"receiver's wait for the decode request ({self.arrival_s} s), or the sender gives up first"
            )
        if not self.kv_wait_s > self.hello_answer_s:
            raise ValueError(
                f"KV timeouts: the decode call's wait for its KV ({self.kv_wait_s} s) must outlast the sender's "
                f"wait for the hello's answer ({self.hello_answer_s} s)"
            )


DEFAULT_KV_TIMEOUTS = KvTimeouts()
