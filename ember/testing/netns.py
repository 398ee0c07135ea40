"""Machines on one host for tests and benchmarks: each a network namespace of its own (own IP, own loopback), joined
by veth pairs to one bridge, and the faults a network has (a node killed, a link cut, a link slowed).

    with NetLab() as lab:                     # a bridge `emb<pid>` in the host's namespace, 10.X.Y.1/24 on it
        a = lab.add("a")                      # namespace `ember-<pid>-a`, 10.X.Y.2, its veth `eth0` up, lo up
        proc = a.popen(["python", "-m", "http.server", "--bind", a.ip])   # runs inside (`ip netns exec`)
        a.cut(); a.heal(); a.slow("10mbit"); a.unslow(); a.kill()

The host reaches every namespace at its IP (through the bridge), and each namespace the host at `lab.host_ip`.
`private_dirs` of `add` are bind-mounted over with a directory of the node's own, inside the namespace's mount
namespace only (`ip netns exec` gives each command one): Ray's `/tmp/ray` on every node its own, as on machines.

Teardown (`close`, also on a test's failure, and at exit): every process inside each namespace is killed
(`ip netns pids`: they are this lab's), the namespaces and the bridge deleted. Namespaces and bridges of a lab
whose process is gone (a run killed hard) are removed by the next lab (`sweep`).

Needs root and iproute2 (`available` says why not). Only tests and benchmarks use this (never production code).
What this kernel lacks, `tc` reports: `slow` uses `tbf` (a rate), since `netem` (delay, loss) may be missing
(`has_qdisc`).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ember.node.procinfo import is_alive

PREFIX = "ember-"       # namespaces: ember-<pid>-<name>
BRIDGE_PREFIX = "emb"   # bridges: emb<pid> (an interface name has at most 15 characters)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when this process can make network namespaces, else why not (a reason to skip with)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def has_qdisc(kind: str) -> bool:
    """Whether this kernel has the `tc` queueing discipline `kind` (netem, tbf, ...): tried on a dummy device in a
    namespace of its own."""
    name = f"{PREFIX}{os.getpid()}-qdisc"
    if _ip("netns", "add", name, check=False).returncode != 0:
        return False
    try:
        _ip("-n", name, "link", "add", "d0", "type", "veth", "peer", "name", "d1", check=False)
        args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1mbit", "burst", "32kbit", "latency", "50ms"]}.get(kind, [])
        tried = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "d0", "root", kind, *args],
                               capture_output=True, text=True, check=False)
        return tried.returncode == 0
    finally:
        _ip("netns", "del", name, check=False)


def ns_pids(name: str) -> list[int]:
    """The processes inside namespace `name`."""
    found = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False)
    return [int(p) for p in found.stdout.split()]


def kill_inside(name: str, timeout_s: float = 5.0) -> tuple[int, float]:
    """SIGKILL every process inside namespace `name` until none is left; how many were killed, and when the first
    was stopped (time.monotonic()). Each is stopped
    (SIGSTOP), then all are killed at once: none goes on working while the others die, and nothing lies between
    the first stop and the kills but the signals (the machine goes at once). Any forked meanwhile goes next."""
    pids = ns_pids(name)
    stopped_at = time.monotonic()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    killed: set[int] = set(pids)
    deadline = time.monotonic() + timeout_s
    while (left := ns_pids(name)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.05)
    return len(killed), stopped_at


def sweep() -> list[str]:
    """Remove the namespaces and bridges of labs whose process is gone; their names."""
    gone: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and owner.isdigit() and not is_alive(int(owner)):
            kill_inside(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        owner = dev[len(BRIDGE_PREFIX):]
        if dev.startswith(BRIDGE_PREFIX) and owner.isdigit() and not is_alive(int(owner)):
            _ip("link", "del", dev, check=False)
            gone.append(dev)
    return gone


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.0.0.0/8 that no route of the host's namespace overlaps."""
    used = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(line.split()[0], strict=False))
    start = os.getpid() % 200
    for k in range(200):
        net = ipaddress.IPv4Network(f"10.{100 + (start + k) % 150}.{(os.getpid() // 200) % 250}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for a lab's bridge")


