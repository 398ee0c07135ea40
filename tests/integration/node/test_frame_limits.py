"""A node reads its instances' frames within what their protocol needs (ember/node/framing.py `PayloadLimits`,
ember/node/instance.py `payload_limits`): an instance whose frame announces more is killed, and logged, before a byte
of that payload is read; a well-behaved instance whose reply is past its limit answers ModelFailed instead, and
serves on."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import ModelFailed, WorkerCrashed
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.wire.contract import ModelContract, load_contract

MODELS = Path(__file__).resolve().parent / "models"
CPU = sorted(os.sched_getaffinity(0))[0]
HANG_GUARD_S = 60   # a node waiting for a payload that never comes would wait for ever: fail instead


def liar() -> ModelContract:
    return load_contract(MODELS / "liar.yaml")


def inputs(cmd: str, n: int = 3) -> dict[str, np.ndarray]:
    command = np.empty(1, dtype=object)
    command[0] = cmd.encode()
    return {"x": np.arange(n, dtype=np.float32), "cmd": command}


@asynccontextmanager
async def running_node(**kwargs: object) -> AsyncIterator[LocalNode]:
    state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")   # Unix socket paths are short
    node = LocalNode(state, **kwargs)  # type: ignore[arg-type]
    try:
        yield node
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


async def eventually(check: Callable[[], bool], within_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check() and loop.time() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("op", "length"), [("result", 1 << 30), ("pong", 1)], ids=["reply-of-1GiB", "pong-payload"])
def test_an_instance_announcing_a_payload_past_its_limit_is_killed_before_it_is_read(
        op: str, length: int, caplog: pytest.LogCaptureFixture) -> None:
    """The liar's memory_mb is 64: a 1 GiB reply is past it, and a pong carries no payload at all."""

    async def main() -> None:
        exits: list[tuple[str, int]] = []
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            await node.prepare(liar())
            started = await node.start(liar(), Rung.ZYGOTE, Slice(id=f"cpu-{CPU}", kind="cpu", memory_mb=512,
                                                                  cpus=(CPU,), threads=1))
            with pytest.raises(WorkerCrashed):
                await asyncio.wait_for(node.infer(started.instance_id, inputs(f"frame:{op}:{length}")), HANG_GUARD_S)
            await eventually(lambda: bool(exits) and not procinfo.is_alive(started.pid))
            assert exits == [(started.instance_id, -signal.SIGKILL)]

    with caplog.at_level(logging.WARNING, "ember.node"):
        asyncio.run(main())
    killed = [r.getMessage() for r in caplog.records if "its protocol does not allow" in r.getMessage()]
    assert len(killed) == 1 and f"a payload of {length} bytes" in killed[0] and "killing it" in killed[0]


def test_a_reply_past_the_nodes_reply_limit_is_a_model_error_and_the_instance_serves_on() -> None:
    async def main() -> None:
        async with running_node(max_reply_bytes=1024) as node:
            await node.prepare(liar())
            started = await node.start(liar(), Rung.ZYGOTE, Slice(id=f"cpu-{CPU}", kind="cpu", memory_mb=512,
                                                                  cpus=(CPU,), threads=1))
            with pytest.raises(ModelFailed, match="a reply of 4096 bytes, past the limit of 1024"):
                await node.infer(started.instance_id, inputs("echo", n=1024))
            small = await node.infer(started.instance_id, inputs("echo", n=256))
            assert small["y"].tolist() == list(range(256))

    asyncio.run(main())
