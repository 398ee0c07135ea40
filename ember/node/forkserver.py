"""The single-threaded fork server that zygotes and templates run.

Forking a process that has threads can leave the child holding a lock no thread will
ever release, so this loop uses one thread only: a selector over the listening socket,
the node's control connections and a wakeup pipe for SIGCHLD.

Protocol (frames of `ember.node.framing`, headers only):
- on accept the server greets: {op: hello, ok: true, pid, threads, ...} (a template: its sandbox report)
- {op: fork, id, tag, sock, ...} -> {op: forked, id, pid} or {op: error, id, kind, message, retry_after}
  (`ember.errors.error_fields`).
  The server binds the child's listening socket at `sock` before forking, so the node can
  connect as soon as it has the reply; the child greets that connection once it is ready.
- {op: ping, id} -> {op: pong, id, threads}
- other ops the process serves itself (`ops`: a zygote's hold and drop), answered in the loop.
- events, sent to every control connection: {op: exit, tag, pid, status} when a child is
  reaped (status: exit code, or -signal).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from ember.errors import EmberError, InvalidInput, error_fields
from ember.node.child import die_with_parent, hard_exit
from ember.node.framing import Header, recv_frame, send_frame
from ember.node.procinfo import thread_count

# Runs in the forked child with the command and the child's own listening socket; never returns.
ForkHandler = Callable[[Header, socket.socket], NoReturn]


def listen_unix(path: str | Path, backlog: int = 16) -> socket.socket:
    """A listening Unix stream socket at `path` (a stale file there is replaced), for its owner only (0600)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def error_header(err: BaseException, request_id: Any = None, default: str = "ModelFailed") -> Header:
    """An error frame header: ember errors keep their class, anything else becomes `default`."""
    if isinstance(err, EmberError):
        return {"op": "error", "id": request_id, **error_fields(err)}
    text = str(err)
    return {"op": "error", "id": request_id, "kind": default,
            "message": f"{type(err).__name__}: {text}" if text else type(err).__name__}


def refuse(listener: socket.socket, err: BaseException, accept_timeout_s: float = 60.0) -> NoReturn:
    """Startup failed: tell the node why on its connection (the hello it waits for), then leave."""
    header = error_header(err, default="ModelNotReady")
    header.update(op="hello", ok=False)
    try:
        listener.settimeout(accept_timeout_s)
        conn, _ = listener.accept()
        conn.settimeout(accept_timeout_s)
        send_frame(conn, header)
    except OSError:
        pass
    hard_exit(1)


class ForkServer:
    """Serve fork commands on `listener`; `on_fork` becomes the child."""

    def __init__(self, listener: socket.socket, on_fork: ForkHandler, hello: Mapping[str, Any] | None = None,
                 ops: Mapping[str, Callable[[Header], Header]] | None = None) -> None:
        self.listener = listener
        self.on_fork = on_fork
        self.hello = dict(hello or {})   # more in the greeting (a template's sandbox report)
        self.ops = dict(ops or {})       # op -> its handler, which returns the reply's fields
        self.clients: list[socket.socket] = []
        self.children: dict[int, str] = {}   # pid -> the node's tag for it
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()

    def serve_forever(self) -> NoReturn:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # A Python-level handler makes the C handler write to the wakeup fd; the loop then reaps.
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self.listener.setblocking(True)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._reap)
        while True:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _accept(self, _: object) -> None:
        try:
            conn, _addr = self.listener.accept()
        except OSError:
            return
        conn.setblocking(True)
        if self._send(conn, {"op": "hello", "ok": True, "pid": os.getpid(), "threads": thread_count(), **self.hello}):
            self.clients.append(conn)
            self.selector.register(conn, selectors.EVENT_READ, self._command)

    def _command(self, conn: socket.socket) -> None:
        try:
            frame = recv_frame(conn)
        except (InvalidInput, OSError):
            frame = None
        if frame is None:
            self._drop(conn)
            return
        self._send(conn, self._handle(frame.header))

    def _handle(self, header: Header) -> Header:
        request_id = header.get("id")
        op = header.get("op")
        if op == "ping":
            return {"op": "pong", "id": request_id, "threads": thread_count()}
        if isinstance(op, str) and op in self.ops:
            try:
                return {**self.ops[op](header), "id": request_id}
            except Exception as err:   # the op's failure is its reply; the loop serves on
                return error_header(err, request_id, default="ModelNotReady")
        if op != "fork":
            return error_header(InvalidInput(f"fork server: unknown op {op!r}"), request_id)
        try:
            pid = self._fork(header)
        except (OSError, InvalidInput) as err:
            return error_header(err, request_id, default="ModelNotReady")
        return {"op": "forked", "id": request_id, "pid": pid}

    def _fork(self, header: Mapping[str, Any]) -> int:
        tag, path = header.get("tag"), header.get("sock")
        if not isinstance(tag, str) or not isinstance(path, str):
            raise InvalidInput("fork: 'tag' and 'sock' must be strings")
        child_listener = listen_unix(path)
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            child_listener.close()
            raise
        if pid == 0:
            self._become_child(parent, child_listener, dict(header))
        child_listener.close()
        self.children[pid] = tag
        return pid

    def _become_child(self, parent: int, child_listener: socket.socket, header: Header) -> NoReturn:
        try:
            die_with_parent(parent)
            self._forget_server()
            self.on_fork(header, child_listener)
        except BaseException:
            traceback.print_exc(file=sys.stderr)
        hard_exit(70)  # never fall back into the fork loop

    def _forget_server(self) -> None:
        """The child keeps nothing of the server: no handler, no wakeup fd, no sockets."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for sock in [self.listener, *self.clients]:
            sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.children.clear()

    def _reap(self, _: object) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            tag = self.children.pop(pid, None)
            event = {"op": "exit", "tag": tag, "pid": pid, "status": os.waitstatus_to_exitcode(status)}
            for conn in list(self.clients):
                self._send(conn, event)

    def _send(self, conn: socket.socket, header: Header) -> bool:
        try:
            send_frame(conn, header)
            return True
        except OSError:
            self._drop(conn)
            return False

    def _drop(self, conn: socket.socket) -> None:
        if conn in self.clients:
            self.clients.remove(conn)
            self.selector.unregister(conn)
        conn.close()
