from __future__ import annotations

import json
import subprocess
import sys

import diptych

# grpc/__init__.py itself imports grpc_tools, grpc_health and grpc_reflection when they are installed.
ALLOWED_THIRD_PARTY = {"diptych", "grpc", "google", "typing_extensions", "cython_runtime"} | {
    "grpc_tools",
    "grpc_health",
    "grpc_reflection",
}
FORBIDDEN = {"torch", "django", "transformers", "httpx", "requests", "numpy", "diptych_common", "diptych_server"}


def test_sdk_imports_only_grpc_protobuf_and_the_standard_library():
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import diptych\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    imported = {name.split(".")[0] for name in json.loads(result.stdout)}
    third_party = {
        name
        for name in imported - set(sys.stdlib_module_names) - set(sys.builtin_module_names)
        if not name.startswith("_cython")
    }
    assert not imported & FORBIDDEN
    assert third_party <= ALLOWED_THIRD_PARTY, third_party - ALLOWED_THIRD_PARTY


def test_public_surface():
    assert diptych.__version__ == "0.1.0"
    for name in diptych.__all__:
        assert hasattr(diptych, name), name
    from diptych._proto.v1 import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "diptych.v1"
    assert hasattr(inference_pb2_grpc, "InferenceServicer")
