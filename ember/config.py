"""Server settings, validated once at the edge; errors name the key and its range."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ember.core.keepalive import KeepAlivePolicy, make_policy
from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.store.config import StoreConfig, check_origin, default_root


def _default_state_dir() -> Path:
    return Path(os.environ.get("EMBER_STATE_DIR", Path.home() / ".local" / "state" / "ember"))


def _default_store_origin() -> str | None:
    return os.environ.get("EMBER_STORE_ORIGIN") or None


def _total_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    state_dir: Path = Field(default_factory=_default_state_dir)
    models: tuple[Path, ...] = ()
    cpu_slots: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=1, le=4096,
                           description="CPU slices: one per core this process may use by default")
    slice_memory_mb: int | None = Field(default=None, ge=64, description="memory per CPU slice (default: RAM / slots)")
    threads_per_slot: int = Field(default=1, ge=1, le=256)
    max_body_mb: float = Field(default=64, gt=0, le=4096)
    max_queued_jobs: int = Field(default=10_000, ge=1, le=10_000_000)
    job_result_ttl_s: float = Field(default=3600, gt=0)
    request_timeout_s: float = Field(default=60, gt=0, le=86_400)
    queue_wait_s: float = Field(default=2, ge=0, le=3600, description="wait for room before becoming a 202 job")
    overload_wait_s: float = Field(default=10, ge=0, le=3600,
                                   description="wait for room before a 429, for clients that cannot poll a job")
    tick_s: float = Field(default=0.25, gt=0, le=60)
    idle_poll_us: int = Field(default=2000, ge=0, le=100_000, description=(
        "instances poll for the next request, and the gateway for a reply around its due time, this long "
        "before sleeping (0: never poll)"))
    keepalive: Literal["contract", "fixed", "hybrid", "ladder"] = Field(
        default="contract", description="who decides idle rungs: each contract's knobs, or a keep-alive policy")
    rung_costs: Path | None = Field(default=None, description="bench/cold_start.py JSON for the ladder policy")
    sandbox: bool = Field(default=True, description="instances run sandboxed where the machine permits "
                                                    "(own user, memory cgroup, read-only files, no network, seccomp)")
    log_level: str = Field(default="info", pattern="^(critical|error|warning|info|debug)$")
    access_log: Literal["text", "json"] | None = Field(default=None, description="one line per request, or none")
    # The weight store for contracts whose weights are store:NAME[:VERSION] (opened on first such model).
    store_root: Path = Field(default_factory=default_root,
                             description="weight store root (default: $EMBER_STORE or ~/.cache/ember/store)")
    store_origin: str | None = Field(
        default_factory=_default_store_origin,
        description="http(s) or s3:// URL of the remote store root (default: $EMBER_STORE_ORIGIN)")

    @field_validator("store_origin")
    @classmethod
    def _origin_url(cls, origin: str | None) -> str | None:
        return None if origin is None else check_origin(origin)

    @property
    def slot_memory_mb(self) -> int:
        return self.slice_memory_mb or max(64, _total_memory_mb() // self.cpu_slots)

    def store_config(self) -> StoreConfig:
        """The node's weight store settings (what `LocalNode(store=...)` takes)."""
        return StoreConfig.build(root=self.store_root, origin=self.store_origin)


def load_serve_config(**values: Any) -> ServeConfig:
    """Validate settings (from flags); `None` values mean "use the default"."""
    try:
        return ServeConfig(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as err:
        parts = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            parts.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
        raise InvalidInput("invalid server settings: " + "; ".join(parts)) from None


def keepalive_policy(config: ServeConfig) -> KeepAlivePolicy | None:
    """The keep-alive policy object the settings name (None: follow each contract)."""
    if config.keepalive == "contract":
        return None
    if config.keepalive != "ladder":
        return make_policy(config.keepalive)
    costs = RungCosts()
    if config.rung_costs is not None:
        try:
            costs = RungCosts.from_benchmark(json.loads(config.rung_costs.read_text()))
        except (OSError, ValueError) as err:
            raise InvalidInput(f"rung_costs: cannot read {config.rung_costs}: {err}") from None
    return make_policy("ladder", costs=costs)
