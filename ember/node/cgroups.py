"""Cgroups, one per sandboxed process (an instance, or a template and the model code it runs), below the node's own:

- memory: a model past its contract's `memory_mb` is OOM-killed alone, and the node (outside the cgroup) lives
  on to report WorkerCrashed and serve the next request;
- pids: at most the contract's `sandbox.pids` tasks (processes and threads), so a fork bomb in `load()` or
  `infer()` gets EAGAIN instead of the machine's process table; and when the process is gone, whatever it left
  behind (a daemon that detached itself into a session of its own) is found in its cgroup and killed;
- cpu (only for a contract that sets `resources.cpu_weight` or `cpu_max`): its share of contended cores
  (`cpu.weight`; v1 `cpu.shares`, 1024 for 100) and its cap (`cpu.max`; v1 `cpu.cfs_quota_us`).

The node makes `<its cgroup>/ember-<pid>/<tag>` in each controller with the limits before the fork, moves the
child in as soon as the fork answers with its pid (`attach`, in a worker thread: a move waits for an RCU grace
period, about 10 ms on this VM, which then overlaps the child's own start instead of adding to it), and kills
what is left and removes the cgroup once the process is gone. What the child allocates before the move lands (a
template's replica: little; a zygote's child: the first milliseconds of its load) stays charged to the node's.
cgroup v1 (a hierarchy per controller: `memory`, `pids`) and v2 (the unified one) are both understood.
Nothing here is required: `Cgroups.open()` says why it cannot work (read-only /sys, no controller, no
permission), and instances then fall back to an address-space limit; without the pids or cpu controller, only that
part is missing (`ProcessCgroup.pids` or `.cpu` is None).
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_cgroup(proc_cgroup: str, controller: str, root: Path = CGROUP_ROOT) -> tuple[Path, int] | None:
    """This process's cgroup directory for `controller` and its version, from /proc/self/cgroup's text."""
    unified = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return root / controller / path.lstrip("/"), 1
        if controllers == "":
            unified = path
    if unified is not None and controller in _read(root / "cgroup.controllers").split():
        return root / unified.lstrip("/"), 2
    return None


def own_memory_cgroup(proc_cgroup: str, root: Path = CGROUP_ROOT) -> tuple[Path, int] | None:
    return own_cgroup(proc_cgroup, "memory", root)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessCgroup:
    """One sandboxed process's cgroup directories (v2: the same directory twice)."""

    memory: Path
    pids: Path | None
    cpu: Path | None = None


@dataclass(frozen=True)
class CpuShare:
    """A process's share of the cores: its weight against the others' (100 each by default) and its cap in cores."""

    weight: int = 100
    max_cores: float | None = None

    @property
    def default(self) -> bool:
        return self.weight == 100 and self.max_cores is None


