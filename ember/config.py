"""Server settings, validated once at the edge; errors name the key and its range."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ember.core.ratelimit import RateLimit
from ember.core.rung_costs import RungCosts
from ember.core.warm_pool import WarmPoolSettings
from ember.errors import InvalidInput
from ember.keepalive.arrivals import LadderForecast
from ember.keepalive.idle_plan import KeepAlivePolicy
from ember.keepalive.policies import POLICIES, LadderPolicy, make_policy
from ember.keepalive.preset import Preset, from_document, named
from ember.store.config import StoreConfig, check_origin, check_peer, default_root
from ember.tls import NodeTls
from ember.wire.refs import ModelRef


def default_state_dir() -> Path:
    return Path(os.environ.get("EMBER_STATE_DIR", Path.home() / ".local" / "state" / "ember"))


def _default_port() -> int | str:
    # A string from the environment is validated like the flag (a bad value names `port`).
    return os.environ.get("EMBER_PORT") or 8000


DEFAULT_GRPC_PORT = 8001


def _default_grpc_port() -> str | None:
    return os.environ.get("EMBER_GRPC_PORT") or None


def _default_store_origin() -> str | None:
    return os.environ.get("EMBER_STORE_ORIGIN") or None


def _otel_from_env() -> bool:
    """Whether the standard OpenTelemetry environment asks for traces: OTEL_TRACES_EXPORTER names an exporter
    (not `none`), or, with it unset, an OTLP endpoint is given; OTEL_SDK_DISABLED=true says no."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _default_jobs_url() -> SecretStr | None:
    url = os.environ.get("EMBER_JOBS_URL")
    return SecretStr(url) if url else None


def _default_tls_dir() -> Path | None:
    tls = os.environ.get("EMBER_TLS_DIR")
    return Path(tls) if tls else None


def _default_cluster_token() -> SecretStr | None:
    token = os.environ.get("EMBER_CLUSTER_TOKEN")
    return SecretStr(token) if token else None


# Settings whose value may hold a password: a validation error names the key, never echoes the value.
_SECRET_KEYS = frozenset({"jobs_url", "cluster_token"})


