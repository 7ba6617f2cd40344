"""The plain records passed between the workload, the simulator and the search."""

import enum
from dataclasses import dataclass

MAX_WORKERS = 1000  # the largest fleet the planner searches


class Mode(enum.StrEnum):
    SPLIT = "split"  # prefill workers hand the KV cache to decode workers
    COLOCATED = "colocated"  # each worker runs both phases of its requests


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it arrives and how long it is."""

    arrival_s: float  # offset from the start of the run
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int = 0  # leading prompt tokens a worker already holds (a shared prefix)


@dataclass(frozen=True)
class FleetShape:
    """How many workers of each kind. Colocated fleets use `colocated` only; split fleets the other two."""

    mode: Mode
    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated


@dataclass(frozen=True)
class RequestOutcome:
    """What one request saw: time to its first token and the mean time per output token after it."""

    spec: RequestSpec
    ttft_s: float
    tpot_s: float  # 0.0 for a request of one output token


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met_by(self, outcome: RequestOutcome) -> bool:
        return outcome.ttft_s <= self.ttft_s and outcome.tpot_s <= self.tpot_s
