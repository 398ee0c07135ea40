"""Manifests: what a pushed model is made of (files -> ordered chunks, tensor index, load order).

A model is named `name:version` (version defaults to "latest"); names follow the model-contract pattern so a
contract's `key` is a valid store name. A manifest lives at `manifests/<name>/<version>.json` under a store root,
local or remote.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ember.errors import StoreError
from ember.wire.refs import ModelRef

FORMAT = 1
_DIGEST = r"^[0-9a-f]{64}$"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Chunk(_Frozen):
    """A content-addressed run of bytes: blake3 digest (hex) and length."""

    digest: str = Field(pattern=_DIGEST)
    size: int = Field(gt=0)


class TensorEntry(_Frozen):
    """A tensor of a safetensors file; its bytes are exactly chunk `chunk` of the file (None when empty)."""

    dtype: str
    shape: tuple[int, ...]
    chunk: int | None


class FileEntry(_Frozen):
    path: str
    size: int = Field(ge=0)
    kind: Literal["safetensors", "raw"] = "raw"
    chunks: tuple[Chunk, ...] = ()
    tensors: dict[str, TensorEntry] = Field(default_factory=dict)
    metadata: dict[str, str] | None = None

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str) -> str:
        """A path inside the model's directory: a manifest (a peer's, an origin's) never names a file elsewhere."""
        parts = path.split("/")
        if "\0" in path or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"file path {path!r} must be relative, without '.', '..' or empty parts")
        return path


class Manifest(_Frozen):
    format: int = FORMAT
    name: str
    version: str
    files: tuple[FileEntry, ...]
    load_order: tuple[str, ...] = Field(default=(), description="tensor names in the order the model first read them")

    @property
    def ref(self) -> ModelRef:
        return ModelRef(self.name, self.version)

    @property
    def key(self) -> str:
        return self.ref.key

    def tensor_chunks(self) -> dict[str, Chunk | None]:
        """Every tensor of every safetensors file, mapped to its chunk."""
        out: dict[str, Chunk | None] = {}
        for f in self.files:
            for tname, t in f.tensors.items():
                if tname in out:
                    raise StoreError(f"model {self.key}: tensor {tname!r} appears in two files")
                out[tname] = None if t.chunk is None else f.chunks[t.chunk]
        return out

    def tensor_entries(self) -> dict[str, TensorEntry]:
        return {name: t for f in self.files for name, t in f.tensors.items()}

    def ordered_tensors(self) -> list[str]:
        """Tensor names, the recorded load order first, then the rest in file order."""
        names = list(self.tensor_entries())
        known = set(names)
        first = [n for n in self.load_order if n in known]
        seen = set(first)
        return first + [n for n in names if n not in seen]

    def unique_chunks(self) -> dict[str, Chunk]:
        return {c.digest: c for f in self.files for c in f.chunks}

    @property
    def logical_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str) -> Manifest:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            if raw.get("format") != FORMAT:
                raise StoreError(f"manifest {where}: format {raw.get('format')!r} is not {FORMAT}")
            return cls.model_validate(raw)
        except (ValueError, ValidationError) as err:
            raise StoreError(f"manifest {where} is not valid: {err}") from None
