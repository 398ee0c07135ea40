"""Store configuration, validated once at the edge (CLI flags, environment, runtime settings)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ember.errors import InvalidInput

MiB = 1 << 20
GiB = 1 << 30
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def default_root(environ: Mapping[str, str] | None = None) -> Path:
    """$EMBER_STORE (in `environ`, default this process's), else ~/.cache/ember/store."""
    env = (os.environ if environ is None else environ).get("EMBER_STORE")
    return Path(env) if env else Path.home() / ".cache" / "ember" / "store"


def default_memory_dir(root: Path) -> Path | None:
    """A directory in /dev/shm for this root and user (one copy per node, shared by every instance using the
    root), when /dev/shm exists. Per root, so that `gc` of one root never drops chunks another root uses."""
    shm = Path("/dev/shm")
    tag = hashlib.sha256(str(root.expanduser().absolute()).encode()).hexdigest()[:12]
    return shm / f"ember-store-{os.getuid()}-{tag}" if shm.is_dir() else None


def check_origin(origin: str) -> str:
    """An origin URL with a trailing slash: http(s)://host[:port]/path or s3://bucket[/prefix] (ValueError if not)."""
    url = urlsplit(origin)
    if url.scheme in ("http", "https") and url.hostname:
        return origin.rstrip("/") + "/"
    if url.scheme == "s3":
        # Bucket names are 3-63 of [a-z0-9.-]; checked here so that a typo fails at the edge, not on first fetch.
        if not _BUCKET.fullmatch(url.netloc):
            raise ValueError(f"s3 origin {origin!r} needs a bucket name (3-63 of a-z, 0-9, '.', '-')")
        return origin.rstrip("/") + "/"
    raise ValueError(f"origin must be an s3://, http:// or https:// URL, not {origin!r}")


def check_peer(url: str) -> str:
    """A peer gateway's base URL with a trailing slash: http(s)://host[:port][/path] (ValueError if not)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"each peer must be an http(s)://host:port/ URL of a gateway, not {url!r}")
    return url.rstrip("/") + "/"


class StoreConfig(BaseModel):
    """Where the tiers live and how big they may grow.

    `root` holds the disk tier (chunks/), the manifests and materialized directories. The memory tier is a
    directory on a tmpfs (/dev/shm); set `memory_dir` to None or `memory_capacity` to 0 to go without it.
    The memory tier holds RAM: a store that created its directory removes it when it closes, unless
    `keep_memory_tier` (one that found it there leaves it to whoever made it, e.g. a running server).
    `origin` is the base URL of a remote store root: served over HTTP (any static file server), or an S3
    bucket and prefix (`s3://bucket/prefix/`, read with boto3). `peers` are other nodes' gateways, asked for a
    missing chunk before the origin (docs/cluster.md, "Peer tier"), with `peer_token` as their bearer token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Field(default_factory=default_root)
    memory_dir: Path | None = Field(default=None, description="memory tier directory (default: under /dev/shm)")
    memory_capacity: int = Field(default=8 * GiB, ge=0, description="bytes of chunks kept in the memory tier")
    disk_capacity: int | None = Field(default=None, ge=0, description="bytes of cached chunks on disk; None: no limit")
    origin: str | None = Field(default=None, description="http(s) or s3:// URL of a remote store root")
    origin_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    peers: tuple[str, ...] = Field(default=(), description="base URLs of other nodes' gateways to fetch chunks from "
                                                           "before the origin (a static peer directory)")
    peer_token: str | None = Field(default=None, repr=False, description="bearer token peers' gateways accept")
    peer_tls_dir: Path | None = Field(default=None, description=(
        "this node's TLS directory (`ember cluster init`): peers' https gateways are verified against its CA and "
        "shown its certificate (mutual TLS, ember/tls.py)"))
    peer_timeout_s: float = Field(default=10.0, gt=0, le=3600, description="connect and read timeout of a peer")
    peer_wait_s: float = Field(default=60.0, ge=0, le=3600, description=(
        "how long to wait for another node's origin fetch of a chunk before fetching it from the origin too"))
    threads: int = Field(default=4, ge=1, le=64, description="parallel chunk fetches and page-ins")
    part_size: int = Field(default=64 * MiB, ge=64 * 1024, le=4 * GiB,
                           description="chunks above this size are fetched as parallel Range requests of this size")
    file_chunk_size: int = Field(default=16 * MiB, ge=4096, le=4 * GiB, description="chunk size of non-tensor files")
    fsync: bool = Field(default=True, description="fsync disk-tier chunks before they become visible")
    promote_from_disk: bool = Field(default=True, description="copy chunks read from disk into the memory tier")
    keep_memory_tier: bool = Field(
        default=False, description="leave the memory tier directory in RAM when the store that created it closes")

    @model_validator(mode="before")
    @classmethod
    def _default_memory_dir(cls, values: Any) -> Any:
        if isinstance(values, dict) and "memory_dir" not in values:
            values = {**values, "memory_dir": default_memory_dir(Path(values.get("root") or default_root()))}
        return values

    @field_validator("origin")
    @classmethod
    def _origin_scheme(cls, origin: str | None) -> str | None:
        return None if origin is None else check_origin(origin)

    @field_validator("peers")
    @classmethod
    def _peer_urls(cls, peers: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_peer(u) for u in peers)

    @property
    def memory_enabled(self) -> bool:
        return self.memory_dir is not None and self.memory_capacity > 0

    @classmethod
    def build(cls, **values: Any) -> StoreConfig:
        """Validate `values`, raising InvalidInput that names the key and its range."""
        try:
            return cls(**values)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "store"
            raise InvalidInput(f"store config: {key}: {first['msg']}") from None