class Cgroups:
    def __init__(self, base: Path, version: int, pids_base: Path | None = None, cpu_base: Path | None = None) -> None:
        self.base, self.version, self.pids_base, self.cpu_base = base, version, pids_base, cpu_base
        self._pending: set[Path] = set()   # removed once empty (a dying process may still be in one)

    @staticmethod
    def open(root: Path = CGROUP_ROOT) -> Cgroups | str:
        """The node's cgroups, or why there are none."""
        text = _read(Path("/proc/self/cgroup"))
        own = own_memory_cgroup(text, root)
        if own is None:
            return "no memory cgroup controller is mounted"
        parent, version = own
        base = _make_base(parent, delegate=version == 2)
        if isinstance(base, str):
            return base
        return Cgroups(base, version, _other_base(text, root, base, version, "pids"),
                       _other_base(text, root, base, version, "cpu"))

    def create(self, name: str, memory_mb: int, pids_max: int, cpu: CpuShare = CpuShare()) -> ProcessCgroup:
        """The cgroups of one process, limited to `memory_mb` and `pids_max` tasks, with its share of the cores
        (OSError if the kernel refuses the memory limit; a pids limit or cpu share it refuses is left out)."""
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
        return ProcessCgroup(path, self._pids(name, pids_max), None if cpu.default else self._cpu(name, cpu))

    def _pids(self, name: str, pids_max: int) -> Path | None:
        if self.pids_base is None:
            return None
        path = self.pids_base / name
        try:
            path.mkdir(exist_ok=True)
            (path / "pids.max").write_text(str(pids_max))
        except OSError:
            if path != self.base / name:
                self.remove(path)
            return None
        return path

    def _cpu(self, name: str, cpu: CpuShare) -> Path | None:
        if self.cpu_base is None:
            return None
        path = self.cpu_base / name
        try:
            path.mkdir(exist_ok=True)
            if self.version == 2:
                (path / "cpu.weight").write_text(str(cpu.weight))
                if cpu.max_cores is not None:
                    (path / "cpu.max").write_text(f"{max(1000, round(cpu.max_cores * 100_000))} 100000")
            else:
                (path / "cpu.shares").write_text(str(max(2, cpu.weight * 1024 // 100)))
                if cpu.max_cores is not None:
                    (path / "cpu.cfs_period_us").write_text("100000")
                    (path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cpu.max_cores * 100_000))))
        except OSError:
            if path != self.base / name:
                self.remove(path)
            return None
        return path

    @staticmethod
    def attach(group: ProcessCgroup, pid: int) -> None:
        """Move process `pid` into its cgroups (blocking: call it from a worker thread)."""
        for path in {group.memory, group.pids, group.cpu} - {None}:
            assert path is not None
            (path / "cgroup.procs").write_text(str(pid))

    def oom_killed(self, group: ProcessCgroup) -> bool:
        """Did the kernel kill a process of this cgroup for going over its limit?"""
        text = _read(group.memory / ("memory.oom_control" if self.version == 1 else "memory.events"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    @staticmethod
    def kill_left(group: ProcessCgroup) -> set[int]:
        """Kill whatever the process left in its cgroup (children that outlived it, a daemon); their pids."""
        path = group.pids or group.memory
        killed: set[int] = set()
        for _ in range(20):   # a process forking while we kill: look again, a bounded number of times
            pids = {int(p) for p in _read(path / "cgroup.procs").split() if p.isdigit()}
            if not pids - killed:
                break
            for pid in pids - killed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        return killed

    def remove_group(self, group: ProcessCgroup) -> None:
        for path in {group.memory, group.pids, group.cpu} - {None}:
            assert path is not None
            self.remove(path)

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
        bases = [self.base, *{b for b in (self.pids_base, self.cpu_base) if b not in (None, self.base)}]
        for base in bases:
            assert base is not None
            for path in base.iterdir() if base.exists() else ():
                if path.is_dir():
                    self.remove(path)
            with contextlib.suppress(OSError):
                base.rmdir()
        return not any(base is not None and base.exists() for base in bases)


def _other_base(text: str, root: Path, base: Path, version: int, controller: str) -> Path | None:
    """The node's base for `controller` ("pids", "cpu") beside its memory one: v2 the same directory, where its
    children have the controller; v1 `ember-<pid>` in that controller's hierarchy. None where there is none."""
    if version == 2:
        return base if controller in _read(base / "cgroup.subtree_control").split() else None
    own = own_cgroup(text, controller, root)
    made = None if own is None or own[1] != 1 else _make_base(own[0], delegate=False)
    return made if isinstance(made, Path) else None


def _make_base(parent: Path, *, delegate: bool) -> Path | str:
    """`<parent>/ember-<pid>` (stale ones of dead nodes swept first); `delegate` (v2): its children get the memory
    controller, and the pids and cpu ones where the kernel has them (v2 allows that only without processes
    there)."""
    _sweep_stale(parent)
    base = parent / f"ember-{os.getpid()}"
    try:
        base.mkdir(exist_ok=True)
        if delegate:
            (base / "cgroup.subtree_control").write_text("+memory")
            for controller in ("+pids", "+cpu"):
                with contextlib.suppress(OSError):
                    (base / "cgroup.subtree_control").write_text(controller)
    except OSError as err:
        with contextlib.suppress(OSError):
            base.rmdir()
        return f"cannot make a cgroup under {parent}: {err.strerror or err}"
    return base


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
