"""Process snapshots on the node's side: make a model's image, and restore processes from it (CRIU).

`make_image` starts a snapshot host (`ember.node.snapshot_host`) for a contract, waits until it has loaded and
warmed its model, and dumps it into a directory; `restore` brings a copy back from that directory, connected to
the node by a new socket, and greets it. Both block: the node calls them off its event loop.

What an image is tied to is written beside it (`Image.meta`): CRIU's version, the CPU's flags and the llama.cpp
build (`cpu_probe.host_key`), ember's version with this Python and every installed package's (`environment`), the
contract, and each file the process maps with its size and mtime (a restore maps them again: the GGUF, the
weights, the libraries; they are not in the image). `compatible` refuses an image that does not match, with its
reason, so the caller takes the next rung down.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ember
from ember.errors import ModelNotReady
from ember.node import criu as criu_
from ember.node import image_pages
from ember.node.framing import HEADERS_ONLY, recv_frame, send_frame
from ember.runtimes.cpu_probe import host_key
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.node")

FD = 3   # the snapshot host's socket to the node, in the host and in every copy restored
FORMAT = 2   # what the snapshot host understands (2: `become_template`); an image of another is made again


@dataclass(frozen=True)
class Image:
    path: Path
    dump_s: float
    load_s: float
    bytes: int
    meta: dict[str, object]


@dataclass
class Restored:
    """A process restored from an image: its socket, and CRIU's restore process, whose child it is."""

    conn: socket.socket
    criu: subprocess.Popen[bytes]
    restore_s: float
    hello: dict[str, object]

    @property
    def pid(self) -> int:
        """The restored process's pid as this node sees it (CRIU restores it as its own child)."""
        return _host_pid(self.criu.pid)

    def close(self) -> None:
        self.conn.close()
        try:
            self.criu.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.criu.kill()
            self.criu.wait()


def _host_pid(parent: int) -> int:
    """The snapshot host's pid as the node sees it: the one child of `unshare` or of `criu restore` (pid 1 in its
    own namespace)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    if len(children) != 1:
        raise ModelNotReady(f"snapshots: the snapshot host's namespace has {len(children)} roots")
    return int(children[0])


@functools.cache
def environment() -> str:
    """ember's version, this Python and every installed distribution's version: what the image's code came from."""
    from importlib.metadata import distributions

    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions())
    return hashlib.sha256("\n".join([ember.__version__, sys.version, *installed]).encode()).hexdigest()[:24]


def _mapped_files(pid: int) -> dict[str, list[int]]:
    """Each file the process maps, with its size and mtime: a restore maps them again, so they must not change."""
    found: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and parts[5] not in found:
            with contextlib.suppress(OSError):
                st = os.stat(parts[5])
                found[parts[5]] = [st.st_size, st.st_mtime_ns]
    return found


def _meta(text: str, criu: criu_.Criu) -> dict[str, object]:
    return {"format": FORMAT, "criu": criu.version or "?", "host": host_key(), "environment": environment(),
            "contract": text}


def image_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.iterdir() if p.is_file())


def threads(images: Path) -> int:
    """The imaged process's threads when it was dumped (0: not known)."""
    try:
        return int(json.loads((images / "ember.json").read_text()).get("threads", 0))
    except (OSError, ValueError, TypeError):
        return 0


def _changed_file(files: dict[str, list[int]]) -> str | None:
    for path, (size, mtime) in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return path
    return None


def contract_text(contract: ModelContract) -> str:
    return json.dumps(contract.model_dump(mode="json"), sort_keys=True)


def make_image(contract: ModelContract, images: Path, *, env: Mapping[str, str] | None = None,
               timeout_s: float = 300.0, on_start: Callable[[subprocess.Popen[bytes]], None] = lambda _: None) -> Image:
    """Load the contract's model in a snapshot host and dump it into `images`, replacing what was there only once
    the new image is whole (`on_start`: told the host's process, which a node kills when it closes)."""
    criu = criu_.find()
    if not criu.ok:
        raise ModelNotReady(f"snapshots: {criu.reason}")
    building = images.with_name(f"{images.name}.new")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True, mode=0o700)
    contract_file = building / "contract.json"
    contract_file.write_text(contract_text(contract))
    node_end, host_end = socket.socketpair()
    started = time.perf_counter()
    command = [sys.executable, "-m", "ember.node.snapshot_host", "--runtime", contract.runtime, "--contract",
               str(contract_file), "--fd", str(FD)]

    def child() -> None:
        criu_.killed_with_parent()()
        os.dup2(host_end.fileno(), FD)

    proc = subprocess.Popen(criu_.spawn_argv(command), pass_fds=(FD,), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(env or os.environ),
                            preexec_fn=child)
    host_end.close()
    on_start(proc)
    try:
        node_end.settimeout(timeout_s)
        loaded = recv_frame(node_end, HEADERS_ONLY)
        if loaded is None or not loaded.header.get("ok"):
            why = (loaded.header.get("message") if loaded else None) or "it exited"
            raise ModelNotReady(f"snapshots: the snapshot host did not load its model: {why}")
        load_s, threads = time.perf_counter() - started, loaded.header.get("threads", 0)
        monotonic = loaded.header.get("monotonic", 0.0)
        pid = _host_pid(proc.pid)
        inode = os.readlink(f"/proc/{pid}/fd/{FD}")   # socket:[N], which a restore hands a new socket for
        files = _mapped_files(pid)
        dump_s = criu_.dump(criu, pid, building, sockets=[int(inode.strip("socket:[]"))])
        zero_bytes = _left_out_zero_pages(building)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    finally:
        node_end.close()
        proc.kill()
        proc.wait()
    size = image_bytes(building)
    meta = {**_meta(contract_text(contract), criu), "socket": inode, "files": files, "threads": threads,
            "zero_bytes_left_out": zero_bytes, "monotonic": monotonic, "dumped_at": time.time()}
    (building / "ember.json").write_text(json.dumps(meta))
    _replace(building, images)
    return Image(images, dump_s, load_s, size, meta)


