"""The `name:version` reference grammar shared by model contracts and the weight store."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ember.errors import InvalidInput

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class ModelRef:
    """A parsed `name:version` (the version defaults to "latest")."""

    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        name, _, version = text.partition(":")
        version = version or "latest"
        for part, value in (("name", name), ("version", version)):
            if not _NAME.match(value):
                raise InvalidInput(
                    f"model {text!r}: {part} {value!r} must be 1-128 of [A-Za-z0-9_.-], starting alphanumeric"
                )
        return cls(name, version)

    @property
    def key(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def manifest_path(self) -> str:
        return f"manifests/{self.name}/{self.version}.json"

    def __str__(self) -> str:
        return self.key
