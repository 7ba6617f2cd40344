"""Which data path a prefill worker would take to a decode worker, asked from two processes that may sit in
different hosts' namespaces: `serve` runs a decode worker's KV receiver and prints its endpoint as one JSON
line (then holds it until stdin closes); `choose ENDPOINT_JSON` prints the path a sender here would take
(one line per `--host-id` given: the path a sender of that host id would take).

    ip netns exec A python -m bench.hosts.path_choice serve --host 10.77.0.2
    ip netns exec B python -m bench.hosts.path_choice choose '{"data_host": ...}'
"""

import argparse
import json
import sys

import torch

from diptych_common.proto.v1 import worker_pb2
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender, peer_from_endpoint
from workers.kv_connector.wire import dtype_name
from workers.runner.kv_pool import KvLayout

LAYOUT = KvLayout(num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def serve(host: str) -> None:
    receiver = KvReceiver(KvInbox(), LAYOUT, host=host)
    receiver.start()
    try:
        endpoint = {
            "data_host": receiver.host,
            "data_port": receiver.port,
            "shm_probe_name": receiver.shm_probe_name,
            "shm_probe_nonce": receiver.shm_probe_nonce.hex(),
            "host_id": receiver.host_id,
        }
        print(json.dumps(endpoint), flush=True)
        sys.stdin.read()  # until the caller is done with it
    finally:
        receiver.close()


def choose(endpoint_json: str, host_id: str = "") -> str:
    fields = json.loads(endpoint_json)
    endpoint = worker_pb2.KvEndpoint(
        data_host=fields["data_host"],
        data_port=fields["data_port"],
        shm_probe_name=fields["shm_probe_name"],
        shm_probe_nonce=bytes.fromhex(fields["shm_probe_nonce"]),
        block_size=LAYOUT.block_size,
        dtype=dtype_name(LAYOUT.dtype),
    )
    sender = KvSender(LAYOUT, host_id=host_id)
    peer = peer_from_endpoint(f"{fields['data_host']}:{fields['data_port']}", endpoint, LAYOUT, host_id=sender.host_id)
    path = sender.path_to(peer, LAYOUT.block_nbytes)
    path.release()
    sender.close()
    return path.data_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve").add_argument("--host", default="127.0.0.1")
    choosing = commands.add_parser("choose")
    choosing.add_argument("endpoint")
    choosing.add_argument("--host-id", action="append", default=[], help="default: this process's")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.host)
    else:
        for host_id in args.host_id or [""]:
            print(choose(args.endpoint, host_id))


if __name__ == "__main__":
    main()
