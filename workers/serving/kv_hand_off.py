"""The KV connectors a worker's engine gets: its role's hand-off connector (a prefill worker's sender, a
decode worker's data port, as `HAND_OFF_OF_ROLE` names them), and the shared KV tier's where it has one."""

from concurrent.futures import ThreadPoolExecutor

from diptych_common.worker_credential import WorkerSecret
from workers.engine.connector import KvConnector
from workers.engine.core import Engine
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.multi import composed
from workers.kv_connector.nixl import nixl_staging
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.tier import TierConnector
from workers.kv_tier.blocks import tier_namespace
from workers.kv_tier.client import TierClient
from workers.serving.config import WorkerConfig
from workers.serving.server import HAND_OFF_OF_ROLE


def build_connector(
    config: WorkerConfig, model: str, engine: Engine, secret: WorkerSecret, executor: ThreadPoolExecutor
) -> tuple[KvConnector, KvReceiver | None]:
    """The engine's connector (the null connector when it moves no KV) and, on a decode worker, its data
    port, started. `model`: the model the worker serves, which names its blocks in the tier."""
    layout = engine.runner.layout
    connectors: list[KvConnector] = []
    receiver = None
    hand_off = HAND_OFF_OF_ROLE[config.role]
    if hand_off is DecodeConnector:
        receiver = KvReceiver(
            KvInbox(config.kv_timeouts),
            layout,
            host=config.host,
            port=config.kv_port,
            timeouts=config.kv_timeouts,
            staging=StagingPool(pin=config.cuda),
            max_tokens=engine.kv.num_blocks * engine.kv.block_size,
            nixl=nixl_staging(config.kv_nixl, "decode", config.host, pin=config.cuda),
            host_id=config.host_id,
        )
        receiver.start()
        connectors.append(DecodeConnector(receiver))
    if hand_off is PrefillConnector:
        nixl = nixl_staging(config.kv_nixl, "prefill", config.host, config.cuda)
        sender = KvSender(
            layout, config.kv_timeouts, allow_shm=config.kv_shm, pin=config.cuda, nixl=nixl, host_id=config.host_id
        )
        connectors.append(PrefillConnector(sender))
    if config.kv_tier:
        client = TierClient(config.kv_tier, tier_namespace(model, layout), layout.block_nbytes, secret)
        connectors.append(TierConnector(client, engine.kv, engine.runner, executor))
    return composed(connectors), receiver
