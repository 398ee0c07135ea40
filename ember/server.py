"""The one place ember is wired together: config -> node, jobs, metrics, controller, gateway."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import uvicorn
from starlette.applications import Starlette

from ember.clock import SystemClock
from ember.config import DEFAULT_GRPC_PORT, ServeConfig, idle_forecast, keepalive_policy, warm_pool_settings
from ember.core.ratelimit import RateLimiter
from ember.core.slices import Slice, cpu_slices, node_cpu_slices
from ember.errors import InvalidInput
from ember.gateway import prompt_check
from ember.gateway.access_log import AccessLog
from ember.gateway.app import create_app
from ember.gateway.auth import Auth, HostCheck
from ember.gateway.connections import connection_cap, guarded_protocol, raise_open_files_limit, uvicorn_limits
from ember.gateway.grpc_server import GrpcServer, GrpcSettings
from ember.gateway.service import Service
from ember.gateway.ui import app_sampler
from ember.jobs.store import JobStore
from ember.keys.store import KeyRing, KeyRings, SharedKeyRing, keys_path
from ember.metrics import Metrics
from ember.node.local_node import LocalNode
from ember.serving.bundles import StoreBundles
from ember.serving.controller import Controller, ControllerSettings
from ember.serving.repository import Repository
from ember.serving.state_lock import lock_state_dir, unlock_state_dir
from ember.store.shared import SharedChunks
from ember.tls import NodeTls
from ember.wire.contract import example_contracts_dir

if TYPE_CHECKING:
    from ember.jobs.postgres import PgJobStore
    from ember.store import WeightStore
    from ember.store.tiers.peer import FetchGate, PeerDirectory
    from ember.tracing import OtelTracer

log = logging.getLogger("ember.server")


def build_app(config: ServeConfig) -> Starlette:
    """The ASGI app with a lifespan that starts the node and deploys the models."""
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    # One server per state dir, before the job store opens (a second would requeue the first's running jobs).
    state_lock = lock_state_dir(state_dir)
    attached = None
    if config.ray is not None:   # many machines: Ray is imported only here (and the cluster's token taken)
        from ember.cluster.join import attach

        attached = attach(config)
        config = attached.config
    metrics = Metrics()
    jobs = job_store(config, state_dir)
    node = LocalNode(state_dir, store=config.store_config(), poll_s=config.idle_poll_us / 1e6,
                     sandbox=config.sandbox, store_peers=attached.peers if attached else None,
                     store_gate=attached.gate if attached else None,
                     max_reply_bytes=int(config.max_inflight_mb * 2**20),   # a reply within the body budget
                     snapshots=config.snapshots)
    slices = _slices(config)
    settings = ControllerSettings(request_timeout_s=config.request_timeout_s, queue_wait_s=config.queue_wait_s,
                                  overload_wait_s=config.overload_wait_s,
                                  tick_s=config.tick_s, keepalive=keepalive_policy(config),
                                  warm_pool=warm_pool_settings(config), forecast=idle_forecast(config),
                                  shared_jobs=config.jobs_url is not None,
                                  max_reply_bytes=int(config.max_inflight_mb * 2**20))
    tracer = _tracer(config)
    bundles = _bundles(config, attached.peers if attached else None, attached.gate if attached else None)
    prompt_check.read_store_with(bundles.store)   # a store: model's vocabulary, for the gateway's prompt check
    controller = Controller(node, jobs, metrics, SystemClock(), slices, repository(config, bundles), settings, tracer)
    service: Service = controller
    background: list[Coroutine[Any, Any, None]] = []
    cluster = None
    if attached is not None:
        from ember.cluster.join import join

        cluster, background = join(attached, controller)
        service = cluster
    access = AccessLog(config.access_log) if config.access_log is not None else None
    app = create_app(service, metrics, max_body_bytes=int(config.max_body_mb * 2**20),
                     max_inflight_bytes=int(config.max_inflight_mb * 2**20), body_timeout_s=config.body_timeout_s,
                     body_min_rate=config.body_min_rate_kbs * 1024, body_deadline_s=config.body_deadline_s,
                     access_log=access, tracer=tracer, auth=(auth := _auth(config, state_dir)),
                     chunks=SharedChunks(config.store_config()))
    if cluster is not None:
        from ember.gateway.cluster_api import cluster_routes

        app.router.routes.extend(cluster_routes(cluster, nodes_only=config.tls_dir is not None))

    shutdown = Shutdown(controller, config.shutdown_grace_s)
    app.state.shutdown = shutdown

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # Deploy in the background: the server answers health checks while models load,
        # and /v2/health/ready turns true once every model has a local rung.
        deploying = asyncio.ensure_future(controller.deploy_all())
        ticking = asyncio.ensure_future(controller.run())
        sampling = app_sampler(app).start(app.state.gateway)   # the status page's last ten minutes, from the start
        tasks = [deploying, ticking, sampling, *(asyncio.ensure_future(work) for work in background)]
        try:
            yield
        finally:
            # Requests have drained (uvicorn waits for them within the grace); running jobs get what is left of
            # it, with the tick still going (it renews their leases), then whatever still runs is cut off.
            shutdown.begin()
            await controller.drain(shutdown.left_s())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if cluster is not None:
                await cluster.close()
            await controller.close()
            bundles.close()
            jobs.close()
            if isinstance(auth.keys, KeyRings):
                auth.keys.close()
            if tracer is not None:
                tracer.close()
            unlock_state_dir(state_lock)

    app.router.lifespan_context = lifespan
    return app


class Shutdown:
    """The grace period of a graceful shutdown, from the signal (or the lifespan's end, without one)."""

    def __init__(self, controller: Controller, grace_s: float) -> None:
        self.controller, self.grace_s = controller, grace_s
        self.since: float | None = None

    def begin(self) -> None:
        """Claim no more jobs; the grace starts now. Sets flags only: called from the signal handler."""
        if self.since is None:
            self.since = time.monotonic()
            self.controller.stop_claiming()

    def left_s(self) -> float:
        return self.grace_s if self.since is None else max(0.0, self.grace_s - (time.monotonic() - self.since))


class _Server(uvicorn.Server):
    """uvicorn's server, which also stops job claims the moment SIGTERM (or SIGINT) arrives, and runs the gRPC port
    beside the HTTP one: bound once HTTP is, stopped with it (both drained before the app's lifespan ends)."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown, grpc: GrpcServer | None = None) -> None:
        super().__init__(config)
        self.shutdown_grace = shutdown
        self.grpc = grpc
        self.failure: InvalidInput | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.shutdown_grace.begin()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.grpc is None or not self.started:
            return
        try:
            await self.grpc.start()
        except InvalidInput as err:   # the port is taken: stop again, and `serve` says why
            self.failure, self.should_exit = err, True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:   # counted among uvicorn's tasks: the lifespan ends once gRPC has drained too
            stopping = asyncio.ensure_future(self.grpc.stop(self.shutdown_grace.left_s()))
            self.server_state.tasks.add(stopping)
            stopping.add_done_callback(self.server_state.tasks.discard)
        await super().shutdown(sockets)


def job_store(config: ServeConfig, state_dir: Path) -> JobStore | PgJobStore:
    """SQLite in the state dir (one node), or PostgreSQL shared by several (`jobs_url`; the ember[postgres] extra)."""
    if config.jobs_url is None:
        return JobStore(state_dir / "jobs.sqlite3", max_queued=config.max_queued_jobs,
                        result_ttl_s=config.job_result_ttl_s)
    try:
        from ember.jobs.postgres import PgJobStore
    except ImportError as err:
        raise InvalidInput(f"jobs_url: the shared job store needs psycopg: pip install 'ember[postgres]' ({err})") \
            from None
    # This server's claims are requeued by its successor (same machine, same state dir), no one else's.
    node = f"{socket.gethostname()}-{hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]}"
    store = PgJobStore(config.jobs_url.get_secret_value(), max_queued=config.max_queued_jobs,
                       result_ttl_s=config.job_result_ttl_s, node=node)
    log.info("jobs: shared PostgreSQL store %s (this node: %s); delivery is at least once", store.where, node)
    return store


def repository(config: ServeConfig, bundles: StoreBundles | None = None) -> Repository:
    """The contracts of `--models` (paths, and contract directories from the weight store) and the bundled examples
    (unless `--no-examples`): a first run with a model of one's own still has the examples to compare with."""
    return Repository(list(config.models), [example_contracts_dir()] if config.examples else [],
                      refs=config.store_models, bundles=bundles)


def _bundles(config: ServeConfig, peers: PeerDirectory | None, gate: FetchGate | None) -> StoreBundles:
    """Contract directories from this node's weight store (its peers, then the origin), opened on first use. Disk
    tier only: the files are written out of it, and the node's own store keeps the memory tier."""
    store_config = config.store_config().model_copy(update={"memory_dir": None})

    def open_store() -> WeightStore:
        from ember.store import WeightStore

        return WeightStore(store_config, peers=peers, gate=gate)

    return StoreBundles(open_store)


def _tracer(config: ServeConfig) -> OtelTracer | None:
    """OpenTelemetry traces when asked for; the packages are imported only then (the `ember[otel]` extra)."""
    if not config.otel:
        return None
    try:
        from ember.tracing import OtelTracer, exporting_provider
    except ImportError as err:
        raise InvalidInput(f"otel: traces need the OpenTelemetry packages: pip install 'ember[otel]' ({err}); "
                           "or turn them off (no --otel, OTEL_TRACES_EXPORTER=none)") from None
    return OtelTracer(exporting_provider())


def _auth(config: ServeConfig, state_dir: Path) -> Auth:
    limit = config.rate_limit()
    limiter = RateLimiter(limit) if limit is not None else None
    rate = f"; rate limit {limit.rate:g} requests/s per tenant, burst {limit.burst}" if limit else ""
    token = config.cluster_token.get_secret_value() if config.cluster_token is not None else None
    hosts = host_check(config)
    if not config.auth_enabled:
        why = "--auth off" if config.auth == "off" else f"loopback bind {config.host}"
        log.info("authentication: off (%s; --auth on to require API keys)%s", why, rate)
        return Auth(None, limiter, cluster_token=token, hosts=hosts)
    file = KeyRing(keys_path(state_dir))
    shared = _shared_keys(config)
    ring = KeyRings([file] if shared is None else [file, shared])
    where = str(file.path) + ("" if shared is None else f" and {shared.where}")
    why = "--auth on" if config.auth == "on" else f"bind {config.host} is not loopback"
    log.info("authentication: on (%s): %d active API keys in %s%s", why, ring.active(), where, rate)
    if ring.active() == 0:
        log.warning("authentication is on and there is no API key: every request but health checks will answer "
                    "401; create one with `ember keys create --state-dir %s --tenant NAME --role admin`", state_dir)
    return Auth(ring, limiter, cluster_token=token, hosts=hosts)


def _shared_keys(config: ServeConfig) -> SharedKeyRing | None:
    """A cluster's keys (ember/keys/store.py): in the shared job database, else (a Ray cluster without one) Ray's KV."""
    if config.jobs_url is not None:
        from ember.keys.postgres import PgKeys

        keys = PgKeys(config.jobs_url.get_secret_value())
        return SharedKeyRing(keys, f"the job database {keys.where}")
    if config.ray is not None:
        from ember.cluster.keys_kv import RayKeys

        return SharedKeyRing(RayKeys(), "Ray's KV")
    return None


def host_check(config: ServeConfig) -> HostCheck | None:
    """The Host names the gateway answers to (None: any). By default checked while keys are off: a DNS rebinding
    page (its own name resolved to this server) would otherwise pass the cross-site check with keys off. Names:
    localhost, this machine's, the bind and advertised hosts, and --allowed-hosts; any IP address passes."""
    if config.allowed_hosts is None and config.auth_enabled:
        return None
    extra = config.allowed_hosts or ()
    if "*" in extra:
        log.info("Host check: off (--allowed-hosts '*')")
        return None
    names = ["localhost", ".localhost", socket.gethostname(), config.host, *extra]
    if config.advertise_url is not None:
        names.append(urlsplit(config.advertise_url).hostname or "")
    check = HostCheck.of(names)
    log.info("Host check: IP addresses and %s (--allowed-hosts adds names)",
             ", ".join(sorted(check.names) + [f"*{s}" for s in check.suffixes]))
    return check


def _slices(config: ServeConfig) -> list[Slice]:
    slots = cpu_slices(config.cpu_slots, config.slot_memory_mb)
    # Only the cores this process may run on (a container's cpuset is rarely 0..n-1).
    cores = sorted(os.sched_getaffinity(0))
    # Slot i takes the next `threads_per_slot` allowed cores (as many as there are); more slots than cores
    # oversubscribe, wrapping around.
    width = min(config.threads_per_slot, len(cores))
    slots = [replace(s, cpus=tuple(sorted({cores[(i * width + j) % len(cores)] for j in range(width)})),
                     threads=config.threads_per_slot) for i, s in enumerate(slots)]
    return node_cpu_slices(slots, config.dedicated_cpu_slots)


def _keep_off_slices(slices: list[Slice]) -> None:
    """Fewer slots than cores: the node's own processes (the gateway, zygotes, templates: everything but
    instances, which pin themselves to their slice) run on the cores no slice owns, as a kubelet's reserved CPUs,
    so that a request's HTTP work never takes an instance's core. Every thread of this process now; later
    threads and processes inherit it."""
    allowed = os.sched_getaffinity(0)
    rest = allowed - {c for s in slices for c in s.cpus}
    if not rest or rest == allowed:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):   # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), rest)
    log.info("the node's own processes run on cores %s, the ones no CPU slot owns (the slots on %d of %d cores)",
             ",".join(map(str, sorted(rest))), len(allowed) - len(rest), len(allowed))


