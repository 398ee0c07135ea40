"""The one place ember is wired together: config -> node, jobs, metrics, controller, gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from ember.clock import SystemClock
from ember.config import ServeConfig, keepalive_policy
from ember.core.slices import Slice, cpu_slices
from ember.gateway.access_log import AccessLog
from ember.gateway.app import create_app
from ember.jobs import JobStore
from ember.metrics import Metrics
from ember.node.local import LocalNode
from ember.serving.controller import Controller, ControllerSettings
from ember.serving.repository import Repository
from ember.wire.contract import example_contracts_dir

log = logging.getLogger("ember.server")


def build_app(config: ServeConfig) -> Starlette:
    """The ASGI app with a lifespan that starts the node and deploys the models."""
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    sources = list(config.models) or [example_contracts_dir()]
    metrics = Metrics()
    jobs = JobStore(state_dir / "jobs.sqlite3", max_queued=config.max_queued_jobs,
                    result_ttl_s=config.job_result_ttl_s)
    node = LocalNode(state_dir, store=config.store_config(), poll_s=config.idle_poll_us / 1e6,
                     sandbox=config.sandbox)
    slices = _slices(config)
    settings = ControllerSettings(request_timeout_s=config.request_timeout_s, queue_wait_s=config.queue_wait_s,
                                  overload_wait_s=config.overload_wait_s,
                                  tick_s=config.tick_s, keepalive=keepalive_policy(config))
    controller = Controller(node, jobs, metrics, SystemClock(), slices, Repository(sources), settings)
    access = AccessLog(config.access_log) if config.access_log is not None else None
    app = create_app(controller, metrics, max_body_bytes=int(config.max_body_mb * 2**20), access_log=access)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # Deploy in the background: the server answers health checks while models load,
        # and /v2/health/ready turns true once every model has a local rung.
        deploying = asyncio.ensure_future(controller.deploy_all())
        ticking = asyncio.ensure_future(controller.run())
        try:
            yield
        finally:
            for task in (deploying, ticking):
                task.cancel()
            await asyncio.gather(deploying, ticking, return_exceptions=True)
            await controller.close()
            jobs.close()

    app.router.lifespan_context = lifespan
    return app


def _slices(config: ServeConfig) -> list[Slice]:
    slices = cpu_slices(config.cpu_slots, config.slot_memory_mb)
    # Only the cores this process may run on (a container's cpuset is rarely 0..n-1).
    cores = sorted(os.sched_getaffinity(0))
    # Slot i takes the next `threads_per_slot` allowed cores (as many as there are); more slots than cores
    # oversubscribe, wrapping around.
    width = min(config.threads_per_slot, len(cores))
    return [Slice(s.id, s.kind, s.memory_mb, tuple(sorted({cores[(i * width + j) % len(cores)] for j in range(width)})),
                  s.device, config.threads_per_slot) for i, s in enumerate(slices)]


def serve(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           lifespan="on", access_log=False, timeout_graceful_shutdown=5))
    server.run()
