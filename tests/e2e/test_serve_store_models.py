"""No shared disk: a contract directory (contract, python code, weights) pushed once to the weight store is served
by two `ember serve` nodes with their own state and store roots and no path in common. The first fetches it from
a real nginx origin; the second, given only the store name, takes every chunk from the first (a peer) and none
from the origin. The directory pushed is deleted before either node starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from ember.store import StoreConfig
from ember.testing.nginx import NginxOrigin, available
from ember.testing.server import EmberServer

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "scaler"
BODY = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ember-e2e-bundle-", dir="/tmp"))   # short: unix socket paths
    yield path
    for node in ("a", "b"):
        memory = StoreConfig(root=path / node / "store").memory_dir
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


def contract_directory(where: Path) -> Path:
    """The scaler fixture with its weights: one tensor, scale = 2.5."""
    shutil.copytree(FIXTURE, where)
    (where / "weights").mkdir()
    save_file({"scale": np.array([2.5], np.float32)}, str(where / "weights" / "scale.safetensors"))
    return where


def scale(server: EmberServer) -> tuple[list[float], str]:
    reply = httpx.post(server.url + "/v2/models/scaler/infer", json=BODY, timeout=60)
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
    return outputs["y"], outputs["source"][0]


def test_a_pushed_contract_directory_is_served_by_two_nodes_that_share_no_path(base: Path) -> None:
    if not available():
        pytest.skip("nginx is not installed (make system)")
    pushed = contract_directory(base / "pushed" / "scaler")
    push = subprocess.run([sys.executable, "-m", "ember", "store", "--root", str(base / "origin"), "--no-memory",
                           "--quiet", "push", str(pushed), "scaler:1"], capture_output=True, text=True, timeout=120)
    assert push.returncode == 0, push.stderr
    assert "contracts: scaler:1" in push.stdout
    shutil.rmtree(base / "pushed")   # from here on only the store holds the model
    with NginxOrigin(base / "origin") as origin:
        a = EmberServer(base / "a" / "state", "--models", "store:scaler:1", "--store-root", str(base / "a" / "store"),
                        "--store-origin", origin.url)
        with a:
            y, source = scale(a)
            assert y == [2.5, 5.0]
            assert Path(source).is_relative_to(base / "a" / "store")   # its code ran from a's own store
            from_origin = [p for p in origin.requests() if "/chunks/" in p]
            assert from_origin
            b = EmberServer(base / "b" / "state", "--models", "store:scaler:1",
                            "--store-root", str(base / "b" / "store"), "--store-origin", origin.url,
                            "--store-peers", a.url)
            with b:
                y, source = scale(b)
                assert y == [2.5, 5.0]
                assert Path(source).is_relative_to(base / "b" / "store")
                assert [p for p in origin.requests() if "/chunks/" in p] == from_origin   # every chunk from a
                index = httpx.post(b.url + "/v2/repository/index", json={}, timeout=10).json()
                assert {"name": "scaler", "version": "1", "state": "READY"}.items() <= index[0].items()