def _grpc(config: ServeConfig, app: Starlette, max_body: int) -> GrpcServer | None:
    """The gRPC port's server: the port asked for (0: none), else the default one if it is free."""
    if config.grpc_port == 0:
        return None
    port = DEFAULT_GRPC_PORT if config.grpc_port is None else config.grpc_port
    return GrpcServer(app, GrpcSettings(config.host, port, max_body, config.tls_dir,
                                        required=config.grpc_port is not None,
                                        max_inflight_bytes=int(config.max_inflight_mb * 2**20)))


def serve(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    _keep_off_slices(_slices(config))   # once the slices are made; the process's own, never an in-process app's
    open_files = raise_open_files_limit()
    cap = connection_cap(config.max_connections, open_files)
    max_body = int(config.max_body_mb * 2**20)
    log.info("open-files limit %d; client connections capped at %d; header/body/keep-alive timeouts %g/%g/%g s; "
             "bodies at least %g KiB/s and whole within %g s", open_files, cap, config.header_timeout_s,
             config.body_timeout_s, config.http_keepalive_s, config.body_min_rate_kbs, config.body_deadline_s)
    log.info("on SIGTERM: requests and running jobs get %g s to finish (--shutdown-grace-s)", config.shutdown_grace_s)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                    lifespan="on", access_log=False,
                                    timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s),
                                    http=guarded_protocol(config.header_timeout_s, cap, max_body,
                                                         config.body_min_rate_kbs * 1024, config.body_deadline_s),
                                    **(NodeTls.of(config.tls_dir).server_kwargs() if config.tls_dir else {}),
                                    **uvicorn_limits(config.http_keepalive_s, cap)), app.state.shutdown,
                     grpc=_grpc(config, app, max_body))
    server.run()
    if server.failure is not None:
        raise server.failure
