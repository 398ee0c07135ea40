"""A Ray cluster on this machine for trying ember on many nodes (`ember cluster up`), tests and benchmarks.

A head with no CPUs (the controller actor only) and N nodes of `ray.cluster_utils.Cluster`, each with a
node agent that starts its own `ember serve --ray` on its own loopback port and state directory. Every
node is a real raylet; `remove_node` takes one away as a lost machine would be. With `tls` (a directory
`ember cluster init` made a CA in), each node gets a certificate of that CA (`--tls-dir`) and serves HTTPS;
`headers` go with this module's own requests to the gateways (an admin key when they require keys).
"""

from __future__ import annotations

import contextlib
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster

from ember.cluster.actors import CONTROLLER, NAMESPACE, controller, start_agent
from ember.cluster.ca import issue
from ember.ports import free_port


@dataclass
class RayletNode:
    index: int
    ray_node: Any            # ray.cluster_utils' node handle
    agent: Any
    url: str
    state_dir: Path

    @property
    def node_id(self) -> str:
        return str(self.ray_node.node_id)


class LocalCluster:
    def __init__(self, root: Path, node_args: list[list[str]], *, env: dict[str, str] | None = None,
                 tls: Path | None = None, headers: dict[str, str] | None = None) -> None:
        self.root, self.node_args, self.env = root, node_args, env or {}
        self.tls, self.headers = tls, headers or {}
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(tls / "ca.crt")) if tls else True
        self.cluster: Cluster | None = None
        self.nodes: list[RayletNode] = []
        self._started = 0   # nodes started so far: each its own state directory, node0, node1, ...

    def start(self, ready_timeout_s: float = 120) -> LocalCluster:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        ray_nodes = [self.cluster.add_node(num_cpus=1) for _ in self.node_args]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        controller(token=self.given_token())   # the cluster's token: the one the nodes are given, if any
        for ray_node, args in zip(ray_nodes, self.node_args, strict=True):
            self._start_agent(ray_node, args)
        self.wait_joined(len(self.nodes), ready_timeout_s)
        return self

    def add_node(self, args: list[str], ready_timeout_s: float = 120) -> RayletNode:
        """One more machine, as an autoscaler would add it: a Ray node and its agent's `ember serve`."""
        assert self.cluster is not None, "start the cluster first"
        ray_node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        node = self._start_agent(ray_node, args)
        self.wait_joined(len(self.nodes), ready_timeout_s)
        return node

    def _start_agent(self, ray_node: Any, args: list[str]) -> RayletNode:
        assert self.cluster is not None
        i, port = self._started, free_port()
        self._started += 1
        state = self.root / f"node{i}"
        scheme = "http"
        if self.tls is not None:
            args, scheme = [*args, "--tls-dir", str(issue(self.tls, f"node{i}", ["127.0.0.1"]))], "https"
        agent = start_agent(ray_node.node_id, self.cluster.address, port, str(state), args, self.env)
        self.nodes.append(RayletNode(i, ray_node, agent, f"{scheme}://127.0.0.1:{port}", state))
        return self.nodes[-1]

    def given_token(self) -> str | None:
        """A token the nodes are given (`--cluster-token` in their arguments, else $EMBER_CLUSTER_TOKEN): the
        controller is created with it, since a node refuses a cluster whose token is another."""
        for args in self.node_args:
            for i, arg in enumerate(args[:-1]):
                if arg == "--cluster-token":
                    return args[i + 1]
        return self.env.get("EMBER_CLUSTER_TOKEN") or os.environ.get("EMBER_CLUSTER_TOKEN") or None

    def controller(self) -> Any:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)

    def view_nodes(self, node: RayletNode) -> int | None:
        """How many nodes `node`'s gateway sees (None: not answering, or its models not ready yet)."""
        try:
            status = httpx.get(node.url + "/ember/status", timeout=2, headers=self.headers, verify=self.verify).json()
        except (httpx.HTTPError, ValueError):
            return None
        nodes = len(status["node"].get("cluster", {}).get("nodes", []))
        try:
            ready = httpx.get(node.url + "/v2/health/ready", timeout=2, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return None
        return nodes if ready else None

    def wait_joined(self, count: int, timeout_s: float) -> None:
        """Until every live node's gateway sees `count` nodes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.view_nodes(n) == count for n in self.nodes) and self._reported_all():
                return
            for n in self.nodes:
                if not ray.get(n.agent.info.remote())["alive"]:
                    raise RuntimeError(f"node {n.index}'s ember serve exited:\n"
                                       f"{(n.state_dir / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.25)
        raise TimeoutError(f"the nodes did not all see {count} nodes within {timeout_s} s")

    def _reported_all(self) -> bool:
        """Every node has reported what it holds of every model of the registry (a node's first report goes out
        before it knows the registry)."""
        view = ray.get(self.controller().view.remote())
        models = {c.key for c in view.contracts}
        return all(models <= {h.model for h in n.held} for n in view.nodes)

    def remove_node(self, node: RayletNode) -> None:
        """Take a node away as a lost machine: its raylet, its workers (the agent) and so its `ember serve`."""
        assert self.cluster is not None
        self.nodes.remove(node)
        self.cluster.remove_node(node.ray_node, allow_graceful=False)

    def close(self) -> None:
        # Every node's `ember serve` told to stop at once, then waited for: each takes ~1.5 s to drain and exit.
        stopping = []
        for node in self.nodes:
            with contextlib.suppress(Exception):   # a node already gone: nothing of it to stop
                stopping.append(node.agent.stop.remote())
        for ref in stopping:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=30)
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
