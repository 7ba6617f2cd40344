"""The names of full KV blocks, shared by the prefill workers' prefix cache and the gateway's routing.

Block i of a prompt is named by a hash chain: hash(name of block i-1, the block's token ids), so equal
names mean equal prefixes up to and including that block. Only full blocks are named.
"""

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain of names of every full block of `token_ids`, in order."""
    hashes = []
    parent = ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
