"""A model that tries to leave its sandbox, for the sandbox tests: each `cmd` is one attempt, answered with
`result` = [errno of the attempt (0: it worked), this process's uid, pid].

b"peek:PID" reads /proc/PID/mem (another instance's memory), b"ptrace:PID" attaches to it, b"unshare" asks
for a new namespace, b"write:PATH" creates a file, b"connect:PORT" dials 127.0.0.1, b"alloc:MB" allocates and
touches that much memory, b"status" reads NoNewPrivs and Seccomp (errno field: both flags as 10*nnp + mode).
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np


def _attempt(cmd: str) -> int:
    verb, _, arg = cmd.partition(":")
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
        elif verb == "status":
            fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            return 10 * int(fields["NoNewPrivs"]) + int(fields["Seccomp"])
    except OSError as err:
        return err.errno or -1
    except MemoryError:
        return 12   # ENOMEM
    return 0


class Jail:
    hoard: list[np.ndarray] = []

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cmd = bytes(inputs["cmd"].reshape(-1)[0]).decode()
        return {"result": np.array([_attempt(cmd), os.getuid(), os.getpid()], dtype=np.int64)}
