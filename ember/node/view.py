"""The files a sandboxed process sees after its lock-down (`ember.node.sandbox`): a root of its own.

The process (root still, in its private mount namespace) mounts a small tmpfs, binds into it, read-only and at
their own paths, what it may read, and makes that tmpfs its root (`pivot_root`, the old root detached; `chroot`
where the old root cannot be pivoted, as on an initramfs):

- the system's directories (`SYSTEM`: /usr, /bin, /sbin, /lib*, /etc, /sys): libraries, configuration, the
  CPU's topology;
- Python: its prefixes and `sys.path`, ember's own package (not the tree it sits in, nor the server's working
  directory), the directories `LD_LIBRARY_PATH` names;
- the plan's paths: the contract's directory and weights, and what symbolic links in them point to (a
  Hugging Face snapshot's files point into its blobs); the writable ones (a template's replicas' sockets) bound
  writable;
- `/tmp`, a private tmpfs (its scratch, charged to its cgroup), and `/dev/shm`, another;
- `/dev`: null, zero, full, random, urandom and the accelerators' nodes (nvidia*, dri, kfd);
- `/proc`: a procfs of its own mounted `hidepid=invisible` (Linux 5.8+, where each procfs mount has its own
  options): the process sees its own entries, not other users' processes (their command lines, environments).

Nothing else: not another model's directory (and the secrets beside it), not the source tree or the server's
working directory, not the node's state, not other users' homes. The symbolic links on the way to each path are
made in the new root too, so that a path reads the same inside as outside. `hidden` paths (the node's state
directory, the other models' contract directories) that fall inside a bound directory (a contract directory
holding the state directory, a path entry holding every model's) are covered by an empty tmpfs; what the process
must reach below them (its replicas' socket directory) is bound again on it.

All or nothing: a step that fails takes the new root down again (the process keeps the node's view and the
report names the step).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ember.node import seccomp

SCRATCH = "/tmp"
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/etc/resolv.conf", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom")
ACCELERATORS = ("nvidia", "dri", "kfd")          # /dev names that start so: GPUs' nodes
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
MAX_SCAN = 4096            # entries of a plan's directory looked at for symbolic links that point out of it
_MAX_HOPS = 40             # symbolic links followed on one path (the kernel's own limit)

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_OPEN_TREE_CLONE, _AT_RECURSIVE, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, 4
_MOUNT_ATTR_RDONLY = 1
_MNT_DETACH = 2
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = 428, 429, 442   # the same number on every architecture


@dataclass
class Layout:
    """What the new root holds, in host paths (each also its path inside)."""

    links: dict[str, str] = field(default_factory=dict)   # where -> the link's text, made on the new root's tmpfs
    binds: list[str] = field(default_factory=list)        # read-only, the top-most of each nest
    covers: list[str] = field(default_factory=list)       # hidden paths inside a bind: an empty tmpfs each
    rebinds: list[str] = field(default_factory=list)      # what is read below a cover, bound again on it
    writable: list[str] = field(default_factory=list)     # bound writable, each on its own

    def mounts(self) -> list[str]:
        return [*self.binds, *self.rebinds, *self.writable]


def layout(readable: Iterable[str], writable: Iterable[str] = (), hidden: Iterable[str] = (),
           stable: Iterable[str] = ()) -> Layout:
    """The new root for a process that reads `readable` and `stable` (the system's and Python's paths, which do
    not change while a zygote lives: walked once, in the zygote), writes `writable` and must not see `hidden`.
    Reads the host's files (symbolic links, kinds); mounts nothing."""
    out = Layout()
    out.writable = sorted({r for r in (_walk(p, out.links) for p in writable) if r is not None and r != "/"})
    walked = [_walk(p, out.links) for p in readable]
    for path in stable:
        real, links = _walk_stable(path)
        walked.append(real)
        out.links.update(links)
    reals = {r for r in walked if r is not None and r not in ("/", SCRATCH)}
    reals -= set(out.writable)
    out.binds = _top_most(reals)
    hid = {r for r in (_walk(p, {}) for p in hidden) if r is not None}
    out.covers = _top_most({h for h in hid if any(under(h, b) and h != b for b in out.binds)})
    out.rebinds = _top_most({r for r in reals if any(under(r, c) for c in out.covers)})
    out.links = {where: text for where, text in out.links.items() if not any(under(where, b) for b in out.binds)}
    return out