@dataclass
class Netns:
    """One machine: a namespace, its IP on the lab's bridge, its end of the veth pair (`eth0`)."""

    name: str
    ip: str
    host_veth: str
    dirs: dict[str, Path] = field(default_factory=dict)   # path inside -> the node's own directory mounted there
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    dev: str = "eth0"
    killed_at: float | None = None

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside this namespace (and with this node's private directories mounted)."""
        if not self.dirs:
            return ["ip", "netns", "exec", self.name, *cmd]
        mounts = " && ".join(f"mkdir -p '{inside}' && mount --bind '{own}' '{inside}'"
                             for inside, own in self.dirs.items())
        return ["ip", "netns", "exec", self.name, "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """A process inside this namespace; killed with the namespace (`kill`, the lab's close)."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(self.command(cmd), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(cmd), capture_output=True, text=True, check=check)

    def pids(self) -> list[int]:
        return ns_pids(self.name)

    def kill(self) -> int:
        """The machine dies: SIGKILL to every process inside at once; how many. `killed_at`: when the first
        process was stopped (time.monotonic())."""
        killed, self.killed_at = kill_inside(self.name)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return killed

    def tc(self, *args: str, inside: bool = True) -> None:
        cmd = ["tc", *args]
        subprocess.run(["ip", "netns", "exec", self.name, *cmd] if inside else cmd, capture_output=True, text=True,
                       check=True)

    def cut(self) -> None:
        """The link goes down inside the namespace: nothing in or out (the peers see silence, not a reset)."""
        _ip("-n", self.name, "link", "set", "dev", self.dev, "down")

    def heal(self) -> None:
        _ip("-n", self.name, "link", "set", "dev", self.dev, "up")

    def slow(self, rate: str = "10mbit", delay: str | None = None) -> None:
        """Slow the link both ways (each end's egress: the namespace's `eth0` and the bridge's port): `delay` with
        netem where the kernel has it, else a rate alone with tbf."""
        shape = (["netem", "delay", delay, "rate", rate] if delay is not None
                 else ["tbf", "rate", rate, "burst", "64kb", "latency", "2s"])
        self.tc("qdisc", "replace", "dev", self.dev, "root", *shape)
        self.tc("qdisc", "replace", "dev", self.host_veth, "root", *shape, inside=False)

    def unslow(self) -> None:
        for dev, inside in ((self.dev, True), (self.host_veth, False)):
            with contextlib.suppress(subprocess.CalledProcessError):
                self.tc("qdisc", "del", "dev", dev, "root", inside=inside)


class NetLab:
    """A bridge in the host's namespace and machines (namespaces) on it; see the module docstring."""

    def __init__(self, root: Path | None = None) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(f"network namespaces: {reason}")
        sweep()
        self.tag = str(os.getpid())
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"[:15]
        self.net = _free_subnet()
        hosts = self.net.hosts()
        self.host_ip = str(next(hosts))
        self._hosts = hosts
        self.root = root or Path(tempfile.mkdtemp(prefix="ember-netlab-"))
        self.nodes: list[Netns] = []
        self._closed = False
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        atexit.register(self.close)

    def add(self, name: str, private_dirs: Sequence[str] = ()) -> Netns:
        """A machine `name` on the bridge; `private_dirs`: paths given a directory of its own inside it."""
        i = len(self.nodes)
        ns = Netns(f"{PREFIX}{self.tag}-{name}", str(next(self._hosts)), f"{self.bridge}v{i}"[:15])
        _ip("netns", "add", ns.name)
        self.nodes.append(ns)
        _ip("link", "add", ns.host_veth, "type", "veth", "peer", "name", f"{ns.host_veth}p")
        _ip("link", "set", f"{ns.host_veth}p", "netns", ns.name)
        _ip("-n", ns.name, "link", "set", "dev", f"{ns.host_veth}p", "name", ns.dev)
        _ip("-n", ns.name, "addr", "add", f"{ns.ip}/{self.net.prefixlen}", "dev", ns.dev)
        _ip("-n", ns.name, "link", "set", "dev", ns.dev, "up")
        _ip("-n", ns.name, "link", "set", "dev", "lo", "up")
        _ip("link", "set", ns.host_veth, "master", self.bridge)
        _ip("link", "set", ns.host_veth, "up")
        for inside in private_dirs:
            own = self.root / name / inside.strip("/").replace("/", "_")
            own.mkdir(parents=True, exist_ok=True)
            ns.dirs[inside] = own
        return ns

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in self.nodes:
            ns.kill()
            _ip("netns", "del", ns.name, check=False)
            _ip("link", "del", ns.host_veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
