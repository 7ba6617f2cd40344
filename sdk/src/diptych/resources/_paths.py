"""The parts of a request's path that name an object: checked here, so an empty or non-string id fails
before anything is sent, instead of reaching another endpoint (`/v1/batches/` is the list)."""

from urllib.parse import quote


def segment(identifier: str) -> str:
    if not isinstance(identifier, str) or not identifier:
        raise ValueError(f"expected a non-empty id, not {identifier!r}")
    return quote(identifier, safe="")
