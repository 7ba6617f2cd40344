from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from sdk_scripted_server import ScriptedInference, Server

from diptych_proto.v1 import inference_pb2_grpc as pb_grpc


@pytest.fixture
def server() -> Iterator[Server]:
    servicer = ScriptedInference()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_InferenceServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield Server(servicer, f"grpc://127.0.0.1:{port}")
    grpc_server.stop(grace=None)


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIPTYCH_API_KEY", raising=False)
    monkeypatch.delenv("DIPTYCH_BASE_URL", raising=False)
    monkeypatch.delenv("DIPTYCH_ADMIN_URL", raising=False)
