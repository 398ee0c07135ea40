"""The sandbox a template or an instance closes around itself before its model's code runs: what a multi-tenant
platform gives a function.

The node sends a plan in the fork command (`SandboxPlan`); the forked child applies it in two steps
(`ember.node.loading` says where the model's load falls):

1. `enter`, at once after the fork: a private mount namespace (still the node's view). The node moves the
   process into its cgroups meanwhile (`ember.node.cgroups`: the contract's `memory_mb` is its memory limit, a
   model that grows past it is OOM-killed alone; `sandbox.pids` bounds its tasks) and the child waits for that
   (`await_cgroup`) before any model code; without cgroups, the child limits its address space to what it has
   mapped plus `memory_mb`.
2. `lock_down`, before the model's code (a python model's import and `load()`; a built-in runtime's load, which
   reads and writes the weight store, comes before it, and then the warm-up is the first model code):
   - a root of its own (`ember.node.view`), read-only: the system's directories, Python and ember's package,
     the contract's directory and weights, devices, a private `/tmp` and `/dev/shm` (its scratch, charged to its
     cgroup, gone with it) and a `/proc` that hides other users' processes; a template may also write one
     directory of its own (`writable`: its replicas' sockets). Not another model's files, the node's state, the
     server's working directory or a source tree;
   - an empty network namespace unless the contract asks for the network (the node's Unix socket was
     accepted on before: an open descriptor keeps working in any namespace);
   - its model's own unprivileged user and group (`model_uid`, no supplementary groups): another model's
     processes, the node's files (0600, 0700) and their memory (/proc/PID/mem needs the same uid or
     CAP_SYS_PTRACE) are out of reach, and the kernel makes the process non-dumpable;
   - no_new_privs and a seccomp filter (`ember.node.seccomp`).

A template's replicas start inside the template's sandbox (and scratch) and keep it; their cgroups are their own.
Each step that the machine does not permit is skipped and reported (`Report.skipped`, in the hello): the node
logs it once per model, and the rest still holds. The user is dropped only when the process could still read
what it needs as that user (a mount view, or paths that others may read).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import resource
import stat
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import ember
from ember.errors import EmberError, InvalidInput
from ember.node import seccomp, view
from ember.node.child import die_with_parent
from ember.wire.contract import ModelContract

UID_BASE = 200_000      # a reserved range: far above login users (1000+) and the usual subuid ranges' start
UID_SPAN = 100_000

_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_PR_SET_DUMPABLE = 4


def model_uid(model_key: str) -> int:
    """The model's own uid (and gid): derived from its key, the same on every node and every restart."""
    digest = hashlib.sha256(model_key.encode()).digest()
    return UID_BASE + int.from_bytes(digest[:8], "little") % UID_SPAN


@dataclass(frozen=True)
class SandboxPlan:
    uid: int
    memory_mb: int
    network: bool = False
    cgroup: str | None = None              # the memory cgroup directory to join (None: none could be made)
    readable: tuple[str, ...] = ()         # what the process reads after the lock-down (contract dir, weights)
    writable: tuple[str, ...] = ()         # what it writes besides its /tmp (a template: its replicas' sockets)
    hidden: tuple[str, ...] = ()           # never in its view, even inside what it reads (the node's state)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def reading(self, paths: tuple[str, ...]) -> SandboxPlan:
        """The plan with more paths to read (weights staged from the store before the lock-down)."""
        return replace(self, readable=(*self.readable, *paths))

    @staticmethod
    def from_json(data: object) -> SandboxPlan | None:
        if data is None:
            return None
        if not isinstance(data, dict):
            raise InvalidInput("fork: 'sandbox' must be an object or null")
        try:
            return SandboxPlan(**{**data, **{k: tuple(data.get(k, ())) for k in ("readable", "writable", "hidden")}})
        except TypeError as err:
            raise InvalidInput(f"fork: bad 'sandbox': {err}") from None


def plan_for(contract: ModelContract, cgroup: Path | None, hidden: tuple[str, ...] = ()) -> SandboxPlan:
    """The node's plan for an instance of `contract` (its memory cgroup made already, or None; `hidden`: the
    node's state directory and the other models' contract directories)."""
    readable = [str(Path(contract.source).parent)] if contract.source else []
    if contract.weights is not None and contract.store_ref is None:
        with contextlib.suppress(EmberError):
            readable += [str(p) for p in [contract.weights_path()] if p is not None]
    return SandboxPlan(uid=model_uid(contract.key), memory_mb=contract.resources.memory_mb,
                       network=contract.sandbox.network, cgroup=None if cgroup is None else str(cgroup),
                       readable=tuple(readable), hidden=hidden)


