"""The node's record of each process it started (a zygote, a template or an instance), and what the node does to
one directly: signal it, measure its memory, exchange a control frame with it."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.core.states import Rung
from ember.errors import ModelFailed, WorkerCrashed
from ember.node import procinfo
from ember.node.api import MemoryUsage
from ember.node.cgroups import ProcessCgroup
from ember.node.framing import Frame, Header
from ember.node.link import Link
from ember.node.replies import error_from
from ember.wire.contract import ModelContract


@dataclass(eq=False)
class NodeProcess:
    """A process this node started: a zygote, a template or an instance."""

    tag: str                      # "zygote:RUNTIME", "template:MODEL_KEY" or the instance id
    kind: str                     # "zygote", "template" or "instance"
    sock: Path
    parent: NodeProcess | None
    exited: asyncio.Future[int]
    model_key: str = ""
    runtime: str = ""             # an instance's model's runtime
    contract: ModelContract | None = None   # an instance's model
    rung: Rung | None = None
    pid: int = 0
    link: Link | None = None
    process: asyncio.subprocess.Process | None = None   # zygotes: our own child
    hello: Header = field(default_factory=dict)
    cgroup: ProcessCgroup | None = None                  # sandboxed templates and instances: their cgroups
    replica_dir: Path | None = None                      # a sandboxed template: where it binds replicas' sockets
    own_pidns: bool = False                              # restored from an image: the root of a pid namespace
    ns_pid: int = 0                                      # a restored template's replica: its pid in that namespace
    restorer: int = 0                                    # restored: the `criu restore` it is a child of (its cgroups)
    memory_mb: int = 0
    ready: bool = False
    retiring: bool = False


def signal_process(proc: NodeProcess, signum: signal.Signals) -> None:
    """WorkerCrashed when the process is gone."""
    try:
        os.kill(proc.pid, signum)
    except ProcessLookupError:
        raise WorkerCrashed(f"instance {proc.tag} (pid {proc.pid}) is gone") from None


async def control(proc: NodeProcess, header: Header, timeout_s: float) -> Frame:
    """One control exchange with an instance (sleep, wake); an error frame raised as the error it names, no answer
    within `timeout_s` as ModelFailed (its caller recycles it: stopping kills what does not drain)."""
    if proc.retiring or proc.link is None:
        raise WorkerCrashed(f"instance {proc.tag} is retiring")
    try:
        reply = await asyncio.wait_for(proc.link.call(header), timeout_s)
    except TimeoutError:
        raise ModelFailed(f"instance {proc.tag}: no answer to {header.get('op')} in {timeout_s:g} s") from None
    if reply.op == "error":
        raise error_from(reply.header)
    return reply


def memory_of_process(proc: NodeProcess) -> MemoryUsage:
    """WorkerCrashed when the process is gone."""
    try:
        return replace(procinfo.memory_of(proc.pid), pid=proc.pid)
    except (ProcessLookupError, PermissionError):
        raise WorkerCrashed(f"{proc.kind} {proc.tag} (pid {proc.pid}) is gone") from None
