"""deploy/Containerfile's image, run with podman: tini is PID 1 and ember the process it runs, as the image's
non-root user; the probes answer without an API key; a model is served from a contract directory in the weight
store (an nginx origin on this machine), with nothing mounted; SIGTERM stops it gracefully within seconds.

Opt-in (building the image takes minutes and gigabytes): EMBER_IMAGE_TEST=1. It uses the image EMBER_IMAGE
(default localhost/ember:VERSION, what deploy/build-image.sh tags), building it first with deploy/build-image.sh if
podman does not have it (BASE_ROOTFS or MMDEBSTRAP=1 there where no registry is reachable). It skips, saying why,
where podman is missing or cannot run a container here."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from ember.ports import free_port
from ember.store import StoreConfig, WeightStore
from ember.testing.nginx import NginxOrigin
from ember.testing.nginx import available as nginx_available

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("EMBER_IMAGE", f"localhost/ember:{importlib.metadata.version('ember')}")
BODY = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    if os.environ.get("EMBER_IMAGE_TEST") != "1":
        pytest.skip("the image test is opt-in: EMBER_IMAGE_TEST=1 (it builds a 2.5 GB image when missing)")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman)")
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        build = subprocess.run([str(ROOT / "deploy" / "build-image.sh")], capture_output=True, text=True,
                               timeout=3600, env={**os.environ, "IMAGE": IMAGE})
        assert build.returncode == 0, build.stderr[-3000:]
    trial = podman("run", "--rm", "--entrypoint", "true", IMAGE, check=False)
    if trial.returncode != 0:   # e.g. crun and cgroups in hybrid mode, or rlimits root may not raise (a VM's)
        pytest.skip(f"podman cannot run a container on this machine: {trial.stderr.strip()[-500:]}")
    return IMAGE


@pytest.fixture
def origin() -> Iterator[NginxOrigin]:
    """An nginx origin holding the scaler contract directory (tests/fixtures/bundles) as scaler:1."""
    if not nginx_available():
        pytest.skip("nginx is not installed (make system)")
    base = Path(tempfile.mkdtemp(prefix="ember-image-"))
    src = base / "scaler"
    shutil.copytree(ROOT / "tests" / "fixtures" / "bundles" / "scaler", src)
    (src / "weights").mkdir()
    save_file({"scale": np.array([2.5], np.float32)}, str(src / "weights" / "scale.safetensors"))
    with WeightStore(StoreConfig(root=base / "origin", memory_dir=None)) as store:
        store.push(src, "scaler:1")
    try:
        with NginxOrigin(base / "origin") as nginx:
            yield nginx
    finally:
        shutil.rmtree(base, ignore_errors=True)


def wait_live(url: str, container: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    logs = podman("logs", container, check=False)
    raise AssertionError(f"the container was not ready in {timeout_s} s:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}")


def test_the_image_serves_a_store_model_as_its_own_user_under_tini(image: str, origin: NginxOrigin) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = f"ember-test-{port}"
    # Host networking: the container reaches the origin on this machine's loopback, as a pod reaches its origin.
    podman("run", "-d", "--name", name, "--network", "host", "--shm-size", "1g", image, "serve",
           "--host", "127.0.0.1", "--port", str(port), "--auth", "on", "--no-examples",
           "--models", "store:scaler:1", "--store-origin", origin.url)
    try:
        wait_live(url, name)
        assert httpx.get(url + "/v2/health/live", timeout=5).json() == {"live": True}   # no key: probes are open
        processes = podman("exec", name, "ps", "-eo", "pid,ppid,uid,args", "--no-headers").stdout.splitlines()
        table = [line.split(None, 3) for line in processes]
        pid1 = next(p for p in table if p[0] == "1")
        assert pid1[3].startswith("/usr/bin/tini -- /opt/ember/bin/ember serve")
        ember = [p for p in table if p[1] == "1" and "ember serve" in p[3]]
        assert len(ember) == 1 and ember[0][2] == "10001"    # tini's one child: ember, not root
        assert all(p[2] == "10001" for p in table)
        assert httpx.post(url + "/v2/models/scaler/infer", json=BODY, timeout=30).status_code == 401
        made = json.loads(podman("exec", name, "ember", "keys", "create", "--tenant", "ops", "--json").stdout)
        reply = httpx.post(url + "/v2/models/scaler/infer", json=BODY, timeout=60,
                           headers={"Authorization": f"Bearer {made['key']}"})
        assert reply.status_code == 200, reply.text
        outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
        assert outputs["y"] == [2.5, 5.0]
        assert outputs["source"][0].startswith("/var/lib/ember/store/")   # written out of the image's own store
        assert any("/chunks/" in p for p in origin.requests())
        started = time.monotonic()
        podman("stop", "-t", "20", name, timeout=60)
        assert time.monotonic() - started < 10   # SIGTERM reached ember through tini: no 20 s wait for SIGKILL
        assert "Application shutdown complete" in podman("logs", name).stderr + podman("logs", name).stdout
    finally:
        podman("rm", "-f", name, check=False)
