"""The names of full KV blocks, shared by the prefill workers' prefix cache and the gateway's routing.

Block i of a prompt is named by a hash chain: hash(name of block i-1, the block's token ids), so equal
names mean equal prefixes up to and including that block. Only full blocks are named.

The chain starts from a root derived from a salt (the organization id): two organizations' names for the
same tokens differ from the first block on, so one tenant's cached blocks never answer another's prompt
and cached-token counts reveal nothing across tenants. The empty salt is the unsalted chain (root 0),
for tools that inspect a cache without a tenant.
"""

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0
_SALT_DOMAIN = b"diptych-prefix-cache-salt\x00"


def chain_root(salt: str = "") -> int:
    """The name the chain of `salt` starts from: ROOT for no salt, a salt-derived 64-bit value otherwise."""
    if not salt:
        return ROOT
    digest = hashlib.blake2b(_SALT_DOMAIN + salt.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The chain of names of every full block of `token_ids` under `salt`, in order."""
    hashes = []
    parent = chain_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