def _left_out_zero_pages(building: Path) -> int:
    """The image without the zero pages of the process's anonymous memory (`image_pages`); the bytes left out.
    An image laid out otherwise than `image_pages` reads stays whole."""
    try:
        return image_pages.sparsify(building).dropped_bytes
    except image_pages.ImageFormatError as err:
        log.warning("snapshots: the image keeps its zero pages (%s)", err)
        return 0


def _replace(new: Path, images: Path) -> None:
    """`new` in `images`' place (a restore that opened the old image's files keeps reading them)."""
    old = images.with_name(f"{images.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        images.rename(old)
    new.rename(images)
    shutil.rmtree(old, ignore_errors=True)


def compatible(images: Path, contract: ModelContract) -> str | None:
    """Why the image cannot be restored here (None: it can)."""
    criu = criu_.find()
    if not criu.ok:
        return criu.reason
    try:
        meta = json.loads((images / "ember.json").read_text())
    except (OSError, ValueError):
        return f"{images} holds no ember image"
    if meta.get("format") != FORMAT:
        return "the image was made by an ember whose snapshot host differs"
    if meta.get("host") != host_key():
        return "the image was made on a CPU with other features (or another llama.cpp build)"
    if meta.get("contract") != contract_text(contract):
        return "the contract changed since the image was made"
    if meta.get("criu") != criu.version:
        return f"the image was made by CRIU {meta.get('criu')}, this host runs {criu.version}"
    if meta.get("environment") != environment():
        return "the image was made by another ember, Python or set of installed packages"
    changed = _changed_file(meta.get("files") or {})
    if changed is not None:
        return f"a file the image maps changed since it was made: {changed}"
    return None


def restore(images: Path, *, cgroup_procs: Sequence[Path] = (), timeout_s: float = 60.0) -> Restored:
    """A copy of the imaged process, greeted (its RNGs re-seeded): ready for requests on `conn`. It and CRIU run in
    `cgroup_procs`' cgroups. On any failure nothing of it is left running."""
    criu = criu_.find()
    if not criu.ok:
        raise ModelNotReady(f"snapshots: {criu.reason}")
    inode = json.loads((images / "ember.json").read_text()).get("socket")
    fd, name = tempfile.mkstemp(prefix="ember-restore-", suffix=".log")
    os.close(fd)
    log = Path(name)
    node_end, host_end = socket.socketpair()
    started = time.perf_counter()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = criu_.restore(criu, images, {host_end.fileno(): str(inode)}, log, cgroup_procs)
        host_end.close()
        node_end.settimeout(timeout_s)
        send_frame(node_end, {"op": "hello"})
        hello = recv_frame(node_end, HEADERS_ONLY)
        if hello is None or not hello.header.get("ok"):
            raise ModelNotReady(f"snapshots: {criu_.restore_failure(log)}")
        return Restored(node_end, proc, time.perf_counter() - started, dict(hello.header))
    except BaseException as err:
        node_end.close()
        host_end.close()
        if proc is not None:
            _kill_restore(proc)
        if isinstance(err, OSError):
            raise ModelNotReady(f"snapshots: {criu_.restore_failure(log)} ({err})") from None
        raise
    finally:
        log.unlink(missing_ok=True)


def _kill_restore(proc: subprocess.Popen[bytes]) -> None:
    """CRIU and whatever it restored so far: the restored root (its namespace's init: the rest dies with it)."""
    with contextlib.suppress(OSError, ModelNotReady):
        os.kill(_host_pid(proc.pid), signal.SIGKILL)
    proc.kill()
    proc.wait()
