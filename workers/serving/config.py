"""A worker process's whole configuration, in one place: what `diptych worker` reads from its options and
`workers.main.serve` runs."""

from dataclasses import dataclass, field
from pathlib import Path

from diptych_common.artifacts import DEFAULT_CACHE
from workers.engine.core import EngineConfig
from workers.kv_connector.timeouts import KvTimeouts
from workers.serving.server import Role


@dataclass(frozen=True)
class WorkerConfig:
    """`model_source`: builtin:<name> or a local directory; empty: the fleet's model as the catalog has it
    (its files fetched into `artifact_cache` when it is published as artifacts); `model` empty: the fleet's.
    `kv_tier`: HOST:PORT of the shared KV tier's store (workers.kv_tier.server); empty: none.
    `tensor_parallel`: split the model over this many ranks (this process and tensor_parallel - 1 followers
    it starts, on devices cuda:n.. under --device cuda:n). `kv_nixl`: whether KV hand-offs may go over NIXL
    (workers.kv_connector.nixl.nixl_staging); `kv_shm`: whether a prefill worker hands KV to a decode
    worker on its host through shared memory. `host_id`: which host that is
    (workers.kv_connector.host_identity; empty: DIPTYCH_HOST_ID, else this machine and network namespace)."""

    role: Role
    control_plane_url: str
    fleet_token: str
    name: str
    model: str = ""
    model_source: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    threads: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_port: int = 0  # decode workers: the KV data port (0: a free one)
    kv_timeouts: KvTimeouts = field(default_factory=KvTimeouts)
    metrics_port: int = 0  # 0: no metrics server
    kv_tier: str = ""
    tensor_parallel: int = 1
    artifact_cache: Path = DEFAULT_CACHE
    kv_nixl: str = "auto"
    kv_shm: bool = True
    host_id: str = ""

    @property
    def cuda(self) -> bool:
        return self.engine.device.startswith("cuda")
