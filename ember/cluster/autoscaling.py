"""Ray's own autoscaler on this machine: its fake multi-node provider adds and removes raylets (issue 32).

`AutoscaledCluster` starts a Ray head (`ray start --head`, no CPUs) whose autoscaler runs Ray's
`FakeMultiNodeProvider` (`provider: {type: fake_multinode}`): when demand asks for a worker, Ray's
`StandardAutoscaler` (v1, the monitor process on the head; or v2 with `AutoscalerSettings.v2`) "launches" one by
starting a raylet on this machine, and terminates it (kills its processes) after `idle_timeout_s` with nothing
held on it. On the head runs the
controller actor and a gateway only (`--cpu-slots 0`); a *launcher* thread starts `ember serve --ray ADDRESS
--ray-node-id NODE` with `worker_args` for every raylet the autoscaler adds, and kills it when that raylet is
gone: what a KubeRay worker pod does (its container runs `ember serve` beside the raylet, and goes with the pod;
a fake raylet runs no command of its own). Not a node agent: an actor holds a lease on a Ray worker for its
life, and Ray counts a node with a leased worker as busy ("Busy workers on node", even at num_cpus=0: checked
here, a worker with a 0-CPU actor on it was never removed), so an agent-started node never idles out. A driver
holds no lease: a serve process is idle to Ray until it holds its bundle. Nothing here decides when to
scale: the controller asks Ray (`request_resources`, `ember/cluster/actors.py` `RayScaler`), each node holds its
bundle while it has work (`ember/cluster/busy.py`), and Ray's autoscaler decides.

Why a namespace: the fake provider's raylets are children of Ray's monitor process, and only `ray stop --force`
(which stops every Ray process it can see) cleans up after them, so Ray's own `AutoscalingCluster` stops every Ray
process on the machine (and, in Ray 2.60's wheel, cannot start at all: it reads
`fake_multi_node/example.yaml`, which the wheel does not ship). This cluster therefore runs only inside a PID,
mount and network namespace of its own (`namespaced`: `unshare --pid --fork --mount-proc --net --mount`, loopback
up, a private tmpfs on /tmp/ray): the head's port 6379 and every raylet are on that namespace's loopback, and when
its first process exits the kernel ends every process in it. `start` refuses to run outside one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

from ember.cluster.actors import NAMESPACE, controller
from ember.ports import free_port

log = logging.getLogger("ember.cluster")

WORKER_TYPE = "ember.worker"
GCS_PORT = 6379


@dataclass(frozen=True)
class AutoscalerSettings:
    max_workers: int = 2
    worker_cpus: int = 1              # one node bundle (`NODE_BUNDLE`) per worker, as deploy/kuberay's pods
    idle_timeout_s: float = 6.0       # Ray's `idle_timeout_minutes` (KubeRay: idleTimeoutSeconds)
    update_interval_s: int = 1        # the monitor's loop (AUTOSCALER_UPDATE_INTERVAL_S; Ray's default 5)
    v2: bool = False                  # Ray's autoscaler v2 (RAY_enable_autoscaler_v2) instead of v1


_PROVIDER = {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
             "disable_launch_config_check": True}
# v2's config reader fills in the provider's defaults from `fake_multi_node/example.yaml`, which Ray 2.60's wheel
# lacks (FileNotFoundError, the monitor exits): the same provider class named as an external one needs no file.
_V2_PROVIDER = {**_PROVIDER, "type": "external",
                "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID}


def autoscaling_config(s: AutoscalerSettings) -> dict[str, Any]:
    """The cluster config Ray's monitor reads: the fake provider, a CPU-less head, one worker type from zero."""
    return {
        "cluster_name": "ember", "max_workers": s.max_workers,
        "provider": dict(_PROVIDER),
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {"resources": {"CPU": s.worker_cpus}, "node_config": {}, "min_workers": 0,
                          "max_workers": s.max_workers},
        },
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0,
        "idle_timeout_minutes": s.idle_timeout_s / 60, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    } | ({"provider": _V2_PROVIDER} if s.v2 else {})


def autoscaler_env(s: AutoscalerSettings) -> dict[str, str]:
    """The head's environment for Ray's monitor: the fake provider, its loop, and v2's switches (as Ray's own
    `AutoscalingCluster(autoscaler_v2=True)` sets them: the head takes the fake provider's head id)."""
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": str(s.update_interval_s)}
    if s.v2:
        env |= {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID}
    return env


def namespace_unavailable() -> str | None:
    """Why `namespaced` cannot run here (None: it can)."""
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "creating network and PID namespaces needs root"
    return None


MARKER = "EMBER_OWN_NAMESPACES"   # set by `namespaced` for the process it starts


