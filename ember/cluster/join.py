"""`ember serve --ray ADDRESS`: this node joins the cluster (the one place the serve path touches Ray)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Coroutine
from typing import Any

from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.config import ServeConfig
from ember.errors import InvalidInput
from ember.serving.controller import Controller

log = logging.getLogger("ember.cluster")


def advertised_url(config: ServeConfig) -> str:
    """This gateway's URL as the other nodes reach it: --advertise-url, else the bind address and port (a
    wildcard bind advertises this machine's address)."""
    if config.advertise_url is not None:
        return config.advertise_url.rstrip("/")
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{config.port}"


def join(config: ServeConfig, local: Controller) -> tuple[ClusterService, list[Coroutine[Any, Any, None]]]:
    """Connect to Ray as a driver (blocking, before the server starts), find or create the controller actor,
    and wrap the local controller in the cluster's routing. Returns the service and its background work."""
    try:
        from ember.cluster.actors import PARENT_ENV, RayLink, connect, controller
    except ImportError as err:
        raise InvalidInput(f"ray: the cluster needs Ray: pip install 'ember[ray]' ({err})") from None
    assert config.ray is not None
    node_id = connect(config.ray)
    if config.ray_node_id is not None:
        node_id = config.ray_node_id   # the agent that started this process names the node it is pinned to
    url = advertised_url(config)
    settings = ClusterSettings(node_id=node_id, url=url, report_s=config.cluster_report_s)
    service = ClusterService(local, RayLink(controller()), Forwarder(config.request_timeout_s + 5), settings)
    log.info("cluster: joined Ray at %s as node %s, gateway %s", config.ray, node_id, url)
    work = [service.run()]
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        work.append(_die_with(int(parent)))
    return service, work


async def _die_with(parent: int) -> None:
    """A serve process its node agent started goes when the agent goes (its machine left the cluster): at once,
    as the machine would, so nothing it held lingers on a node the cluster no longer lists."""
    while os.getppid() == parent:
        await asyncio.sleep(0.2)
    log.error("cluster: node agent %d is gone; this node leaves with it", parent)
    os.kill(os.getpid(), signal.SIGKILL)
