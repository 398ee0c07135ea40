"""The sleep frames on a real node: an instance whose model has a sleep mode says so in its hello, sleeps at a
level it offers (stopped afterwards, its resident memory reported), refuses one it does not, and answers as
before once woken."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from ember.core.states import Rung
from ember.errors import EmberError, ModelFailed
from ember.node import procinfo
from ember.wire.contract import load_contract
from tests.integration.node.test_local_node import MODELS, cpu_slice, probe_contract, running_node, wait_for_state


def test_a_model_with_a_sleep_mode_sleeps_gives_its_memory_back_and_answers_once_woken() -> None:
    async def main() -> None:
        contract = load_contract(MODELS / "sleeper.yaml")
        contract = contract.model_copy(update={"options": {"mb": 96}})
        x = {"x": np.array([1.0, 2.0], dtype=np.float32)}
        async with running_node() as node:
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            assert started.sleep_levels == (1, 2)
            iid = started.instance_id
            before = (await node.infer(iid, x))["y"]
            awake_mb = node.memory(iid).rss_bytes / 2**20
            held_1 = await node.sleep(iid, 1)
            assert await wait_for_state(started.pid, "T") == "T"        # asleep, then stopped
            assert held_1 > 96                                          # level 1 keeps the weights
            await node.wake(iid)
            assert procinfo.state_of(started.pid) in ("R", "S")
            held_2 = await node.sleep(iid, 2)
            assert held_2 < awake_mb - 80                               # level 2 gave the 96 MB back
            await node.wake(iid)
            after = (await node.infer(iid, x))["y"]
            assert np.array_equal(after[:-1], before[:-1]) and after[-1] == 2    # y's last value: wakes so far

    asyncio.run(main())


def test_a_level_the_model_does_not_offer_and_a_model_without_a_sleep_mode_are_refused() -> None:
    async def main() -> None:
        probe = probe_contract()
        async with running_node() as node:
            await node.prepare(probe)
            started = await node.start(probe, Rung.ZYGOTE, cpu_slice())
            assert started.sleep_levels == ()
            with pytest.raises(EmberError, match="cannot sleep"):
                await node.sleep(started.instance_id, 1)
            # Refused before it was stopped: it still answers.
            out = await node.infer(started.instance_id, {"x": np.array([1.0], np.float32),
                                                         "cmd": np.array([b"go"], dtype=object)})
            assert out["y"].tolist() == [2.0]

    asyncio.run(main())


def test_a_request_reaching_an_asleep_instance_wakes_it_and_a_wake_after_is_a_no_op() -> None:
    async def main() -> None:
        contract = load_contract(MODELS / "sleeper.yaml")
        x = {"x": np.array([1.0, 0.0], dtype=np.float32)}
        async with running_node() as node:
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            iid = started.instance_id
            await node.sleep(iid, 2)
            os.kill(started.pid, signal.SIGCONT)   # as a wake does first; the request's frame comes before its own
            out = (await node.infer(iid, x))["y"]
            assert out[-1] == 1                    # woken once, by the request
            await node.wake(iid)                   # the wake frame after it: nothing to do
            assert (await node.infer(iid, x))["y"][-1] == 1

    asyncio.run(main())


def test_a_sleep_that_does_not_answer_in_time_fails_naming_it() -> None:
    async def main() -> None:
        contract = load_contract(MODELS / "sleeper.yaml").model_copy(update={"options": {"hang_s": 30}})
        async with running_node(ready_timeout_s=2.0) as node:
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(ModelFailed, match="no answer to sleep in 2 s"):
                await node.sleep(started.instance_id, 1)
            assert loop.time() - t0 < 10

    asyncio.run(main())