def _total_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default_factory=_default_port, ge=0, le=65535, validate_default=True,
                      description="port to bind (default: $EMBER_PORT or 8000)")
    grpc_port: int | None = Field(default_factory=_default_grpc_port, ge=0, le=65535, validate_default=True,
                                  description=("port of the KServe V2 gRPC binding on the same host (0: no gRPC); "
                                               "unset: $EMBER_GRPC_PORT, else 8001 if it is free"))
    auth: Literal["on", "off", "auto"] = Field(
        default="auto", description="API keys: auto = off on a loopback bind, on on any other address")
    allowed_hosts: tuple[str, ...] | None = Field(default=None, description=(
        "Host names the gateway answers to, beside any IP address, localhost, this machine's names and the "
        "bind and advertised hosts ('.example.com': its subdomains; '*': any). Default: checked while API "
        "keys are off (a DNS rebinding page sends its own name), any host while they are on"))
    rate_limit_rps: float | None = Field(default=None, gt=0, le=1_000_000,
                                         description="requests per second per tenant (default: no limit)")
    rate_limit_burst: int | None = Field(default=None, ge=1, le=1_000_000,
                                         description="requests a tenant may send at once (default: one second's)")
    state_dir: Path = Field(default_factory=default_state_dir)
    models: tuple[Path, ...] = ()
    store_models: tuple[str, ...] = Field(default=(), description=(
        "weight store objects (NAME[:VERSION]) holding contract directories (`ember store push DIR`), fetched "
        "from the peers or the origin and served beside `models`"))
    examples: bool = Field(default=True, description="serve the bundled example models too (beside `models`)")
    cpu_slots: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=0, le=4096, description=(
        "CPU slots: one per core this process may use by default. Instances share the slots' cores (any number of "
        "them, within the slots' memory), at most this many working at once; 0 (with --ray): a gateway only, "
        "which serves nothing itself and offers its --models to the cluster"))
    dedicated_cpu_slots: int = Field(default=0, ge=0, le=4096, description=(
        "of the CPU slots, how many are dedicated: one instance each, on its own cores (for contracts with "
        "resources.dedicated_cores; all of them: every instance on a slot of its own)"))
    slice_memory_mb: int | None = Field(default=None, ge=64, description="memory per CPU slot (default: RAM / slots)")
    threads_per_slot: int = Field(default=1, ge=1, le=256)
    max_body_mb: float = Field(default=64, gt=0, le=4096)
    max_inflight_mb: float = Field(default=256, gt=0, le=65536, description=(
        "request bodies the gateway holds at once, all clients together (past it: 429); at least max_body_mb"))
    max_connections: int = Field(default=4096, ge=1, le=1_000_000, description=(
        "client connections at once (past it: 503 and closed); kept below the open-files limit"))
    header_timeout_s: float = Field(default=10, gt=0, le=3600,
                                    description="a connection's request headers must be complete within this")
    body_timeout_s: float = Field(default=30, gt=0, le=3600,
                                  description="a request body that sends nothing for this long is answered 408")
    body_min_rate_kbs: float = Field(default=64, ge=0, le=1_000_000, description=(
        "a request body must average at least this many KiB/s after its first 10 s, or 408 (0: no minimum)"))
    body_deadline_s: float = Field(default=120, gt=0, le=86_400,
                                   description="a request body must be whole within this, or 408")
    http_keepalive_s: float = Field(default=5, gt=0, le=3600,
                              description="an idle kept-alive connection is closed after this")
    shutdown_grace_s: float = Field(default=30, ge=0, le=3600, description=(
        "on SIGTERM: no new connections or job claims; requests and running jobs get this long to finish "
        "(jobs still running then go back to the queue)"))
    max_queued_jobs: int = Field(default=10_000, ge=1, le=10_000_000)
    jobs_url: SecretStr | None = Field(default_factory=_default_jobs_url, validate_default=True, description=(
        "postgresql:// URL of a job store shared by several nodes (default: $EMBER_JOBS_URL; unset: SQLite in "
        "state_dir)"))
    job_result_ttl_s: float = Field(default=3600, gt=0)
    request_timeout_s: float = Field(default=60, gt=0, le=86_400)
    queue_wait_s: float = Field(default=2, ge=0, le=3600, description="wait for room before becoming a 202 job")
    overload_wait_s: float = Field(default=10, ge=0, le=3600,
                                   description="wait for room before a 429, for clients that cannot poll a job")
    tick_s: float = Field(default=0.25, gt=0, le=60)
    idle_poll_us: int = Field(default=2000, ge=0, le=100_000, description=(
        "instances poll for the next request, and the gateway for a reply around its due time, this long "
        "before sleeping (0: never poll)"))
    keepalive: Literal["contract", "fixed", "fixed-zygote", "hybrid", "hybrid-zygote", "ladder", "ladder-cold"] = Field(
        default="contract", description="who decides idle rungs: each contract's knobs, or a keep-alive policy")
    keepalive_knob: float | None = Field(default=None, ge=0, description=(
        "the policy's knob (fixed: keep_alive_s, hybrid: range_s, ladder: latency_value, ladder-cold: cold_value, "
        "MB*s per start that needs a new process; default: its default)"))
    rung_costs: Path | None = Field(default=None, description="bench/cold_start.py JSON for the ladder policy")
    keepalive_preset: Path | None = Field(default=None, description=(
        "JSON preset of the ladder's constants (`ember sim --write-preset`); default: the built-in preset, "
        "ember.keepalive.preset.DEFAULT_PRESET"))
    idle_memory_mb: float | None = Field(default=None, description=(
        "node budget for idle instances' memory: the LP buffer planner sizes each model's idle instances within "
        "it every second (default: no budget, each model's idle instances follow the lifecycle alone)"))
    idle_latency_value: float = Field(default=1e5, description=(
        "with idle_memory_mb: MB*s of idle memory worth one second of start latency"))
    sandbox: bool = Field(default=True, description="instances run sandboxed where the machine permits "
                                                    "(own user, memory cgroup, read-only files, no network, seccomp)")
    snapshots: bool = Field(default=False, description="models' loaded processes imaged to disk (CRIU), restored "
                                                       "as instances when no template or zygote is kept")
    log_level: str = Field(default="info", pattern="^(critical|error|warning|info|debug)$")
    access_log: Literal["text", "json"] | None = Field(default=None, description="one line per request, or none")
    otel: bool = Field(default_factory=_otel_from_env,
                       description="OpenTelemetry traces, exported over OTLP (needs the ember[otel] extra)")
    # The weight store for contracts whose weights are store:NAME[:VERSION] (opened on first such model).
    store_root: Path = Field(default_factory=default_root,
                             description="weight store root (default: $EMBER_STORE or ~/.cache/ember/store)")
    store_origin: str | None = Field(
        default_factory=_default_store_origin,
        description="http(s) or s3:// URL of the remote store root (default: $EMBER_STORE_ORIGIN)")

    ray: str | None = Field(default=None, min_length=1, description=(
        "join a Ray cluster (docs/cluster.md): 'auto' (the one on this machine) or its address; unset: one node"))
    ray_node_id: str | None = Field(default=None, description="the Ray node this server stands for (set by its "
                                                              "node agent; default: the node Ray connects it to)")
    advertise_url: str | None = Field(default=None, pattern=r"^https?://", description=(
        "this gateway's URL as the other nodes of the cluster reach it (default: http://host:port)"))
    gateway_links: bool = Field(default=True, description=(
        "forward unary requests to other nodes over gateway links (frames on the gateway's own port, "
        "docs/cluster.md), else over HTTP as streams go"))
    cluster_report_s: float = Field(default=0.5, gt=0, le=60,
                                    description="how often this node reports its inventory to the controller")
    keep_memory_tier: bool = Field(default=False, description=(
        "leave the store's memory tier (RAM, in /dev/shm) in place on exit; by default the server removes it "
        "if it created it"))
    store_peers: tuple[str, ...] = Field(default=(), description=(
        "base URLs of other nodes' gateways to fetch weight chunks from before the origin"))
    cluster_token: SecretStr | None = Field(default_factory=_default_cluster_token, min_length=16, description=(
        "token the nodes of a cluster present to each other's weight-chunk route on plain links (default: "
        "$EMBER_CLUSTER_TOKEN)"))
    tls_dir: Path | None = Field(default_factory=_default_tls_dir, description=(
        "a node directory of `ember cluster init` (ca.crt, tls.crt, tls.key): serve HTTPS, and mutual TLS with "
        "the other nodes (default: $EMBER_TLS_DIR)"))
    allow_local_jobs: bool = Field(default=False, description=(
        "with --ray and no --jobs-url: keep a job queue per node (each node's jobs are its own)"))

    @field_validator("tls_dir")
    @classmethod
    def _tls_files(cls, tls_dir: Path | None) -> Path | None:
        if tls_dir is not None:
            try:
                NodeTls.of(tls_dir)
            except InvalidInput as err:
                raise ValueError(err.message) from None
        return tls_dir

    @model_validator(mode="after")
    def _cluster_shares_jobs(self) -> ServeConfig:
        if self.ray is not None and self.jobs_url is None and not self.allow_local_jobs:
            raise ValueError("ray: a cluster needs a shared job store: give every node the same --jobs-url "
                             "postgresql://... (or $EMBER_JOBS_URL), or --allow-local-jobs for a queue per node "
                             "(a job accepted by one node is then run and answered by that node only)")
        return self

    @field_validator("jobs_url")
    @classmethod
    def _jobs_url(cls, url: SecretStr | None) -> SecretStr | None:
        if url is not None and not url.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("jobs_url: must be a postgresql:// URL (postgresql://user@host:port/dbname)")
        return url

    @field_validator("idle_memory_mb", "idle_latency_value")
    @classmethod
    def _warm_pool_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        lo, hi = _WARM_POOL_RANGES[info.field_name or ""]
        if value is not None and not lo <= value <= hi:
            flag = "--" + (info.field_name or "").replace("_", "-")
            raise ValueError(f"{flag} must lie in [{lo:g}, {hi:g}]")
        return value

    @field_validator("store_origin")
    @classmethod
    def _origin_url(cls, origin: str | None) -> str | None:
        return None if origin is None else check_origin(origin)

    @field_validator("store_models")
    @classmethod
    def _store_names(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        try:
            return tuple(ModelRef.parse(r).key for r in refs)
        except InvalidInput as err:
            raise ValueError(f"--models store:NAME[:VERSION]: {err.message}") from None

    @field_validator("store_peers")
    @classmethod
    def _peer_urls(cls, peers: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_peer(u) for u in peers)

    @model_validator(mode="after")
    def _no_slots_only_in_a_cluster(self) -> ServeConfig:
        if self.cpu_slots == 0 and self.ray is None:
            raise ValueError("cpu_slots: 0 (a gateway only) needs a cluster to serve for it (--ray); alone, at least 1")
        return self

    @model_validator(mode="after")
    def _dedicated_within_slots(self) -> ServeConfig:
        if self.dedicated_cpu_slots > self.cpu_slots:
            raise ValueError(f"dedicated_cpu_slots: {self.dedicated_cpu_slots} is more than the node's cpu_slots "
                             f"({self.cpu_slots}); at most cpu_slots")
        return self

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for host in hosts or ():
            if host != "*" and not re.fullmatch(r"\.?[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?", host):
                raise ValueError(f"allowed_hosts: {host!r} is not a host name ('name', '.domain' or '*')")
        return hosts

    @model_validator(mode="after")
    def _ports_differ(self) -> ServeConfig:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port: {self.grpc_port} is the HTTP port too; give gRPC a port of its own "
                             "(--grpc-port, 0 turns it off)")
        return self

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> ServeConfig:
        if self.rate_limit_burst is not None and self.rate_limit_rps is None:
            raise ValueError("rate_limit_burst: needs rate_limit_rps (a burst of what rate?)")
        return self

    @property
    def auth_enabled(self) -> bool:
        """Whether requests need an API key: `auth`, where auto means on unless the bind is loopback only."""
        return self.auth == "on" or (self.auth == "auto" and not is_loopback(self.host))

    def rate_limit(self) -> RateLimit | None:
        if self.rate_limit_rps is None:
            return None
        return RateLimit(self.rate_limit_rps, self.rate_limit_burst or max(1, math.ceil(self.rate_limit_rps)))

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> ServeConfig:
        if self.max_inflight_mb < self.max_body_mb:
            raise ValueError(f"max_inflight_mb ({self.max_inflight_mb:g}) must be at least max_body_mb "
                             f"({self.max_body_mb:g}): the budget holds at least one whole body")
        return self

    @property
    def slot_memory_mb(self) -> int:
        return self.slice_memory_mb or max(64, _total_memory_mb() // max(1, self.cpu_slots))

    def store_config(self) -> StoreConfig:
        """The node's weight store settings (what `LocalNode(store=...)` takes)."""
        token = self.cluster_token.get_secret_value() if self.cluster_token is not None else None
        return StoreConfig.build(root=self.store_root, origin=self.store_origin,
                                 keep_memory_tier=self.keep_memory_tier, peers=self.store_peers, peer_token=token,
                                 peer_tls_dir=self.tls_dir)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (0.0.0.0, a name, a LAN address) is reachable by others."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_serve_config(**values: Any) -> ServeConfig:
    """Validate settings (from flags); `None` values mean "use the default"."""
    try:
        return ServeConfig(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as err:
        parts = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if not key:   # a rule across keys (a model validator): its message names them
                parts.append(e["msg"].removeprefix("Value error, "))
                continue
            got = "" if key in _SECRET_KEYS else f" (got {e.get('input')!r})"
            parts.append(f"{key}: {e['msg']}{got}")
        raise InvalidInput("invalid server settings: " + "; ".join(parts)) from None


_WARM_POOL_RANGES = {"idle_memory_mb": (1.0, 1e9), "idle_latency_value": (1e-3, 1e15)}


def warm_pool_settings(config: ServeConfig) -> WarmPoolSettings | None:
    """The warm pool's settings (None: no idle-memory budget)."""
    if config.idle_memory_mb is None:
        return None
    return WarmPoolSettings(config.idle_memory_mb, latency_value=config.idle_latency_value, costs=rung_costs(config))


def idle_forecast(config: ServeConfig) -> LadderForecast:
    """The ladder's forecast: the warm pool sizes idle instances by it; without a keep-alive policy, a node's idle
    histories are its."""
    pool = warm_pool_settings(config)
    return LadderForecast() if pool is None else LadderForecast(LadderPolicy(costs=pool.costs))


def rung_costs(config: ServeConfig) -> RungCosts:
    """Measured rung costs (`rung_costs`), else the reference defaults; with snapshots, nothing kept in memory is a
    restore from the model's image (`RungCosts.with_restore`), which the ladder's keep-alive plans with."""
    costs = RungCosts() if config.rung_costs is None else \
        RungCosts.from_benchmark(read_json("rung_costs", config.rung_costs))
    return costs.with_restore() if config.snapshots else costs


def read_json(what: str, path: str | Path) -> Any:
    """The JSON document at `path`, named `what` (a setting or a flag); InvalidInput names both if it cannot be
    had: unreadable, not JSON, bad UTF-8, an integer of thousands of digits, nesting too deep."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as err:
        raise InvalidInput(f"{what} {path}: cannot read: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise InvalidInput(f"{what} {path}: not JSON: {err.msg} (line {err.lineno})") from None
    except (ValueError, RecursionError) as err:
        raise InvalidInput(f"{what} {path}: not JSON: {type(err).__name__}") from None


def load_preset(path: str | Path | None) -> Preset:
    """The ladder's preset: the built-in default, or the JSON file at `path` (`--keepalive-preset`)."""
    if path is None:
        return named()
    return from_document(read_json("--keepalive-preset", str(path)), f"--keepalive-preset {path}")


def keepalive_policy(config: ServeConfig) -> KeepAlivePolicy | None:
    """The keep-alive policy object the settings name (None: follow each contract)."""
    if config.keepalive == "contract":
        return None
    knob = {} if config.keepalive_knob is None else {POLICIES[config.keepalive].knob: config.keepalive_knob}
    ladder = config.keepalive in ("ladder", "ladder-cold")
    preset = load_preset(config.keepalive_preset) if ladder else None
    try:
        policy: KeepAlivePolicy
        if preset is not None:
            policy = preset.ladder(cold=config.keepalive == "ladder-cold", costs=rung_costs(config),
                                   **knob)
        else:
            policy = make_policy(config.keepalive, **knob)
        policy.plan(policy.new_history())   # a knob out of the policy's range fails here, at start, not on a tick
    except InvalidInput as err:
        raise InvalidInput(f"keepalive_knob: {err.message}" if knob else err.message) from None
    return policy
