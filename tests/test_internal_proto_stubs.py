"""The internal contract's stubs (diptych_common/proto/v1: the worker's and the KV tier's gRPC APIs) are what
`make proto` generates from proto/diptych/internal/v1, byte for byte."""

from tests.proto_stubs import REPO, stubs_against_committed

PROTOS = ("worker", "kv_tier")


def test_the_internal_stubs_are_generated_from_their_protos(tmp_path):
    stubs = stubs_against_committed(
        tmp_path,
        "diptych_common/proto=proto/diptych/internal",
        [f"proto/diptych/internal/v1/{name}.proto" for name in PROTOS],
        REPO,
    )
    expected = [f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    assert stubs == {f"diptych_common/proto/v1/{name}": True for name in expected}, "stale stubs: run make proto"
