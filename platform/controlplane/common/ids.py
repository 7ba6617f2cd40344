"""Public identifiers (`org_...`, `key_...`, `wrk_...`): the REST API never exposes database keys."""

from controlplane.common.tokens import random_base62

PUBLIC_ID_RANDOM_LENGTH = 20
PUBLIC_ID_MAX_LENGTH = 32


def new_public_id(prefix: str) -> str:
    return f"{prefix}_{random_base62(PUBLIC_ID_RANDOM_LENGTH)}"