def namespaced(argv: list[str]) -> list[str]:
    """`argv` in new PID, mount and network namespaces: loopback up, /tmp/ray private. The namespace's first
    process is a shell that waits for it, reaping the orphans reparented to it on the way (ended Ray processes
    would stay zombies under a first process that does not, and `ray stop` waits for them). Ray's token auth is
    off in there: `ray start --head` turns it on by itself once any local `ray.init()` on this machine has left a
    ~/.ray/auth_token, and drivers that connect by address then fail (InvalidAuthToken) unless told
    `RAY_AUTH_MODE=token`; nothing outside the namespace can reach this cluster anyway."""
    setup = "ip link set lo up && mkdir -p /tmp/ray && mount -t tmpfs ember-ray /tmp/ray && { \"$@\" & wait $!; }"
    return ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--mount", "--propagation", "private",
            "env", f"{MARKER}=1", "RAY_AUTH_MODE=disabled", "sh", "-c", setup, "sh", *argv]


def in_own_namespace() -> bool:
    """Started by `namespaced`, and its network namespace has nothing but loopback."""
    return os.environ.get(MARKER) == "1" and [name for _, name in socket.if_nameindex()] == ["lo"]


@dataclass
class Worker:
    """A raylet the autoscaler added, and the `ember serve` the launcher started for it."""

    node_id: str
    url: str
    serve: subprocess.Popen[bytes]
    seen_at: float                      # monotonic: when the launcher saw its raylet alive
    gone_at: float | None = None        # when its raylet was no longer alive


@dataclass
class AutoscaledCluster:
    root: Path
    gateway_args: list[str]              # the head's `ember serve` (a gateway only: --cpu-slots 0 is added)
    worker_args: list[str]               # every worker's `ember serve`
    settings: AutoscalerSettings = field(default_factory=AutoscalerSettings)
    env: dict[str, str] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    gateway_url: str = ""
    head_id: str = ""
    head_serve: subprocess.Popen[bytes] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _launcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{GCS_PORT}"

    def start(self) -> AutoscaledCluster:
        if not in_own_namespace():
            raise RuntimeError("AutoscaledCluster runs only inside namespaces of its own (`namespaced`): its "
                               "clean-up is `ray stop --force`, which stops every Ray process it can see")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "autoscaling.json"
        config.write_text(json.dumps(autoscaling_config(self.settings)))
        env = {**os.environ, **autoscaler_env(self.settings)}
        subprocess.run([_ray_cli(), "start", "--head", f"--port={GCS_PORT}", "--num-cpus=0",
                        f"--autoscaling-config={config}", "--include-dashboard=false", "--disable-usage-stats"],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        self.head_id = str(ray.get_runtime_context().get_node_id())
        controller()
        self.gateway_url, self.head_serve = self._serve(self.head_id, "head", [*self.gateway_args, "--cpu-slots", "0"])
        self._launcher = threading.Thread(target=self._launch, name="ember-launcher", daemon=True)
        self._launcher.start()
        return self

    def alive_workers(self) -> list[str]:
        """The ids of the raylets the autoscaler added that are alive now."""
        return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != self.head_id]

    def _launch(self) -> None:
        """Start `ember serve` on every raylet the autoscaler adds (a KubeRay pod's command); note those gone."""
        while not self._stop.wait(0.1):
            try:
                alive = set(self.alive_workers())
            except Exception as err:   # the GCS restarting or going away at the end
                log.warning("launcher: %s: %s", type(err).__name__, err)
                continue
            for node_id in sorted(alive - set(self.workers)):
                url, serve = self._serve(node_id, f"worker-{node_id[-5:]}", self.worker_args)
                self.workers[node_id] = Worker(node_id, url, serve, time.monotonic())
                log.info("launcher: ember serve for the new raylet %s", node_id)
            for node_id, worker in self.workers.items():
                if worker.gone_at is None and node_id not in alive:   # the pod is gone, and its container
                    worker.gone_at = time.monotonic()
                    worker.serve.kill()
                    worker.serve.wait()

    def _serve(self, node_id: str, name: str, args: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
        """`ember serve --ray` as node `node_id`, its state and log under root/name; its URL and process."""
        port, state = free_port(), self.root / name
        state.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ember", "serve", "--ray", self.address, "--ray-node-id", node_id,
               "--port", str(port), "--state-dir", str(state), *args]
        with (state / "serve.log").open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        return f"http://127.0.0.1:{port}", proc

    def close(self) -> None:
        self._stop.set()
        if self._launcher is not None:
            self._launcher.join(5)
        for proc in [w.serve for w in self.workers.values()] + ([self.head_serve] if self.head_serve else []):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if ray.is_initialized():
            ray.shutdown()
        # The namespace's end kills whatever is left.
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([_ray_cli(), "stop", "--force", "--grace-period", "1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)

    def __enter__(self) -> AutoscaledCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _ray_cli() -> str:
    """Ray's `ray` command of this Python's environment."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"
