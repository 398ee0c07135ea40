"""`ember serve --ray ADDRESS`: this node joins the cluster (the one place the serve path touches Ray).

Two steps, before the server starts: `attach` connects to Ray, finds (or creates) the controller and takes
the cluster's one token, and the weight store's peer directory and fetch gate over the controller (the
node's store is built with them); `join` wraps the local controller in the cluster's routing.

A forwarded request carries its caller's API key, tenant and trace context, and the serving node admits it
itself (ember/gateway/cluster_api.py); with `--tls-dir` the links between gateways are mutual TLS with the
cluster's CA (`ember cluster init`; ember/tls.py). One token per cluster remains, for the weight store's chunk
fetches on plain links (`/v2/store/chunks`; with TLS a node's certificate is its pass): the controller's.
Whoever creates the controller (the first node to join, or `ember cluster up`) sets it: its
`--cluster-token` / `$EMBER_CLUSTER_TOKEN`, else a random one. A node that joins with a token of its own must
give the cluster's (else it refuses to start: a node the others could not fetch from); one without takes the
cluster's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from ember.cluster.forward import Forwarder
from ember.cluster.peers import ClusterChunks, ManifestIndex
from ember.cluster.service import ClusterService, ClusterSettings
from ember.config import ServeConfig
from ember.errors import InvalidInput
from ember.serving.controller import Controller
from ember.store.tiers.peer import FetchGate, PeerDirectory
from ember.tls import NodeTls

log = logging.getLogger("ember.cluster")


def advertised_url(config: ServeConfig) -> str:
    """This gateway's URL as the other nodes reach it: --advertise-url, else the bind address and port (a
    wildcard bind advertises this machine's address); https with --tls-dir."""
    if config.advertise_url is not None:
        return config.advertise_url.rstrip("/")
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{'https' if config.tls_dir is not None else 'http'}://{host}:{config.port}"


def one_token(given: str | None, cluster: str) -> str:
    """The token this node uses: the cluster's; a token given to the node must be that one."""
    if given is not None and given != cluster:
        raise InvalidInput("cluster_token: not the cluster's token (the Ray cluster's controller was created with "
                           "another): give every node the same --cluster-token / $EMBER_CLUSTER_TOKEN, or none "
                           "(a node without one takes the cluster's)")
    return cluster


@dataclass
class Attached:
    """A node attached to the cluster's controller, before its server is built."""

    config: ServeConfig               # with the cluster's token
    node_id: str
    handle: Any                       # the controller actor
    peers: PeerDirectory              # the weight store's peer tier and gate, over the controller
    gate: FetchGate


def normal_priority() -> int:
    """Run this process (and so every zygote, template and instance it starts) at niceness 0; the niceness it
    runs at.

    Why: a node agent is a Ray worker, and Ray starts its workers at niceness 15 (`worker_niceness`) so that
    tasks yield to the raylet; the `ember serve` it starts inherits that, and is then the first to lose a
    contended core to anything else on the machine (measured here: a cluster node's first request ~1.3x a
    lone server's while other work ran). Lowering niceness needs CAP_SYS_NICE (root has it); without it the
    node warns and keeps Ray's: start the Ray nodes with `RAY_worker_niceness=0`. (deploy/kuberay starts
    `ember serve` beside the raylet, not from a Ray worker: it runs at the pod's niceness.)"""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        log.warning("cluster: this node runs at niceness %d (Ray's worker niceness) and may not lower it: start the "
                    "Ray nodes with RAY_worker_niceness=0", os.getpriority(os.PRIO_PROCESS, 0))
    return os.getpriority(os.PRIO_PROCESS, 0)


def attach(config: ServeConfig) -> Attached:
    """Connect to Ray as a driver (blocking, before the server starts), find or create the controller actor,
    and take the cluster's token (see the module docstring)."""
    normal_priority()
    try:
        from ember.cluster.actors import RayChunks, connect, controller
    except ImportError as err:
        raise InvalidInput(f"ray: the cluster needs Ray: pip install 'ember[ray]' ({err})") from None
    assert config.ray is not None
    node_id = connect(config.ray)
    if config.ray_node_id is not None:
        node_id = config.ray_node_id   # the agent that started this process names the node it is pinned to
    given = config.cluster_token.get_secret_value() if config.cluster_token is not None else None
    handle = controller(token=given)
    import ray

    token = one_token(given, ray.get(handle.token.remote(), timeout=60))
    config = config.model_copy(update={"cluster_token": SecretStr(token)})
    chunks = ClusterChunks(node_id, RayChunks(handle), ManifestIndex(config.store_root), config.store_peers)
    return Attached(config, node_id, handle, chunks, chunks)


def join(attached: Attached, local: Controller) -> tuple[ClusterService, list[Coroutine[Any, Any, None]]]:
    """Wrap the local controller in the cluster's routing. Returns the service and its background work."""
    from ember.cluster.actors import NODE_BUNDLE, PARENT_ENV, RayLink
    from ember.cluster.busy import hold_while_busy

    config, node_id = attached.config, attached.node_id
    url = advertised_url(config)
    if config.tls_dir is not None and not url.startswith("https://"):
        raise InvalidInput(f"advertise_url: {url} is not https, but this node serves TLS (--tls-dir)")
    settings = ClusterSettings(node_id=node_id, url=url, report_s=config.cluster_report_s)
    tls = NodeTls.of(config.tls_dir).client_context() if config.tls_dir is not None else None
    # Kept-alive links close a second before the peers' own (the same --http-keepalive-s on every node).
    forwarder = Forwarder(config.request_timeout_s, tls, keepalive_s=max(0.5, config.http_keepalive_s - 1),
                          link=config.gateway_links)
    service = ClusterService(local, RayLink(attached.handle), forwarder, settings)
    log.info("cluster: joined Ray at %s as node %s, gateway %s (links: %s)", config.ray, node_id, url,
             "mutual TLS" if tls is not None else "plain HTTP: give every node --tls-dir (docs/cluster.md)")
    work = [service.run(), _leave_when_fenced(service, node_id)]
    hold = hold_while_busy(local, node_id, NODE_BUNDLE, config.cluster_report_s)   # busy to Ray's autoscaler
    if hold is not None:
        work.append(hold.run(config.cluster_report_s))
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        work.append(_die_with(int(parent)))
    return service, work


async def _leave_when_fenced(service: ClusterService, node_id: str) -> None:
    """Once Ray's GCS has declared this node dead (it fell silent past the health checks, then came back), Ray ends
    its raylet and the cluster takes nothing more from it: this process ends too (SIGTERM: requests in flight
    drain), and the supervisor that runs it (systemd `Restart=always`, a pod's restart) starts it again beside a
    new raylet, as a new node (docs/cluster.md, "A node that comes back")."""
    await service.watch()
    log.error("cluster: Ray's GCS declared this node (%s) dead: it is fenced off the cluster; ember serve exits, "
              "to be restarted beside a new raylet (ray start)", node_id)
    os.kill(os.getpid(), signal.SIGTERM)


async def _die_with(parent: int) -> None:
    """A serve process its node agent started goes when the agent goes (its machine left the cluster): at once,
    as the machine would, so nothing it held lingers on a node the cluster no longer lists."""
    while os.getppid() == parent:
        await asyncio.sleep(0.2)
    log.error("cluster: node agent %d is gone; this node leaves with it", parent)
    os.kill(os.getpid(), signal.SIGKILL)
