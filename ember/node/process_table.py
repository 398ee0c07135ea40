"""The node's processes: each one's record, its connection and hello, and its exit.

Every process listens on a Unix socket under `state_dir/run` and greets the node's connection with a hello once
ready. The node keeps one connection per process; replies are matched to requests by id, so calls to different
instances proceed concurrently and nothing blocks the event loop. Zygotes and templates reap their children and
send exit events (a restored template, in a pid namespace of its own, names them by their pid there: `host_pid`);
an instance's EOF fails its in-flight requests with WorkerCrashed at once. `ember.node.local_node` decides what
runs; this module keeps track of what does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from ember.errors import ContractInvalid, InvalidInput, ModelNotReady, WorkerCrashed
from ember.node import procinfo
from ember.node.api import ExitCallback
from ember.node.framing import HEADERS_ONLY, Header, read_frame
from ember.node.instance import payload_limits
from ember.node.link import Link
from ember.node.polling import PollPolicy, ReplyPoller
from ember.node.processes import NodeProcess
from ember.node.replies import describe_status
from ember.node.sandboxes import Sandboxes

log = logging.getLogger("ember.node")

KILLED = -int(signal.SIGKILL)


class ProcessTable:
    """The live processes a node started, by tag ("zygote:RUNTIME", "template:KEY", instance id)."""

    def __init__(self, run_dir: Path, sandboxes: Sandboxes, polls: PollPolicy, max_reply_bytes: int | None,
                 ready_timeout_s: float) -> None:
        self.run_dir = run_dir
        self._sandboxes, self._polls = sandboxes, polls
        self._max_reply_bytes, self._ready_timeout_s = max_reply_bytes, ready_timeout_s
        self.procs: dict[str, NodeProcess] = {}
        self.callbacks: list[ExitCallback] = []     # told of each instance's exit (not a stop's)
        self.exit_statuses: dict[str, int] = {}
        self.closing = False
        self.tasks: set[asyncio.Task[None]] = set()   # strong references until done

    def new(self, tag: str, kind: str, sock_name: str, parent: NodeProcess | None, **extra: Any) -> NodeProcess:
        if self.closing:
            raise ModelNotReady("node: closing")
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_dir.chmod(0o700)   # the node's sockets: for the node alone
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        proc = NodeProcess(tag=tag, kind=kind, sock=self.run_dir / sock_name, parent=parent, exited=exited, **extra)
        self.procs[tag] = proc
        return proc

    def spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    def host_pid(parent: NodeProcess, pid: int) -> int:
        """A fork server's child's pid here: a restored template forks in a pid namespace of its own."""
        return procinfo.child_in_namespace(parent.pid, pid) if parent.own_pidns else pid

    async def fork_and_greet(self, proc: NodeProcess, what: str, command: Header) -> None:
        parent = proc.parent
        assert parent is not None and parent.link is not None
        try:
            reply = await parent.link.call({"op": "fork", "tag": proc.tag, "sock": str(proc.sock), **command})
            if reply.op != "forked":
                raise ModelNotReady(f"{what}: fork failed: {reply.header.get('message')}")
            proc.pid = self.host_pid(parent, int(reply.header["pid"]))
            if parent.own_pidns:
                proc.ns_pid = int(reply.header["pid"])
            if not proc.pid:   # not found in its parent's namespace: reaped already (pid 0 would name the node)
                raise ModelNotReady(f"{what}: exited while starting")
            self.check_not_stopped(proc, what)
            await self.attach_and_greet(proc, what)
        except BaseException as err:
            await self.kill_and_wait(proc)
            if isinstance(err, WorkerCrashed):
                raise ModelNotReady(f"{what}: {err}") from None
            raise

    async def attach_and_greet(self, proc: NodeProcess, what: str) -> None:
        """A new process (its pid known): into its cgroups while it starts, then its hello."""
        attached = self._sandboxes.attach(proc)
        try:
            await self.greet(proc, what)
        finally:
            why_not = await attached
        self._sandboxes.record(proc, why_not)
        self.check_not_stopped(proc, what)

    @staticmethod
    def check_not_stopped(proc: NodeProcess, what: str) -> None:
        """`stop` or `release` reached the process while it was starting: it must not serve."""
        if proc.retiring or proc.exited.done():
            raise ModelNotReady(f"{what}: stopped while starting")

    async def greet(self, proc: NodeProcess, what: str) -> None:
        """Connect to the process and wait for its hello; ModelNotReady (naming the cause) otherwise."""
        try:
            reader, writer = await asyncio.open_unix_connection(str(proc.sock))
        except OSError as err:
            raise ModelNotReady(f"{what}: cannot connect: {err}") from None
        try:
            frame = await asyncio.wait_for(read_frame(reader, HEADERS_ONLY), self._ready_timeout_s)
        except TimeoutError:
            writer.close()
            raise ModelNotReady(f"{what}: not ready after {self._ready_timeout_s:g} s") from None
        except (InvalidInput, OSError):
            frame = None
        if frame is None or not frame.header.get("ok"):
            writer.close()
            if frame is not None:
                message = f"{what}: {frame.header.get('message', 'failed to start')}"
                if frame.header.get("kind") == "ContractInvalid":   # the model does not match its contract
                    raise ContractInvalid(message)
                raise ModelNotReady(message)
            status = await self.exit_status_soon(proc)
            raise ModelNotReady(f"{what}: exited while starting ({describe_status(status)})")
        proc.hello = frame.header
        name = f"{proc.kind} {proc.tag} (pid {proc.pid})"
        poller = ReplyPoller(self._polls) if proc.kind == "instance" else None
        # Zygotes and templates send headers only; an instance, its replies and what it keeps on draining.
        limits = (payload_limits(proc.contract, self._max_reply_bytes)
                  if proc.kind == "instance" and proc.contract is not None else HEADERS_ONLY)
        proc.link = Link(name, reader, writer, lambda header: self._event(proc, header),
                          lambda: self._link_closed(proc), poller, limits)
        proc.ready = True

    async def exit_status_soon(self, proc: NodeProcess, wait_s: float = 2.0) -> int | None:
        try:
            return await asyncio.wait_for(asyncio.shield(proc.exited), wait_s)
        except TimeoutError:
            return None

    def _event(self, parent: NodeProcess, header: Header) -> None:
        if header.get("op") == "forked":
            self._orphan(header, parent)
            return
        if header.get("op") != "exit":
            return
        proc = self.procs.get(str(header.get("tag")))
        # pid 0: the exit overtook the fork reply on its way to the waiting coroutine.
        if proc is not None and proc.parent is parent and (proc.ns_pid or proc.pid) in (0, header.get("pid")):
            self.gone(proc, int(header.get("status", KILLED)))

    @classmethod
    def _orphan(cls, header: Header, parent: NodeProcess) -> None:
        """A fork reply nobody waits for (the start was cancelled): its child would serve no one."""
        pid = header.get("pid")
        if isinstance(pid, int) and pid > 0 and (pid := cls.host_pid(parent, pid)):
            log.warning("killing %s (pid %d): its start was abandoned", header.get("tag", "a child"), pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _link_closed(self, proc: NodeProcess) -> None:
        """A connection ended. A dead child's exit event follows from its parent; a fork server's
        children died with it (PDEATHSIG), and its own status comes from its parent or its process."""
        if not proc.exited.done() and not self.closing:
            self.spawn_task(self._settle(proc))

    async def _settle(self, proc: NodeProcess) -> None:
        broken = proc.link.broken if proc.link is not None else None
        if broken is not None and proc.pid:   # it broke its protocol: it is not to be trusted with more
            log.warning("%s %s (pid %d) sent a frame its protocol does not allow (%s); killing it",
                        proc.kind, proc.tag, proc.pid, broken)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        if proc.process is not None:
            self.gone(proc, await proc.process.wait())
            return
        status = await self.exit_status_soon(proc)
        if status is None:
            # No exit event: the process lives on without a connection (a broken link, a bad
            # frame). Nobody can reach it any more, so it must not keep its slice and memory.
            log.warning("%s %s (pid %d) lost its connection; killing it", proc.kind, proc.tag, proc.pid)
            await self.kill_and_wait(proc)
        else:
            self.gone(proc, status)

    def gone(self, proc: NodeProcess, status: int) -> None:
        """Record an exit (once), forget the process and everything that died with it."""
        if proc.exited.done():
            return
        proc.exited.set_result(status)
        if self.procs.get(proc.tag) is proc:
            del self.procs[proc.tag]
        if proc.link is not None:
            proc.link.close()
        with contextlib.suppress(OSError):
            proc.sock.unlink()
        children = [p for p in self.procs.values() if p.parent is proc]
        for child in children:
            self.gone(child, KILLED)
        self._sandboxes.release(proc, known={child.pid for child in children} | {proc.pid, proc.restorer})
        if proc.replica_dir is not None:
            shutil.rmtree(proc.replica_dir, ignore_errors=True)
        if proc.kind != "instance":
            if proc.ready and not proc.retiring:
                log.warning("%s %s (pid %d) exited: %s", proc.kind, proc.tag, proc.pid, describe_status(status))
            return
        self.exit_statuses[proc.tag] = status
        if proc.ready and not proc.retiring and not self.closing:
            for callback in list(self.callbacks):
                try:
                    callback(proc.tag, status)
                except Exception:
                    log.exception("on_exit callback failed for instance %s", proc.tag)

    async def kill_and_wait(self, proc: NodeProcess, wait_s: float = 5.0) -> None:
        if proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            status = await self.exit_status_soon(proc, wait_s)
            self.gone(proc, KILLED if status is None else status)
        else:
            self.gone(proc, KILLED)

    def instance(self, instance_id: str) -> NodeProcess:
        proc = self.procs.get(instance_id)
        if proc is None or proc.kind != "instance" or not proc.ready:
            raise WorkerCrashed(f"instance {instance_id} is not running on this node")
        return proc

