"""`diptych model register`: a local Hugging Face model directory into the control plane's catalog.

It runs where the control plane's database is reachable (the same DATABASE_URL, or on the embedded default
the same state directory as `diptych up`) and does what `manage.py bootstrap --model` does, with the
catalog entry's context length, family and dtype read from the directory's config.json.
"""

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,89}")


class RegistrationError(ValueError):
    pass


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    source: str
    context_length: int
    fleet_tokens: dict[str, str]  # role -> a fresh token; the fleet's previous token stops working


def register_model(name: str, directory: Path) -> RegisteredModel:
    """Adds (or updates) the model and its prefill, decode and colocated fleets; issues their tokens."""
    if not MODEL_NAME.fullmatch(name):
        raise RegistrationError(
            f"model name {name!r} is not allowed: use 1 to 90 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    source = directory.resolve()
    config = _read_config(source)
    context_length = config.get("max_position_embeddings")
    if not isinstance(context_length, int) or context_length < 1:
        raise RegistrationError(f"{source}/config.json has no max_position_embeddings: the context length is unknown")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    from django.core.management import call_command
    from django.db import DatabaseError

    django.setup()
    output = io.StringIO()
    try:
        call_command(
            "bootstrap",
            "--json",
            "--model",
            name,
            "--source",
            str(source),
            "--context-length",
            str(context_length),
            "--family",
            str(config.get("model_type", "unknown")),
            "--dtype",
            str(config.get("dtype") or config.get("torch_dtype") or "float32"),
            stdout=output,
            stderr=io.StringIO(),
        )
    except DatabaseError as error:
        raise RegistrationError(
            f"the control plane's database is not ready ({error}); start the platform first (`diptych up`, or "
            "`manage.py migrate` with its DATABASE_URL)"
        ) from None
    return RegisteredModel(name, str(source), context_length, json.loads(output.getvalue())["fleet_tokens"])


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
