"""`diptych model register`: a local Hugging Face model directory into the control plane's catalog.

It runs where the control plane's database is reachable (the same DATABASE_URL, or on the embedded default
the same state directory as `diptych up`) and does what `manage.py bootstrap --model` does, with the
catalog entry's context length, family and dtype read from the directory's config.json. It then publishes
the directory: every file, with its sha256, goes to the artifact store (the control plane's settings name it)
as a revision of the model, which becomes the one its workers load.
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
    source: str  # the directory published
    context_length: int
    revision: str  # the model's current revision, which its workers load
    # role -> a fresh token (the fleet's previous token stops working); empty when the model's fleets already
    # held tokens, which they keep, so workers of the earlier revision hear that they should drain
    fleet_tokens: dict[str, str]


def register_model(name: str, directory: Path, revision: str = "") -> RegisteredModel:
    """Adds (or updates) the model, ensures its prefill, decode and colocated fleets (tokens issued only to a
    model whose fleets have none yet), and publishes the directory as `revision` of the model (default: named
    by its content), which becomes the revision its workers load."""
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
    from django.db import DatabaseError

    django.setup()
    from controlplane.catalog.models import Model
    from controlplane.catalog.services import model_publish, publication_prepare
    from controlplane.common.errors import InvalidInput

    try:
        # Everything is hashed and checked before anything changes: a refused revision changes nothing.
        publication = publication_prepare(model_name=name, directory=source, revision=revision)
        fleet_tokens = _catalog_entry_ensure(name, source, context_length, config)
        published = model_publish(model=Model.objects.get(name=name), publication=publication)
    except DatabaseError as error:
        raise RegistrationError(
            f"the control plane's database is not ready ({error}); start the platform first (`diptych up`, or "
            "`manage.py migrate` with its DATABASE_URL)"
        ) from None
    except InvalidInput as error:
        raise RegistrationError(error.message) from None
    except OSError as error:
        raise RegistrationError(f"the model's files could not be stored in the artifact store: {error}") from None
    return RegisteredModel(name, str(source), context_length, published.revision, fleet_tokens)


def _catalog_entry_ensure(name: str, source: Path, context_length: int, config: dict) -> dict[str, str]:
    """The model's catalog entry and fleets as bootstrap makes them, with fresh fleet tokens; a model whose
    fleets of every role hold tokens is only updated, its tokens kept (a new revision's workers use them)."""
    from django.core.management import call_command

    from controlplane.catalog.models import ARTIFACTS_SOURCE, Fleet, FleetRole, Model
    from controlplane.catalog.services import model_ensure

    family = str(config.get("model_type", "unknown"))
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    existing = Model.objects.filter(name=name).first()
    # A model already published keeps serving its current revision until the new one is in place.
    catalog_source = ARTIFACTS_SOURCE if existing is not None and existing.source == ARTIFACTS_SOURCE else str(source)
    roles_with_tokens = set(
        Fleet.objects.filter(model__name=name, token_hash__isnull=False).values_list("role", flat=True)
    )
    if existing is not None and roles_with_tokens >= set(FleetRole.values):
        model_ensure(name=name, source=catalog_source, context_length=context_length, family=family, dtype=dtype)
        return {}
    output = io.StringIO()
    call_command(
        "bootstrap",
        "--json",
        "--model",
        name,
        "--source",
        catalog_source,
        "--context-length",
        str(context_length),
        "--family",
        family,
        "--dtype",
        dtype,
        stdout=output,
        stderr=io.StringIO(),
    )
    return json.loads(output.getvalue())["fleet_tokens"]


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