def linked_from(paths: Iterable[str], limit: int = MAX_SCAN) -> list[str]:
    """What symbolic links inside the directories `paths` point to outside them (at most `limit` entries read
    in each): a contract directory's module linked from elsewhere, a Hugging Face snapshot's blobs."""
    out: list[str] = []
    for path in paths:
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        root = os.path.realpath(path)
        for where in _links_below(path, limit):
            target = os.path.realpath(where)
            if not under(target, root) and os.path.exists(target):
                out.append(where)   # the link itself: the view makes the links on the way and binds the target
    return out


def _links_below(path: str, limit: int) -> list[str]:
    found: list[str] = []
    pending, seen = [path], 0
    while pending and seen < limit:
        with contextlib.suppress(OSError), os.scandir(pending.pop()) as entries:
            for entry in entries:
                seen += 1
                if entry.is_symlink():
                    found.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                if seen >= limit:
                    break
    return found


def _walk(path: str, links: dict[str, str]) -> str | None:
    """`path`'s real path (None: missing), each symbolic link on the way recorded in `links` (where -> text)."""
    parts = list(Path(os.path.abspath(path)).parts[1:])
    real, hops = "/", 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            real = os.path.dirname(real)
            continue
        here = os.path.join(real, part)
        if not os.path.islink(here):
            real = here
            continue
        hops += 1
        if hops > _MAX_HOPS:
            return None
        text = os.readlink(here)
        links[here] = text
        parts = list(Path(text).parts[1:] if os.path.isabs(text) else Path(text).parts) + parts
        real = "/" if os.path.isabs(text) else real
    return real if os.path.lexists(real) else None


@functools.cache
def _walk_stable(path: str) -> tuple[str | None, dict[str, str]]:
    links: dict[str, str] = {}
    return _walk(path, links), links


def _top_most(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if not any(o != p and under(p, o) for o in paths))


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def devices(dev: str = "/dev") -> list[str]:
    """The device nodes a process may use: the plain ones and the accelerators'."""
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return sorted(f"{dev}/{n}" for n in names if n in DEVICES or n.startswith(ACCELERATORS))


# --- mounting ----------------------------------------------------------------------------------------------


def _check(result: int, what: str) -> None:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {errno.errorcode.get(err, str(err))}")