def skipped_steps(report: object) -> str:
    """One line for the node's log on what an instance's hello says it could not enforce ("" if nothing)."""
    if not isinstance(report, dict) or not report.get("skipped"):
        return ""
    return (f"enforces {', '.join(report.get('enforced', [])) or 'nothing'}; not permitted here: "
            + "; ".join(f"{step} ({why})" for step, why in report["skipped"].items()))


@dataclass
class Report:
    """What the sandbox enforces in this instance, and what it had to skip (step -> why)."""

    uid: int | None = None
    enforced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    load_sandboxed: bool = False             # the model's load ran after the lock-down (`ember.node.loading`)
    mount_ns: str | None = "not entered"     # None once the process has a private mount namespace, else why not

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "mount_ns"}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def prepare() -> None:
    """In a zygote or template, before it forks: what every child's lock-down would otherwise compute again
    (about 2 ms: the paths Python reads, the seccomp program, libc)."""
    _libc()
    view.layout((), stable=_base_paths())
    arch = seccomp.this_arch()
    if arch is not None:
        seccomp.program(arch)


def _check(result: int, what: str) -> None:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {errno.errorcode.get(err, str(err))}")


def _why(err: BaseException) -> str:
    return err.strerror or str(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"


# --- step 1: memory --------------------------------------------------------------------------------------


def enter(plan: SandboxPlan, report: Report) -> None:
    """Right after the fork: a mount namespace of its own; without a memory cgroup, an address-space limit."""
    t0 = time.perf_counter()
    _private_mounts(report)
    if plan.cgroup is None:
        report.skipped["memory:cgroup"] = "the node could not make a memory cgroup"
        try:
            # The address space, not memory: a torch process maps far more than it touches, so the limit is
            # what this process maps already (shared with its template) plus the contract's memory.
            limit = _mapped_bytes() + plan.memory_mb * (1 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            report.enforced.append("memory:rlimit_as")
        except (OSError, ValueError) as err:
            report.skipped["memory:rlimit_as"] = _why(err)
    report.seconds += time.perf_counter() - t0


def _private_mounts(report: Report) -> None:
    """A mount namespace of its own, now: unshare(CLONE_NEWNS) needs a single thread, and loading a model may
    start a pool. The view stays the node's (the load may write to the weight store) until `lock_down`."""
    libc = _libc()
    try:
        if threading.active_count() > 1 or _thread_count() > 1:
            raise OSError(errno.EINVAL, "the process has threads (a mount namespace needs a single thread)")
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(/, MS_PRIVATE)")
        report.mount_ns = None
    except OSError as err:
        report.mount_ns = _why(err)


def await_cgroup(plan: SandboxPlan, report: Report, timeout_s: float = 5.0) -> None:
    """Wait until the node has moved this process into its cgroup (it does so while the child starts): model
    code must not run before its limits apply (a fork bomb, a daemon that escapes the cgroup's kill)."""
    if plan.cgroup is None:
        return
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while not in_cgroup(plan.cgroup, Path("/proc/self/cgroup").read_text()):
        if time.perf_counter() > deadline:
            report.skipped["memory:cgroup"] = f"not moved into {plan.cgroup} within {timeout_s:g} s"
            break
        time.sleep(0.001)
    report.seconds += time.perf_counter() - t0


def in_cgroup(path: str, proc_cgroup: str) -> bool:
    """Is the process whose /proc/PID/cgroup reads `proc_cgroup` in the memory cgroup directory `path`?"""
    for line in proc_cgroup.splitlines():
        _, controllers, where = line.split(":", 2)
        if ("memory" in controllers.split(",") or controllers == "") and where != "/" and path.endswith(where):
            return True
    return False


def _mapped_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


# --- step 2: the lock-down ---------------------------------------------------------------------------------


def lock_down(plan: SandboxPlan, report: Report) -> None:
    """Namespaces, its own root, the model's user, seccomp: in that order (each needs the one before)."""
    t0 = time.perf_counter()
    libc = _libc()
    needed = needed_paths(plan.readable)
    made = False
    try:
        if report.mount_ns is not None:
            raise OSError(errno.EPERM, report.mount_ns)
        plan_layout = view.layout(needed, plan.writable, plan.hidden, stable=_base_paths())
        why_not_hidden = view.build(libc, plan_layout, plan.memory_mb)
        made = True
        report.enforced.append("filesystem:read-only")
        if why_not_hidden is None:
            report.enforced.append("processes:hidden")
        else:
            report.skipped["processes:hidden"] = why_not_hidden
    except OSError as err:
        report.skipped["filesystem:read-only"] = _why(err)
        report.skipped["processes:hidden"] = "no root of its own (filesystem:read-only)"
    if not plan.network:
        try:
            _check(libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            report.enforced.append("network:none")
        except OSError as err:
            report.skipped["network:none"] = _why(err)
    _drop_user(libc, plan.uid, [*_base_paths(), *needed, *plan.writable], made, report)
    arch = seccomp.this_arch()
    try:
        if arch is None:
            raise OSError(errno.ENOSYS, f"no seccomp filter for this architecture ({os.uname().machine})")
        seccomp.install(arch)
        report.enforced.append("seccomp")
    except OSError as err:
        report.skipped["seccomp"] = _why(err)
    report.seconds += time.perf_counter() - t0


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _drop_user(libc: ctypes.CDLL, uid: int, needed: list[str], own_root: bool, report: Report) -> None:
    blocked = None if own_root else next((b for b in (blocked_ancestor(p) for p in needed) if b is not None), None)
    if blocked is not None:
        report.skipped["user"] = (f"{blocked} is closed to other users and no private mount view could re-open "
                                  f"what the instance reads: it keeps uid {os.getuid()}")
        return
    try:
        parent = os.getppid()
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        die_with_parent(parent)   # a change of credentials clears PR_SET_PDEATHSIG: set it again
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)   # already so after the uid change; said here for clarity
        report.uid = uid
        report.enforced.append("user")
    except OSError as err:
        report.skipped["user"] = _why(err)


def needed_paths(readable: tuple[str, ...]) -> list[str]:
    """What the instance must read besides `_base_paths`: the plan's paths and what symbolic links inside them
    point to (absolute, as the process names them)."""
    own = [os.path.abspath(p) for p in readable if p]
    return sorted(p for p in {*own, *view.linked_from(own)} if os.path.lexists(p))


@functools.cache
def _base_paths() -> tuple[str, ...]:
    """What every sandboxed process reads: Python and ember's package (`python_paths`), the system's directories
    and the devices (`ember.node.view`); computed once, in the zygote."""
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    package = str(Path(ember.__file__).resolve().parent)
    paths = python_paths(sys.path, (sys.prefix, sys.base_prefix, sys.exec_prefix), package, cwd,
                         os.environ.get("LD_LIBRARY_PATH", ""))
    return tuple(sorted(p for p in {*paths, *view.SYSTEM, *view.devices()} if os.path.lexists(p)))


def python_paths(entries: list[str], prefixes: tuple[str, ...], package: str, cwd: str | None,
                 library_path: str = "") -> list[str]:
    """What Python reads: its `prefixes`, the `entries` of its path, ember's `package`, and the directories of
    `library_path`; not the working directory (`python -m` puts it first on the path: the server's, with its
    files) nor a directory holding it (`PYTHONPATH=$HOME`), nor the directory that holds ember's package (a source
    tree), unless a prefix holds them (site-packages). (The node's state and the other models' contract directories
    in a directory read are covered: the plan's `hidden`.)"""
    runtime = [os.path.abspath(p) for p in prefixes if p and os.path.abspath(p) != "/"]
    home = os.path.dirname(package)
    kept = [p for p in (os.path.abspath(e) for e in entries if e)
            if p != "/" and (any(view.under(p, r) for r in runtime)
                             or (p != home and (cwd is None or not view.under(cwd, p))))]
    return [*runtime, *kept, package, *(p for p in library_path.split(os.pathsep) if os.path.isabs(p))]


def blocked_ancestor(path: str) -> str | None:
    """The first directory on the way to `path` (itself included) that other users may not enter."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        current = current / part
        try:
            st = os.stat(current)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return str(current)
    return None
