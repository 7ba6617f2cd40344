"""Secrets handed to clients: `<prefix>_` + 32 random base62 characters + a 6-character checksum.

The checksum (CRC32 of the random part, in base62) lets scanners and our own endpoints recognise a
leaked or mistyped token without a database lookup. Only a SHA-256 hash of a token is ever stored.
"""

import hashlib
import secrets
import zlib

BASE62_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
RANDOM_PART_LENGTH = 32
CHECKSUM_LENGTH = 6


def random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62_ALPHABET) for _ in range(length))


def _base62_checksum(text: str) -> str:
    value = zlib.crc32(text.encode("ascii"))
    digits = []
    for _ in range(CHECKSUM_LENGTH):
        value, remainder = divmod(value, 62)
        digits.append(BASE62_ALPHABET[remainder])
    return "".join(reversed(digits))


def generate_token(prefix: str) -> str:
    random_part = random_base62(RANDOM_PART_LENGTH)
    return f"{prefix}_{random_part}{_base62_checksum(random_part)}"


def token_from_secret(prefix: str, secret: bytes) -> str:
    """A well-formed token whose random part is `secret` (at least 32 random bytes, e.g. an HMAC) in base62,
    for a holder that derives its token again rather than storing it."""
    if len(secret) < RANDOM_PART_LENGTH:
        raise ValueError(f"a token needs at least {RANDOM_PART_LENGTH} bytes of secret")
    random_part = "".join(BASE62_ALPHABET[byte % len(BASE62_ALPHABET)] for byte in secret[:RANDOM_PART_LENGTH])
    return f"{prefix}_{random_part}{_base62_checksum(random_part)}"


def is_well_formed_token(candidate: object, prefix: str) -> bool:
    if not isinstance(candidate, str):
        return False
    head = f"{prefix}_"
    body = candidate[len(head) :]
    if not candidate.startswith(head) or len(body) != RANDOM_PART_LENGTH + CHECKSUM_LENGTH:
        return False
    if any(char not in BASE62_ALPHABET for char in body):
        return False
    random_part, checksum = body[:RANDOM_PART_LENGTH], body[RANDOM_PART_LENGTH:]
    return secrets.compare_digest(checksum, _base62_checksum(random_part))


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
