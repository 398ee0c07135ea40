"""A controller on fakes: a FakeNode, a real SQLite job store, a FakeClock and contracts written to a folder."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.slices import cpu_slices
from ember.jobs.store import JobStore
from ember.keepalive.arrivals import LadderForecast
from ember.metrics import Metrics
from ember.serving.controller import Controller, ControllerSettings
from ember.serving.ports import Tracer
from ember.serving.repository import Repository
from ember.serving.results import InferResult, JobStatus
from ember.testing.clock import FakeClock
from ember.testing.node import FakeNode

CONTRACT = """\
name: {name}
runtime: python
entrypoint: mod:Model
inputs: [{{name: x, datatype: FP32, shape: [-1, 2]}}]
outputs: [{{name: y, datatype: FP32, shape: [-1]}}]
resources: {{memory_mb: {memory}}}
scaling: {{max_scale: {max_scale}, min_scale: {min_scale}, pause_after_s: 2, max_idle_s: 60,
          keep_template: {template}, target_concurrency: {concurrency}{extra}}}
"""

X = {"x": np.ones((3, 2), np.float32)}


def contract_text(name: str, *, memory: int = 512, max_scale: int = 2, min_scale: int = 0, template: bool = True,
                  concurrency: int = 1, max_concurrency: int | None = None) -> str:
    return CONTRACT.format(
        name=name, memory=memory, max_scale=max_scale, min_scale=min_scale, template=str(template).lower(),
        concurrency=concurrency, extra=f", max_concurrency: {max_concurrency}" if max_concurrency else "")


def write(tmp: Path, name: str, **scaling: Any) -> None:
    """`models/NAME.yaml` under `tmp`, from `contract_text`."""
    (tmp / "models").mkdir(exist_ok=True)
    (tmp / "models" / f"{name}.yaml").write_text(contract_text(name, **scaling))


class World:
    def __init__(self, tmp: Path, slots: int = 2, tracer: Tracer | None = None, **settings: Any) -> None:
        self.clock = FakeClock()
        self.node = FakeNode()
        self.jobs = JobStore(tmp / "jobs.sqlite3", max_queued=10, result_ttl_s=60)
        self.metrics = Metrics()
        defaults: dict[str, Any] = {"queue_wait_s": 0.05, "request_timeout_s": 5, "forecast": LadderForecast()}
        defaults.update(settings)
        self.ctl = Controller(self.node, self.jobs, self.metrics, self.clock, cpu_slices(slots, 1024),
                              Repository([tmp / "models"]), ControllerSettings(**defaults), tracer)

    async def run_for(self, seconds: float, step: float = 1.0) -> None:
        """Let time pass the way the live server does: a tick every `step` seconds."""
        for _ in range(int(seconds / step)):
            self.clock.advance(step)
            await self.ctl.tick()
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)

    async def infer(self, name: str = "m") -> InferResult:
        result = await self.ctl.infer(self.ctl.contract(name), X)
        assert isinstance(result, InferResult)
        return result


async def settle(w: World, job_id: str, state: str, tries: int = 50, tick: bool = False) -> JobStatus:
    """Let the event loop (and, with `tick`, the controller's ticks) run until the job reaches `state`."""
    for _ in range(tries):
        if tick:
            await w.ctl.tick()
        await asyncio.sleep(0.02)
        if w.ctl.job(job_id).state == state:
            break
    return w.ctl.job(job_id)
