"""The base of every config model: frozen, strict types, unknown keys named with a suggestion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from cluster.config.errors import unknown_key_message


class StrictModel(BaseModel):
    """A config model that rejects unknown keys, naming the closest valid one."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    moved_keys: ClassVar[dict[str, str]] = {}
    """Keys that belong elsewhere, mapped to the message that says where."""
    key_name: ClassVar[str] = "key"
    """What a key is called in the unknown-key message (`unknown engine argument 'x'`)."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key in data:
                if key in cls.moved_keys:
                    raise ValueError(cls.moved_keys[key])
                if key not in cls.model_fields:
                    raise ValueError(unknown_key_message(str(key), cls.model_fields, cls.key_name))
        return data