def hidepid_supported() -> bool:
    """Each procfs mount has its own options from Linux 5.8; before, `hidepid` would change the host's /proc."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def build(libc: ctypes.CDLL, plan: Layout, memory_mb: int, stage: str = SCRATCH) -> str | None:
    """Make the new root and enter it; None when other users' processes are hidden, else why not."""
    libc.syscall.restype = ctypes.c_long
    trees: dict[str, tuple[int, bool]] = {}
    mask = os.umask(0o022)
    try:
        for path in plan.mounts():   # cloned, and their kinds read, before the stage hides any (a path under /tmp)
            trees[path] = (_clone(libc, path), os.path.isdir(path))
        _check(libc.mount(b"tmpfs", stage.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=4m,mode=0755"),
               "mount the new root")
        try:
            hidden = _fill(libc, stage, plan, trees, memory_mb)
            _enter(libc, stage)
        except OSError:
            libc.umount2(stage.encode(), _MNT_DETACH)   # what was bound into it goes with it
            raise
    finally:
        os.umask(mask)
        for fd, _ in trees.values():
            os.close(fd)
    os.environ["TMPDIR"] = SCRATCH
    return hidden


def _fill(libc: ctypes.CDLL, stage: str, plan: Layout, trees: dict[str, tuple[int, bool]],
          memory_mb: int) -> str | None:
    size = f"size={max(16, memory_mb)}m,mode=1777".encode()
    _tmpfs(libc, stage + SCRATCH, size)
    for where, text in sorted(plan.links.items()):
        os.makedirs(os.path.dirname(stage + where), exist_ok=True)
        if not os.path.lexists(stage + where):
            os.symlink(text, stage + where)
    for path in plan.binds:
        _move(libc, *trees[path], stage + path)
    for path in plan.covers:
        _tmpfs(libc, stage + path, b"size=1m,mode=0755")
    for path in [*plan.rebinds, *plan.writable]:
        _move(libc, *trees[path], stage + path)
    _tmpfs(libc, stage + "/dev/shm", size)
    for name, text in DEV_LINKS.items():
        if not os.path.lexists(f"{stage}/dev/{name}"):
            os.symlink(text, f"{stage}/dev/{name}")
    hidden = _proc(libc, stage)
    _set_readonly(libc, stage, recursive=True, readonly=True)
    for path in (SCRATCH, "/dev/shm", *plan.writable):
        _set_readonly(libc, stage + path, recursive=False, readonly=False)
    return hidden


def _proc(libc: ctypes.CDLL, stage: str) -> str | None:
    """A procfs of its own that hides other users' processes; where that cannot be, the host's (and why). (An
    unused clone of the host's would cost a grace period when closed: it is made only when needed.)"""
    os.makedirs(stage + "/proc", exist_ok=True)
    why = "needs Linux 5.8 (per-mount procfs options)"
    if hidepid_supported():
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        if libc.mount(b"proc", (stage + "/proc").encode(), b"proc", flags, b"hidepid=invisible") == 0:
            return None
        why = f"mount proc hidepid=invisible: {os.strerror(ctypes.get_errno())}"
    host_proc = _clone(libc, "/proc")
    try:
        _move(libc, host_proc, True, stage + "/proc")
    finally:
        os.close(host_proc)
    return why


def _enter(libc: ctypes.CDLL, stage: str) -> None:
    """The new root becomes `/`: pivot_root(".", ".") and the old root detached (runc's way); chroot where
    pivot_root is refused (an initramfs root). Either way the process then works from `/`."""
    os.chdir(stage)
    arch = seccomp.this_arch()
    pivoted = arch is not None and libc.syscall(ctypes.c_long(arch.numbers["pivot_root"]), b".", b".") == 0
    if pivoted:
        _check(libc.umount2(b".", _MNT_DETACH), "umount2(the old root)")
    else:
        os.chroot(".")
    os.chdir("/")


def _clone(libc: ctypes.CDLL, path: str) -> int:
    fd = libc.syscall(ctypes.c_long(_OPEN_TREE), ctypes.c_long(-100), path.encode(),
                      ctypes.c_long(_OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC))
    _check(fd, f"open_tree({path})")
    return int(fd)


def _tmpfs(libc: ctypes.CDLL, where: str, options: bytes) -> None:
    os.makedirs(where, exist_ok=True)
    _check(libc.mount(b"tmpfs", where.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options), f"mount tmpfs {where}")


def _move(libc: ctypes.CDLL, fd: int, is_dir: bool, where: str) -> None:
    """Attach a cloned tree at `where`, on a mount point of its kind (a file's tree moved onto a directory is
    EINVAL). A mount point inside a bound tree is there already: nothing is made on the host's files."""
    if not os.path.lexists(where):
        if is_dir:
            os.makedirs(where)
        else:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with open(where, "a"):
                pass
    _check(libc.syscall(ctypes.c_long(_MOVE_MOUNT), ctypes.c_long(fd), b"", ctypes.c_long(-100), where.encode(),
                        ctypes.c_long(_MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount({where})")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _set_readonly(libc: ctypes.CDLL, path: str, *, recursive: bool, readonly: bool) -> None:
    attr = _MountAttr(_MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else _MOUNT_ATTR_RDONLY, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    _check(libc.syscall(ctypes.c_long(_MOUNT_SETATTR), ctypes.c_long(-100), path.encode(), ctypes.c_long(flags),
                        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr({path})")
