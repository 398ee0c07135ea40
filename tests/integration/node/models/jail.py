"""A model that tries to leave its sandbox, for the sandbox tests: each `cmd` is one attempt, answered with
`result` = [errno of the attempt (0: it worked), this process's uid, pid].

b"peek:PID" reads /proc/PID/mem (another instance's memory), b"ptrace:PID" attaches to it, b"unshare" asks
for a new namespace, b"write:PATH" creates a file, b"connect:PORT" dials 127.0.0.1, b"alloc:MB" allocates and
touches that much memory, b"status" reads NoNewPrivs and Seccomp (errno field: both flags as 10*nnp + mode),
b"read:PATH" reads a file, b"fork:N" forks N children that sleep (errno: the first fork that failed), b"daemon"
leaves a process behind in a session of its own (pid field: the daemon's).

The same attempts run in `load()` when the contract's options list them (`load: [cmd, ...]`): b"loaded:I" then
answers the I-th one, as it went at load time.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np


def _attempt(cmd: str) -> tuple[int, int]:
    """(errno, pid): 0 if the attempt worked; the pid is this process's, or the daemon's."""
    verb, _, arg = cmd.partition(":")
    if verb == "daemon":
        return _daemon()
    return _try(verb, arg), os.getpid()


def _try(verb: str, arg: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if verb == "peek":
            with open(f"/proc/{int(arg)}/mem", "rb") as mem:
                maps = Path(f"/proc/{int(arg)}/maps").read_text().split()[0]
                mem.seek(int(maps.split("-")[0], 16))
                mem.read(16)
        elif verb == "ptrace":
            if libc.ptrace(16, int(arg), 0, 0) != 0:   # PTRACE_ATTACH
                return ctypes.get_errno()
            libc.ptrace(17, int(arg), 0, 0)           # PTRACE_DETACH
        elif verb == "unshare":
            if libc.unshare(0x00020000) != 0:
                return ctypes.get_errno()
        elif verb == "write":
            Path(arg).write_text("escaped")
        elif verb == "connect":
            with socket.create_connection(("127.0.0.1", int(arg)), timeout=2):
                pass
        elif verb == "alloc":
            Jail.hoard.append(np.ones(int(arg) << 17))   # 8-byte floats, written: resident
        elif verb == "read":
            Path(arg).read_bytes()
        elif verb == "fork":
            return _forks(int(arg))
        elif verb == "status":
            fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            return 10 * int(fields["NoNewPrivs"]) + int(fields["Seccomp"])
    except OSError as err:
        return err.errno or -1
    except MemoryError:
        return 12   # ENOMEM
    return 0


def _forks(n: int) -> int:
    """Fork `n` children that wait, all alive at once (then killed): the errno of the first fork refused."""
    children, code = [], 0
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children.append(pid)
    except OSError as err:
        code = err.errno or -1
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return code


def _daemon() -> tuple[int, int]:
    read, write = os.pipe()
    if os.fork() == 0:   # the child: a session of its own, then the daemon, which outlives it
        os.setsid()
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    pid = int(os.read(read, 32) or b"0")
    os.close(read)
    os.wait()
    return 0, pid


class Jail:
    hoard: list[np.ndarray] = []

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        self.loaded = [(*_attempt(cmd), os.getuid()) for cmd in options.get("load", [])]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cmd = bytes(inputs["cmd"].reshape(-1)[0]).decode()
        if cmd.startswith("loaded:"):
            code, pid, uid = self.loaded[int(cmd.partition(":")[2])]
        else:
            (code, pid), uid = _attempt(cmd), os.getuid()
        return {"result": np.array([code, uid, pid], dtype=np.int64)}
