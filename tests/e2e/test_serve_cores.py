"""`ember serve --cpu-slots N` on a machine with more cores: instances run on their slices' cores, and the node's own
processes (the gateway, zygotes, templates) on the cores no slice owns."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir

IRIS = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]}


def affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def serve(tmp_path: Path, slots: int) -> EmberServer:
    return EmberServer(tmp_path, "--no-examples", "--models", str(example_contracts_dir() / "iris.yaml"),
                       "--cpu-slots", str(slots), "--log-level", "warning")


def descendants(pid: int) -> list[int]:
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += [int(child), *descendants(int(child))]
    return found


def test_fewer_slots_than_cores_keep_the_node_off_the_slices_cores(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing is left over for the node")
    with serve(tmp_path, 1) as server:
        r = httpx.post(f"{server.url}/v2/models/iris/infer", json=IRIS, timeout=60)
        assert r.status_code == 200, r.text
        assert server.proc is not None
        instance = next(int(i["pid"]) for i in server.instances("iris") if i.get("pid"))
        assert affinity(instance) == {cores[0]}                 # slot 0's core
        rest = set(cores[1:])
        assert affinity(server.proc.pid) == rest                # the gateway
        others = [p for p in descendants(server.proc.pid) if p != instance]
        assert others and all(affinity(p) == rest for p in others)   # zygotes and the template


def test_a_slot_per_core_leaves_the_node_on_every_core(tmp_path: Path) -> None:
    cores = os.sched_getaffinity(0)
    with serve(tmp_path, len(cores)) as server:
        assert server.proc is not None
        assert affinity(server.proc.pid) == cores
