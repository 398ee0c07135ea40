"""A node's sandboxes for its instances: the memory cgroups it makes, moves instances into and removes, and what
each model's sandbox could not enforce on this machine (logged once per model). `LocalNode` holds one."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from ember.node.cgroups import MemoryCgroups
from ember.node.sandbox import SandboxPlan, plan_for, skipped_steps
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.node")


class Sandboxed(Protocol):
    """What of an instance's process record the sandboxes read and write."""

    tag: str
    model_key: str
    pid: int
    hello: dict[str, Any]
    cgroup: Path | None
    memory_mb: int


class Sandboxes:
    def __init__(self) -> None:
        self._cgroups: MemoryCgroups | str | None = None   # opened at the first sandboxed start (str: why not)
        self._logged: set[str] = set()

    def plan(self, proc: Sandboxed, contract: ModelContract) -> SandboxPlan:
        """The instance's sandbox: its model's user, its memory cgroup (made here), what it reads afterwards."""
        if self._cgroups is None:
            self._cgroups = MemoryCgroups.open()
            if isinstance(self._cgroups, str):
                log.warning("sandbox: no memory cgroups (%s): instances limit their address space instead",
                            self._cgroups)
        memory_mb = contract.resources.memory_mb
        if isinstance(self._cgroups, MemoryCgroups):
            try:
                proc.cgroup, proc.memory_mb = self._cgroups.create(proc.tag, memory_mb), memory_mb
            except OSError as err:
                log.warning("sandbox: no memory cgroup for %s: %s", proc.tag, err)
        return plan_for(contract, proc.cgroup)

    @staticmethod
    def attach(proc: Sandboxed) -> asyncio.Future[str | None]:
        """Move the new instance into its memory cgroup while it starts (see `ember.node.cgroups`): resolves to
        None once it is in, or to why it is not."""
        async def attach(path: Path) -> str | None:
            try:
                await asyncio.to_thread(MemoryCgroups.attach, path, proc.pid)
            except OSError as err:
                return f"cannot move pid {proc.pid} into {path}: {err.strerror or err}"
            return None

        if proc.cgroup is None:
            done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return asyncio.ensure_future(attach(proc.cgroup))

    @staticmethod
    def record(proc: Sandboxed, why_not: str | None) -> None:
        """Add the cgroup's outcome to the sandbox report the instance sent in its hello."""
        report = proc.hello.get("sandbox")
        if proc.cgroup is None or not isinstance(report, dict):
            return
        if why_not is None:
            report["enforced"].append("memory:cgroup")
        else:
            report["skipped"]["memory:cgroup"] = why_not

    def log_once(self, model_key: str, report: object) -> None:
        """Once per model: what its sandbox could not enforce on this machine."""
        if not isinstance(report, dict) or model_key in self._logged:
            return
        self._logged.add(model_key)
        missing = skipped_steps(report)
        if missing:
            log.warning("model '%s': sandbox: %s", model_key, missing)

    def release(self, proc: Sandboxed) -> None:
        """An instance gone: say whether its cgroup killed it for its memory, and remove the cgroup."""
        if proc.cgroup is None or not isinstance(self._cgroups, MemoryCgroups):
            return
        if self._cgroups.oom_killed(proc.cgroup):
            log.warning("instance %s of '%s' was killed for going over its contract's memory_mb (%d MB)",
                        proc.tag, proc.model_key, proc.memory_mb)
        self._cgroups.remove(proc.cgroup)
        proc.cgroup = None

    async def close(self) -> None:
        """Remove the node's cgroups (killed instances leave theirs once reaped: a moment)."""
        if isinstance(self._cgroups, MemoryCgroups):
            for _ in range(50):
                if self._cgroups.close():
                    break
                await asyncio.sleep(0.02)
