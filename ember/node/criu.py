"""CRIU, the engine of process snapshots: where it is, whether it runs on this host, and its dump and restore.

ember needs CRIU >= 4.1 (kernels from 6.13 give the vDSO a `[vvar_vclock]` area that older releases cannot dump);
`make install` builds 4.1.1 from Debian's source into the virtual environment (deploy/criu/build.sh). `find`
looks at `$EMBER_CRIU`, then beside this Python (`.venv/bin/criu`), then `PATH`, and says why snapshots cannot run
here when they cannot: no binary, an older release, not root, or `criu check` failing on this kernel.

A dumped process must be the root of a pid namespace of its own and its session's leader, with its stdio on
/dev/null: `spawn_argv` starts a command that way (util-linux's `unshare` and `setsid`), so that any number of
copies restore side by side, each in a namespace of its own (in the host's, a restore fails when a pid it needs
is taken). Its one connection to the node, a Unix socket, is external to the image: a restore hands the process a
new socket in its place (`--inherit-fd`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MIN_VERSION = (4, 1)
# No iptables here, and the dumped process shares the host's network namespace (it has no socket on it).
_COMMON = ("--network-lock", "skip", "-v2")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Criu:
    """The CRIU this host runs snapshots with, or why it runs none (`path` None, `reason` says)."""

    path: str | None
    version: str | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.path is not None


class CriuFailed(RuntimeError):
    """A dump or restore failed; the message carries the last errors of CRIU's log."""


def _binary() -> str | None:
    for candidate in (os.environ.get("EMBER_CRIU"), str(Path(sys.prefix) / "bin" / "criu"), shutil.which("criu")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _version(path: str) -> tuple[str, tuple[int, ...]] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    if found is None:
        return None
    parts = tuple(int(p) for p in found.groups() if p is not None)
    return ".".join(map(str, parts)), parts


@functools.cache
def find() -> Criu:
    """This host's CRIU and whether snapshots can run (once per process: `criu check` takes ~0.1 s)."""
    path = _binary()
    if path is None:
        return Criu(None, None, "CRIU is not installed (`make install` builds it; or set EMBER_CRIU)")
    found = _version(path)
    if found is None:
        return Criu(None, None, f"{path} does not say its version")
    version, parts = found
    if parts < MIN_VERSION:
        return Criu(None, version, f"{path} is CRIU {version}; snapshots need >= 4.1 (older releases cannot dump "
                                   "on kernels from 6.13)")
    if os.geteuid() != 0:
        return Criu(None, version, "not root: CRIU dumps and restores processes as root")
    try:
        check = subprocess.run([path, "check"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Criu(None, version, f"`criu check` did not run: {err}")
    if check.returncode != 0:
        errors = [line for line in (check.stdout + check.stderr).splitlines() if line.startswith("Error")]
        return Criu(None, version, f"`criu check` fails on this kernel: {(errors or ['?'])[-1][:300]}")
    return Criu(path, version, "ok")


def spawn_argv(command: Sequence[str]) -> list[str]:
    """`command` as the root of a new pid namespace and its session's leader (what a dump needs)."""
    return ["unshare", "--pid", "--fork", "--kill-child", "setsid", *command]


def _log_errors(log: Path, what: str) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"{what} failed (no log)"
    errors = [line for line in lines if line.startswith("Error")]
    return f"{what} failed: " + " | ".join(errors[-3:] or lines[-3:])


def _killed_with_parent(cgroup_procs: Sequence[Path] = ()) -> Callable[[], None]:
    """In the child before its exec: SIGKILL when the node dies, and into `cgroup_procs` (so that what a restore
    brings back is charged to the instance's cgroups, not the node's)."""
    def setup() -> None:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for procs in cgroup_procs:
            procs.write_text(str(os.getpid()))
    return setup


def dump(criu: Criu, pid: int, images: Path, *, sockets: Sequence[int] = (), leave_running: bool = False) -> float:
    """Dump the process tree rooted at `pid` (a pid-namespace root, see `spawn_argv`) into `images`; seconds.
    `sockets`: the inodes of its Unix sockets whose peers are outside it (a restore hands it new ones)."""
    assert criu.path is not None
    images.mkdir(parents=True, exist_ok=True)
    argv = [criu.path, "dump", "-t", str(pid), "-D", str(images), "--log-file", "criu-dump.log", *_COMMON]
    for inode in sockets:
        argv += ["--external", f"unix[{inode}]"]
    if leave_running:
        argv.append("--leave-running")
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise CriuFailed(_log_errors(images / "criu-dump.log", "criu dump"))
    return time.perf_counter() - started


def restore(criu: Criu, images: Path, inherit: dict[int, str], log: Path,
            cgroup_procs: Sequence[Path] = ()) -> subprocess.Popen[bytes]:
    """Restore the image in `images` in a pid namespace of its own, logging to `log` (one per restore: copies of
    one image restore side by side); `inherit` maps a descriptor of this process to the resource it stands in for
    (`socket:[INODE]` as the dump saw it). CRIU runs in `cgroup_procs`' cgroups and leaves the restored tree's
    there (`--manage-cgroups ignore`), and dies with the node. Returns `criu restore`'s process, whose child the
    restored tree is; it runs until the restored root exits (so the node can wait for it)."""
    assert criu.path is not None
    argv = [criu.path, "restore", "-D", str(images), "--log-file", str(log), "--manage-cgroups=ignore", *_COMMON]
    for fd, resource in inherit.items():
        argv += ["--inherit-fd", f"fd[{fd}]:{resource}"]
    return subprocess.Popen(argv, pass_fds=tuple(inherit), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_killed_with_parent(cgroup_procs))


def restore_failure(log: Path) -> str:
    return _log_errors(log, "criu restore")


def killed_with_parent() -> Callable[[], None]:
    """A `preexec_fn`: the child dies with this process (a snapshot host being made)."""
    return _killed_with_parent()
