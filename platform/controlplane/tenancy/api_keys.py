"""The format of API keys: `dip_` + 32 random base62 characters + a 6-character base62 checksum."""

from controlplane.common.tokens import generate_token, is_well_formed_token

API_KEY_PREFIX = "dip"
DISPLAY_PREFIX_LENGTH = len(API_KEY_PREFIX) + 1 + 8


def generate_api_key() -> str:
    return generate_token(API_KEY_PREFIX)


def looks_like_api_key(candidate: object) -> bool:
    """True when `candidate` has the shape and a valid checksum of a Diptych API key; no database needed."""
    return is_well_formed_token(candidate, API_KEY_PREFIX)


def display_prefix(api_key: str) -> str:
    return api_key[:DISPLAY_PREFIX_LENGTH]
