"""One server per state dir: an exclusive lock held for the server process's life.

Two `ember serve`s on one `--state-dir` used to both run: the second requeued the first's running jobs
(its "predecessor's", by the file's rules), which then ran twice, and both forked instances onto one
socket dir. The server now takes `flock(LOCK_EX | LOCK_NB)` on `<state dir>/serve.lock` before it opens
the job store, and writes its pid there; a second server refuses to start with a message naming the dir and
the holder's pid. The kernel drops the lock when the process dies however it dies (SIGKILL included), so a
stale file never blocks a restart. The descriptor is close-on-exec, and the node's zygotes are spawned with
exec (only their listener is passed), so no child keeps the lock after its server.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ember.errors import InvalidInput

LOCK_NAME = "serve.lock"


class StateDirInUse(InvalidInput):
    """Another live process holds the state dir."""


def lock_state_dir(state_dir: Path) -> int:
    """The open, locked descriptor of the state dir's lock file (keep it open for as long as the server runs);
    StateDirInUse naming the dir and the holder's pid when another process holds it."""
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise StateDirInUse(f"--state-dir {state_dir}: in use by another ember serve (pid {holder}); stop it, or "
                            f"give this server a --state-dir of its own") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_state_dir(fd: int) -> None:
    os.close(fd)   # closing the last descriptor of the open file drops the lock


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
