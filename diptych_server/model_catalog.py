"""`diptych model register`: a local Hugging Face model directory into the control plane's catalog, through
its internal API (`POST /api/v1/internal/models/register`, with the internal token).

The catalog entry's context length, family and dtype are read from the directory's config.json. The
control plane adds (or updates) the model with its prefill, decode and colocated fleets, as
`manage.py bootstrap --model` does, and publishes the directory: every file, with its sha256, goes to its
artifact store as a revision of the model, which becomes the one its workers load.
"""

import json
import re
from pathlib import Path

import httpx

from diptych_common.artifacts import model_directory_files
from diptych_common.internal_api.client import ControlPlaneUnavailable, SyncControlPlaneClient, describe_failure
from diptych_common.internal_api.messages import (
    MODEL_NAME_PATTERN,
    MODEL_NAME_RULE,
    ModelRegistration,
    RegisteredModel,
)

# The control plane answers once it has hashed and stored every file: however long that takes.
REGISTER_TIMEOUT = httpx.Timeout(30.0, read=None)


class RegistrationError(ValueError):
    pass


def register_model(
    control_plane_url: str, internal_token: str, name: str, directory: Path, revision: str = ""
) -> RegisteredModel:
    """Adds (or updates) the model, ensures its fleets (tokens issued only to a model whose fleets have none
    yet), and publishes the directory as `revision` of the model (default: named by its content), which
    becomes the revision its workers load."""
    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise RegistrationError(f"model name {name!r} is not allowed: {MODEL_NAME_RULE}")
    source = directory.resolve()
    config = _read_config(source)
    context_length = config.get("max_position_embeddings")
    if not isinstance(context_length, int) or context_length < 1:
        raise RegistrationError(f"{source}/config.json has no max_position_embeddings: the context length is unknown")
    registration = ModelRegistration(
        name=name,
        context_length=context_length,
        family=str(config.get("model_type", "unknown")),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        revision=revision,
        paths=tuple(model_directory_files(source)),
    )
    try:
        with SyncControlPlaneClient(control_plane_url, internal_token, timeout=REGISTER_TIMEOUT) as control_plane:
            return control_plane.register_model(registration, source)
    except ControlPlaneUnavailable as error:
        raise RegistrationError(
            f"the control plane at {control_plane_url} is not available ({describe_failure(error)}); start the "
            "platform first (`diptych up`), or name it with --control-plane-url"
        ) from None
    except httpx.HTTPStatusError as error:
        raise RegistrationError(_refusal(error.response)) from None
    except OSError as error:
        raise RegistrationError(f"cannot read the model's files: {error}") from None


def _refusal(response: httpx.Response) -> str:
    """The control plane's reason (its error shape's message) for refusing the registration."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    if response.status_code == 401:
        return f"the control plane refused the internal token (DIPTYCH_INTERNAL_TOKEN): {message}"
    return message


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise RegistrationError(f"{directory} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RegistrationError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise RegistrationError(f"{path} holds no JSON object")
    return config
