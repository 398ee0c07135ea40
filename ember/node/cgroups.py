"""Memory cgroups, one per instance, below the node's own: a model past its contract's `memory_mb` is
OOM-killed alone, and the node (outside the cgroup) lives on to report WorkerCrashed and serve the next request.

The node makes `<its memory cgroup>/ember-<pid>/<instance>` with the limit before the fork, moves the child in
as soon as the fork answers with its pid (`attach`, in a worker thread: a move waits for an RCU grace period,
about 10 ms on this VM, which then overlaps the child's own start instead of adding to it), and removes the
cgroup once the instance is gone. What the child allocates before the move lands (a template's replica: little;
a zygote's child: the first milliseconds of its load) stays charged to the node's cgroup.
cgroup v1 (the `memory` controller's hierarchy) and v2 (the unified one, `memory.max`) are both understood.
Nothing here is required: `MemoryCgroups.open()` says why it cannot work (read-only /sys, no controller, no
permission), and instances then fall back to an address-space limit.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_memory_cgroup(proc_cgroup: str, root: Path = CGROUP_ROOT) -> tuple[Path, int] | None:
    """This process's memory cgroup directory and its version, from /proc/self/cgroup's text."""
    unified = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return root / "memory" / path.lstrip("/"), 1
        if controllers == "":
            unified = path
    if unified is not None and "memory" in _read(root / "cgroup.controllers").split():
        return root / unified.lstrip("/"), 2
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class MemoryCgroups:
    def __init__(self, base: Path, version: int) -> None:
        self.base, self.version = base, version
        self._pending: set[Path] = set()   # removed once empty (a dying process may still be in one)

    @staticmethod
    def open(root: Path = CGROUP_ROOT) -> MemoryCgroups | str:
        """The node's cgroups, or why there are none."""
        own = own_memory_cgroup(_read(Path("/proc/self/cgroup")), root)
        if own is None:
            return "no memory cgroup controller is mounted"
        parent, version = own
        _sweep_stale(parent)
        base = parent / f"ember-{os.getpid()}"
        try:
            base.mkdir(exist_ok=True)
            if version == 2:   # children get the memory controller; v2 allows it only without processes here
                (base / "cgroup.subtree_control").write_text("+memory")
        except OSError as err:
            with contextlib.suppress(OSError):
                base.rmdir()
            return f"cannot make a cgroup under {parent}: {err.strerror or err}"
        return MemoryCgroups(base, version)

    def create(self, name: str, memory_mb: int) -> Path:
        """A cgroup for one instance, limited to `memory_mb` (OSError if the kernel refuses)."""
        self._sweep()
        path = self.base / name
        path.mkdir(exist_ok=True)
        limit = str(memory_mb << 20)
        try:
            if self.version == 1:
                (path / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):   # swap accounting may be off; then there is no swap to bound
                    (path / "memory.memsw.limit_in_bytes").write_text(limit)
            else:
                (path / "memory.max").write_text(limit)
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0")
        except OSError:
            self.remove(path)
            raise
        return path

    @staticmethod
    def attach(path: Path, pid: int) -> None:
        """Move process `pid` into the cgroup at `path` (blocking: call it from a worker thread)."""
        (path / "cgroup.procs").write_text(str(pid))

    def oom_killed(self, path: Path) -> bool:
        """Did the kernel kill a process of this cgroup for going over its limit?"""
        text = _read(path / ("memory.oom_control" if self.version == 1 else "memory.events"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def remove(self, path: Path) -> None:
        try:
            path.rmdir()
            self._pending.discard(path)
        except FileNotFoundError:
            self._pending.discard(path)
        except OSError:
            self._pending.add(path)

    def _sweep(self) -> None:
        for path in list(self._pending):
            self.remove(path)

    def close(self) -> bool:
        """Remove every cgroup of this node; False while some still hold a process that is not reaped yet."""
        self._sweep()
        for path in self.base.iterdir() if self.base.exists() else ():
            if path.is_dir():
                self.remove(path)
        with contextlib.suppress(OSError):
            self.base.rmdir()
        return not self.base.exists()


def _sweep_stale(parent: Path) -> None:
    """Remove what nodes that died without closing left behind (`ember-PID` of a dead PID; only empty cgroups
    can be removed, so nothing that still holds a process goes)."""
    for stale in parent.glob("ember-*"):
        pid = stale.name.removeprefix("ember-")
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for child in stale.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            stale.rmdir()
