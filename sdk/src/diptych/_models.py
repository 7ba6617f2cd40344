"""What every typed result can do, as openai-python's models can: `model_dump()` / `to_dict()`, `to_json()`."""

from __future__ import annotations

import dataclasses
import json
from datetime import date
from typing import Any, Literal

__all__ = ["BaseModel"]


class BaseModel:
    """The base of the SDK's result dataclasses. Fields whose names start with "_" are not part of the data."""

    __slots__ = ()

    def model_dump(self, *, mode: Literal["python", "json"] = "python", exclude_none: bool = False) -> dict[str, Any]:
        """The fields as a dict, nested results as dicts too; `mode="json"` writes dates and times as ISO 8601."""
        dumped = _dump(self, mode, exclude_none)
        assert isinstance(dumped, dict)
        return dumped

    def to_dict(self, *, mode: Literal["python", "json"] = "python", exclude_none: bool = False) -> dict[str, Any]:
        return self.model_dump(mode=mode, exclude_none=exclude_none)

    def model_dump_json(self, *, indent: int | None = None, exclude_none: bool = False) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=exclude_none), indent=indent)

    def to_json(self, *, indent: int | None = 2, exclude_none: bool = False) -> str:
        return self.model_dump_json(indent=indent, exclude_none=exclude_none)


def _dump(value: object, mode: str, exclude_none: bool) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        dumped = {
            f.name: _dump(getattr(value, f.name), mode, exclude_none)
            for f in dataclasses.fields(value)
            if not f.name.startswith("_")
        }
        return {name: item for name, item in dumped.items() if not (exclude_none and item is None)}
    if isinstance(value, list | tuple):
        return [_dump(item, mode, exclude_none) for item in value]
    if isinstance(value, dict):
        return {key: _dump(item, mode, exclude_none) for key, item in value.items()}
    if mode == "json" and isinstance(value, date):  # a datetime is a date too
        return value.isoformat()
    return value
