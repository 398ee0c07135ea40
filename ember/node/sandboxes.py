"""A node's sandboxes for its templates and instances: the cgroups it makes (memory, pids, cpu), moves processes into,
empties and removes, and what each model's sandbox could not enforce on this machine (logged once per model).
`LocalNode` holds one."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection
from dataclasses import replace
from typing import Any, Protocol

from ember.node.cgroups import Cgroups, CpuShare, ProcessCgroup
from ember.node.sandbox import SandboxPlan, plan_for, skipped_steps
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.node")


class Sandboxed(Protocol):
    """What of a process record (a template's, an instance's) the sandboxes read and write."""

    tag: str
    model_key: str
    pid: int
    hello: dict[str, Any]
    cgroup: ProcessCgroup | None
    memory_mb: int


class Sandboxes:
    """`hidden`: what no sandboxed process may see, even inside a directory it reads (the node's state). Each
    plan hides the directories of the other models' contracts too (a path entry such as `$HOME` holding them all:
    each covered, its secrets with it)."""

    def __init__(self, hidden: tuple[str, ...] = ()) -> None:
        self._cgroups: Cgroups | str | None = None   # opened at the first sandboxed start (str: why not)
        self._logged: set[str] = set()
        self._hidden = hidden
        self._contract_dirs: dict[str, str] = {}     # model key -> its contract's directory

    def deployed(self, contract: ModelContract) -> None:
        """A model on this node: its contract's directory is hidden from every other model's processes."""
        if contract.source:
            self._contract_dirs[contract.key] = os.path.abspath(os.path.dirname(contract.source))

    def released(self, model_key: str) -> None:
        self._contract_dirs.pop(model_key, None)

    def hidden_from(self, contract: ModelContract) -> tuple[str, ...]:
        """What `contract`'s processes must not see: the node's state and the other models' contract
        directories (not one that is its own too)."""
        self.deployed(contract)
        own = self._contract_dirs.get(contract.key)
        others = {d for key, d in self._contract_dirs.items() if key != contract.key and d != own}
        return (*self._hidden, *sorted(others))

    def plan(self, proc: Sandboxed, contract: ModelContract, writable: tuple[str, ...] = ()) -> SandboxPlan:
        """The process's sandbox: its model's user, its cgroups (made here), what it reads (and, for a template,
        the directory it binds its replicas' sockets in)."""
        if self._cgroups is None:
            self._cgroups = Cgroups.open()
            if isinstance(self._cgroups, str):
                log.warning("sandbox: no memory cgroups (%s): instances limit their address space instead",
                            self._cgroups)
        memory_mb = contract.resources.memory_mb
        if isinstance(self._cgroups, Cgroups):
            try:
                proc.cgroup = self._cgroups.create(_cgroup_name(proc.tag), memory_mb, contract.sandbox.pids,
                                                   cpu_share(contract))
                proc.memory_mb = memory_mb
            except OSError as err:
                log.warning("sandbox: no memory cgroup for %s: %s", proc.tag, err)
        self._check_cpu(proc, contract)
        plan = plan_for(contract, None if proc.cgroup is None else proc.cgroup.memory, self.hidden_from(contract))
        return plan if not writable else replace(plan, writable=writable)

    def _check_cpu(self, proc: Sandboxed, contract: ModelContract) -> None:
        """Once per model: a cpu share its contract asks for that no cgroup carries out here."""
        key = f"cpu:{contract.key}"
        if cpu_share(contract).default or (proc.cgroup is not None and proc.cgroup.cpu is not None) \
                or key in self._logged:
            return
        self._logged.add(key)
        log.warning("model '%s': resources.cpu_weight / cpu_max not enforced: no cpu cgroup here (sandbox off, or "
                    "no cpu controller)", contract.key)

    @staticmethod
    def attach(proc: Sandboxed) -> asyncio.Future[str | None]:
        """Move the new process into its cgroups while it starts (see `ember.node.cgroups`): resolves to
        None once it is in, or to why it is not."""
        async def attach(group: ProcessCgroup) -> str | None:
            try:
                await asyncio.to_thread(Cgroups.attach, group, proc.pid)
            except OSError as err:
                return f"cannot move pid {proc.pid} into {group.memory}: {err.strerror or err}"
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
        if why_not is not None:
            report["skipped"]["memory:cgroup"] = why_not
            return
        report["enforced"].append("memory:cgroup")
        if proc.cgroup.pids is not None:
            report["enforced"].append("pids:cgroup")
        else:
            report["skipped"]["pids:cgroup"] = "no pids cgroup controller here"
        if proc.cgroup.cpu is not None:
            report["enforced"].append("cpu:cgroup")

    def log_once(self, model_key: str, report: object) -> None:
        """Once per model: what its sandbox could not enforce on this machine."""
        if not isinstance(report, dict) or model_key in self._logged:
            return
        self._logged.add(model_key)
        missing = skipped_steps(report)
        if missing:
            log.warning("model '%s': sandbox: %s", model_key, missing)

    def release(self, proc: Sandboxed, known: Collection[int] = ()) -> None:
        """A process gone: say whether its cgroup killed it for its memory, kill what it left behind (a daemon;
        `known`: its children the node knows of, dying with it, which a fork leaves in its cgroup until the node's
        move lands: killed, not reported), remove its cgroups."""
        if proc.cgroup is None or not isinstance(self._cgroups, Cgroups):
            return
        if self._cgroups.oom_killed(proc.cgroup):
            log.warning("%s of '%s' was killed for going over its contract's memory_mb (%d MB)",
                        proc.tag, proc.model_key, proc.memory_mb)
        left = Cgroups.kill_left(proc.cgroup) - set(known)
        if left:
            log.warning("%s of '%s' left %d process(es) behind: killed", proc.tag, proc.model_key, len(left))
        self._cgroups.remove_group(proc.cgroup)
        proc.cgroup = None

    async def close(self) -> None:
        """Remove the node's cgroups (killed instances leave theirs once reaped: a moment)."""
        if isinstance(self._cgroups, Cgroups):
            for _ in range(50):
                if self._cgroups.close():
                    break
                await asyncio.sleep(0.02)


def cpu_share(contract: ModelContract) -> CpuShare:
    return CpuShare(contract.resources.cpu_weight, contract.resources.cpu_max)


def _cgroup_name(tag: str) -> str:
    """A cgroup directory's name for a process tag ("template:iris:1" has colons; a name may not have a slash)."""
    return tag.replace("/", "_")
