"""The RESTORE rung on a real node: MiniLM's process image made at prepare, instances restored from it (each in a
pid namespace of its own, inside its sandbox) answer as a zygote's instance does, and a restarted node on the same
state dir restores from the image it left: its template too, whose replicas it knows by their pids on the host."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import criu
from ember.node.local_node import LocalNode
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow


def sentences(*texts: str) -> dict[str, np.ndarray]:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return {"text": array}


async def image_ready(node: LocalNode, contract: object, timeout_s: float = 120.0) -> None:
    for _ in range(int(timeout_s * 10)):
        if node.can_restore(contract):   # type: ignore[arg-type]
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no image within the timeout")


def test_instances_restored_from_the_image_answer_in_their_sandbox_and_survive_a_restart() -> None:
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")

    async def main() -> None:
        contract = load_contract(example_contracts_dir() / "minilm.yaml")
        cpu = sorted(os.sched_getaffinity(0))[0]
        slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=1024, cpus=(cpu,), threads=1)
        state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")
        request = sentences("A cat sits on the mat.", "Serverless inference with warm starts.")
        node = LocalNode(state, snapshots=True)
        try:
            await node.prepare(contract)
            await image_ready(node, contract)
            loaded = await node.start(contract, Rung.ZYGOTE, slice_)
            restored = [await node.start(contract, Rung.RESTORE, slice_) for _ in range(2)]
            expected = await node.infer(loaded.instance_id, request)
            for started in restored:
                assert started.rung is Rung.RESTORE
                out = await node.infer(started.instance_id, request)
                np.testing.assert_allclose(out["embedding"], expected["embedding"], atol=1e-5)
            pids = node.pids()
            assert len({pids[s.instance_id] for s in restored}) == 2
            # The same sandbox as the zygote's instance: read-only view, the model's user, seccomp, cgroups.
            reports = [node._table.procs[s.instance_id].hello["sandbox"] for s in (loaded, *restored)]
            assert all(sorted(r["enforced"]) == sorted(reports[0]["enforced"]) for r in reports), reports
            assert "filesystem:read-only" in reports[0]["enforced"]
            # What the restore brought back is charged to the instance's own memory cgroup, not the node's.
            group = node._table.procs[restored[1].instance_id].cgroup
            if group is not None:
                usage = next((group.memory / f).read_text() for f in ("memory.current", "memory.usage_in_bytes")
                             if (group.memory / f).exists())
                assert int(usage) > 50 * 2**20   # the model's tensors (MiniLM: ~90 MB of float32)
            made = (node._images.path(contract) / "ember.json").stat().st_mtime_ns
            await node.stop(restored[0].instance_id)
        finally:
            await node.close()
        again = LocalNode(state, snapshots=True)   # a restart on the same state dir: the image is there
        exits: list[tuple[str, int]] = []
        again.on_exit(lambda tag, status: exits.append((tag, status)))
        try:
            await again.prepare(contract)
            await image_ready(again, contract, timeout_s=30)
            assert (again._images.path(contract) / "ember.json").stat().st_mtime_ns == made   # not made again
            # The template came back from the image: nothing loaded the model on this node.
            assert again.has_template(contract.key) and again.snapshot_status()["loads"] == 0
            started = await again.start(contract, Rung.RESTORE, slice_)
            out = await again.infer(started.instance_id, request)
            np.testing.assert_allclose(out["embedding"], expected["embedding"], atol=1e-5)
            replicas = [await again.start(contract, Rung.TEMPLATE, slice_) for _ in range(2)]
            for replica in replicas:
                out = await again.infer(replica.instance_id, request)
                np.testing.assert_allclose(out["embedding"], expected["embedding"], atol=1e-5)
            assert again.snapshot_status()["loads"] == 0
            # A replica forks in the restored template's pid namespace; the node knows it by its pid here.
            pid = again.pids()[replicas[0].instance_id]
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            nspid = next(x for x in status if x.startswith("NSpid:")).split()
            assert int(nspid[1]) == pid and len(nspid) == 3
            await again.pause(replicas[0].instance_id)
            for _ in range(50):   # a signal is delivered when the process next runs
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T":
                    break
                await asyncio.sleep(0.02)
            assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T"
            await again.resume(replicas[0].instance_id)
            out = await again.infer(replicas[0].instance_id, request)
            np.testing.assert_allclose(out["embedding"], expected["embedding"], atol=1e-5)
            os.kill(again.pids()[replicas[1].instance_id], 9)   # a replica dies: the node hears of it
            for _ in range(50):
                if exits:
                    break
                await asyncio.sleep(0.1)
            assert exits == [(replicas[1].instance_id, -9)]
            await again.stop(replicas[0].instance_id)
            assert replicas[0].instance_id not in again.pids()
        finally:
            await again.close()
            shutil.rmtree(state, ignore_errors=True)

    asyncio.run(main())


def test_an_llm_restored_from_its_image_generates_what_a_zygote_instance_does() -> None:
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")

    async def main() -> None:
        import json

        contract = load_contract(example_contracts_dir() / "smollm2.yaml")
        cpu = sorted(os.sched_getaffinity(0))[0]
        slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=1024, cpus=(cpu,), threads=1)
        state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")
        request = np.empty(1, dtype=object)
        request[0] = json.dumps({"messages": [{"role": "user", "content": "Name three colours."}],
                                 "max_tokens": 12, "temperature": 0}).encode()
        node = LocalNode(state, snapshots=True)
        try:
            await node.prepare(contract)
            await image_ready(node, contract)
            texts = []
            for rung in (Rung.ZYGOTE, Rung.RESTORE):
                started = await node.start(contract, rung, slice_)
                out = await node.infer(started.instance_id, {"request": request})
                texts.append(bytes(out["text"][0]))
            assert texts[0] and texts[0] == texts[1]
        finally:
            await node.close()
            shutil.rmtree(state, ignore_errors=True)

    asyncio.run(main())
