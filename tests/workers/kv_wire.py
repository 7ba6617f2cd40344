"""What the KV data-path tests share: a small KV layout, a transfer token, and a hand-written hello."""

import json
import struct

import torch

from workers.kv_connector.wire import MAGIC
from workers.runner.kv_pool import KvLayout

LAYOUT = KvLayout(num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
TOKEN = b"t" * 32


def hello(num_tokens: int, **header) -> bytes:
    """A sender's hello for request `req-1` in LAYOUT over TCP; `header` overrides any of its fields."""
    body = json.dumps(
        {
            "request_id": "req-1",
            "transfer_token": TOKEN.hex(),
            "data_path": "tcp",
            "num_tokens": num_tokens,
            "num_layers": LAYOUT.num_layers,
            "kv_heads": LAYOUT.kv_heads,
            "head_dim": LAYOUT.head_dim,
            "block_size": LAYOUT.block_size,
            "dtype": "float32",
            **header,
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(body)) + body
