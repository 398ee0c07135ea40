"""ember on a Ray cluster whose nodes are machines of a `NetLab` (ember/testing/netns.py): each node a network
namespace of its own (own IP, own loopback, its own `/tmp/ray`), joined to the others by a veth pair and a bridge.

The head (no CPUs: the controller actor) is Ray's `Cluster` head in the host's namespace on the bridge's address,
so this process is a Ray driver beside it. Each node runs, inside its namespace, what an operator runs on a
machine: `ray start --address HEAD --node-ip-address IP --block`, then `ember serve --ray HEAD --host IP --port
8000` (a Ray driver attached to its own raylet; its Ray node id is the node's). The faults are the lab's: `kill`
(every process of the node at once, as a machine that dies), `cut` and `heal` (its link down and up), `slow`.

Ray's GCS health checks default to about 15 s before a node is declared dead; `HEALTH_CHECK` (the head's
`_system_config`) is what docs/cluster.md recommends to an operator for detection within 2 s.
Only tests and benchmarks use this (never production code).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster

from ember.cluster.actors import CONTROLLER, NAMESPACE, controller
from ember.testing.netns import NetLab, Netns

PORT = 8000   # every node's gateway: each has an address of its own
# A check every 100 ms, each failing after 300 ms without an answer, three in a row: dead 1.1-1.2 s after the
# node fell silent (a failed check waits its timeout, then the period, before the next).
HEALTH_CHECK = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 100,
                "health_check_timeout_ms": 300, "health_check_failure_threshold": 3}


def supervised(cmd: list[str], before: str = ":") -> list[str]:
    """`cmd` run as an operator's supervisor runs a machine's service (systemd `Restart=always`, `RestartSec=1`; a
    pod's restart): started again a second after each exit, `before` (a shell command) run before each start
    (docs/cluster.md, "A node that comes back")."""
    return ["sh", "-c", f'while :; do {before}; "$@"; sleep 1; done', "supervisor", *cmd]


# Before each `ray start` of a supervised node: its /tmp/ray emptied, as a pod's restart starts with a fresh /tmp.
# Here it is needed: Ray finds a driver's raylet among the raylet processes it sees, and here it sees every
# namespace's (one PID namespace), the head's first; the head's socket path is the same in every node's private
# /tmp/ray, so a node's `ember serve` reaches its own raylet only while that raylet's socket has Ray's first name
# (`sockets/raylet`). A raylet started beside a dead one's socket file takes `raylet.1`. (On a machine of its own
# the one raylet it sees is its own, whatever its socket's name.)
FRESH_RAY_TMP = "rm -rf /tmp/ray/session_*"


@dataclass
class NetnsNode:
    index: int
    ns: Netns
    node_id: str
    state_dir: Path
    serve: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://{self.ns.ip}:{PORT}"

    @property
    def ip(self) -> str:
        return self.ns.ip


class NetnsCluster:
    def __init__(self, root: Path, node_args: list[list[str]], *, env: dict[str, str] | None = None,
                 ttl_s: float = 3.0, system_config: dict[str, Any] | None = None, token: str | None = None,
                 lab: NetLab | None = None) -> None:
        """`lab`: the machines' network, made beforehand (a job store or an origin on its host address first);
        closed with the cluster either way."""
        self.root, self.node_args, self.env = root, node_args, env or {}
        self.ttl_s, self.token = ttl_s, token
        self.system_config = HEALTH_CHECK if system_config is None else system_config
        self.lab: NetLab | None = lab
        self.cluster: Cluster | None = None
        self.nodes: list[NetnsNode] = []
        self.lost: list[NetnsNode] = []

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return str(self.cluster.address)

    def start(self, ready_timeout_s: float = 180) -> NetnsCluster:
        if self.lab is None:
            self.lab = NetLab(self.root / "lab")
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "include_dashboard": False, "node_ip_address": self.lab.host_ip,
                "_system_config": self.system_config})
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            controller(token=self.token, ttl_s=self.ttl_s)
            for args in self.node_args:
                self._start_node(args)
            self.wait_joined(len(self.nodes), ready_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _start_node(self, args: list[str], supervise: bool = False) -> NetnsNode:
        """`supervise`: its `ray start` and `ember serve` restarted whenever they exit (`supervised`)."""
        def wrap(cmd: list[str], before: str = ":") -> list[str]:
            return supervised(cmd, before) if supervise else cmd

        assert self.lab is not None
        i = len(self.nodes) + len(self.lost)
        ns = self.lab.add(f"n{i}", private_dirs=["/tmp/ray"])
        state = self.root / f"node{i}"
        state.mkdir(parents=True, exist_ok=True)
        ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        with (state / "raylet.log").open("ab") as out:
            ns.popen(wrap([ray_bin, "start", "--address", self.address, "--node-ip-address", ns.ip, "--num-cpus",
                           "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats", "--block"],
                          FRESH_RAY_TMP),
                     stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RAY_worker_niceness": "0"})
        node_id = self._ray_node(ns.ip, 60)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        with (state / "serve.log").open("ab") as out:
            serve = ns.popen(wrap([sys.executable, "-m", "ember", "serve", "--ray", self.address, "--host", ns.ip,
                                   "--port", str(PORT), "--state-dir", str(state), *args]),
                             stdout=out, stderr=subprocess.STDOUT, env=env)
        self.nodes.append(NetnsNode(i, ns, node_id, state, serve))
        return self.nodes[-1]

    def add_node(self, args: list[str], ready_timeout_s: float = 120, supervise: bool = False) -> NetnsNode:
        node = self._start_node(args, supervise)
        self.wait_joined(len(self.nodes), ready_timeout_s)
        return node

    def new_ray_node(self, node: NetnsNode) -> str | None:
        """The Ray node alive at `node`'s address now, if it is not the one it joined as (a supervised node that
        came back after Ray's GCS declared it dead: a new node to Ray)."""
        for n in ray.nodes():
            if n["Alive"] and n["NodeManagerAddress"] == node.ip and n["NodeID"] != node.node_id:
                return str(n["NodeID"])
        return None

    def _ray_node(self, ip: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n in ray.nodes():
                if n["Alive"] and n["NodeManagerAddress"] == ip:
                    return str(n["NodeID"])
            time.sleep(0.2)
        raise TimeoutError(f"no Ray node at {ip} within {timeout_s} s")

    def controller(self) -> Any:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)

    def view_nodes(self, node: NetnsNode) -> int | None:
        """How many nodes `node`'s gateway sees (None: not answering, or its models not ready yet)."""
        try:
            reply = httpx.get(node.url + "/ember/status", timeout=2)
            ready = httpx.get(node.url + "/v2/health/ready", timeout=2).status_code == 200
            reply.raise_for_status()
            return len(reply.json()["node"].get("cluster", {}).get("nodes", [])) if ready else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def wait_joined(self, count: int, timeout_s: float) -> None:
        """Until every node's gateway sees `count` nodes and each has reported what it holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.view_nodes(n) == count for n in self.nodes) and self._reported_all():
                return
            for n in self.nodes:
                if n.serve.poll() is not None:
                    raise RuntimeError(f"node {n.index}'s ember serve exited:\n"
                                       f"{(n.state_dir / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.25)
        raise TimeoutError(f"the nodes did not all see {count} nodes within {timeout_s} s")

    def _reported_all(self) -> bool:
        view = ray.get(self.controller().view.remote())
        models = {c.key for c in view.contracts}
        return len(view.nodes) == len(self.nodes) and all(models <= {h.model for h in n.held} for n in view.nodes)

    def kill(self, node: NetnsNode) -> int:
        """The machine dies: every process of the node at once (raylet, workers, ember serve and its children)."""
        assert self.lab is not None
        self.nodes.remove(node)
        self.lost.append(node)
        return node.ns.kill()

    def departed(self) -> list[tuple[str, str, float]]:
        """The controller's record of nodes that left its view: (node id, why, when: time.monotonic())."""
        found: list[tuple[str, str, float]] = ray.get(self.controller().departed.remote())
        return found

    def close(self) -> None:
        with contextlib.suppress(Exception):   # first: this driver's shutdown waits ~2 min on raylets killed under it
            if ray.is_initialized():
                ray.shutdown()
        if self.lab is not None:
            self.lab.close()   # every node's processes killed, the namespaces and the bridge deleted
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
