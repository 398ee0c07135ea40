"""LocalNode with real processes: zygote and template forks, requests, pause, drain, crashes, memory, leaks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import InvalidInput, ModelFailed, ModelNotReady, WorkerCrashed
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.wire.contract import ModelContract, Scaling, load_contract

MODELS = Path(__file__).resolve().parent / "models"
CPUS = sorted(os.sched_getaffinity(0))


def probe_contract(**options: object) -> ModelContract:
    contract = load_contract(MODELS / "probe.yaml")
    return contract.model_copy(update={"options": dict(options)}) if options else contract


def broken_contract() -> ModelContract:
    return load_contract(MODELS / "broken.yaml")


def cpu_slice(index: int = 0, threads: int = 1) -> Slice:
    cpu = CPUS[index % len(CPUS)]
    return Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=512, cpus=(cpu,), threads=threads)


def probe_inputs(cmd: bytes = b"go", x: Iterable[float] = (1.0, 2.0, 3.0)) -> dict[str, np.ndarray]:
    command = np.empty(1, dtype=object)
    command[0] = cmd
    return {"x": np.asarray(list(x), dtype=np.float32), "cmd": command}


INFO = ("pid", "load_pid", "calls", "random", "numpy", "affinity", "omp", "began", "ended")


def info(outputs: dict[str, np.ndarray]) -> dict[str, int]:
    return dict(zip(INFO, (int(v) for v in outputs["info"]), strict=True))


@asynccontextmanager
async def running_node(**kwargs: object) -> AsyncIterator[LocalNode]:
    # Unix socket paths are short: pytest's tmp_path can be too long for them.
    state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")
    node = LocalNode(state, **kwargs)  # type: ignore[arg-type]
    try:
        yield node
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


async def wait_until_gone(pids: Iterable[int], within_s: float = 5.0) -> list[int]:
    """The pids still alive after `within_s` (reaping by init is asynchronous)."""
    pending = list(pids)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while pending and loop.time() < deadline:
        pending = [p for p in pending if procinfo.is_alive(p)]
        if pending:
            await asyncio.sleep(0.02)
    return pending


async def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll `check` until it holds or `within_s` passes (exits are reported asynchronously)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check() and loop.time() < deadline:
        await asyncio.sleep(0.01)


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def wait_for_state(pid: int, state: str, within_s: float = 5.0) -> str | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while (now := procinfo.state_of(pid)) != state and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return now


# --- starting instances ---------------------------------------------------------------------


def test_template_and_zygote_instances_answer_from_their_own_processes() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            assert node.has_template(contract.key)
            template_pid = node.pids()[f"template:{contract.key}"]
            zygote_pid = node.pids()["zygote:python"]
            from_template = await node.start(contract, Rung.TEMPLATE, cpu_slice(0))
            from_zygote = await node.start(contract, Rung.ZYGOTE, cpu_slice(1))
            assert (from_template.rung, from_zygote.rung) == (Rung.TEMPLATE, Rung.ZYGOTE)
            assert from_template.time_to_ready_s > 0 and from_zygote.time_to_ready_s > 0

            a = await node.infer(from_template.instance_id, probe_inputs(x=[1, 2, 3]))
            b = await node.infer(from_zygote.instance_id, probe_inputs(x=[5]))
            assert a["y"].tolist() == [2, 4, 6] and b["y"].tolist() == [10]
            ia, ib = info(a), info(b)
            assert ia["pid"] == from_template.pid and ib["pid"] == from_zygote.pid
            assert len({ia["pid"], ib["pid"], template_pid, zygote_pid}) == 4
            assert ia["load_pid"] == template_pid      # the template's loaded model, shared
            assert ib["load_pid"] == from_zygote.pid    # loaded in the child itself
            warmups = contract.warmup.requests
            assert ia["calls"] == ib["calls"] == warmups + 1   # warmed up before READY
            assert ia["affinity"] == 1 << CPUS[0] and ib["affinity"] == 1 << CPUS[1 % len(CPUS)]
            assert ia["omp"] == ib["omp"] == 1

    asyncio.run(main())


def test_replicas_reseed_pin_and_set_threads_and_the_template_stays_single_threaded() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            first = await node.start(contract, Rung.TEMPLATE, cpu_slice(0, threads=2))
            second = await node.start(contract, Rung.TEMPLATE, cpu_slice(1, threads=3))
            i1 = info(await node.infer(first.instance_id, probe_inputs()))
            i2 = info(await node.infer(second.instance_id, probe_inputs()))
            assert i1["random"] != i2["random"] and i1["numpy"] != i2["numpy"]
            assert (i1["omp"], i2["omp"]) == (2, 3)
            for tag in ("zygote:python", f"template:{contract.key}"):
                assert procinfo.thread_count(node.pids()[tag]) == 1, tag

    asyncio.run(main())


@pytest.mark.parametrize("poll_s", [0.0, 0.005])
def test_requests_to_different_instances_run_concurrently(poll_s: float) -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node(poll_s=poll_s) as node:
            await node.prepare(contract)
            ids = [(await node.start(contract, Rung.TEMPLATE, cpu_slice(i))).instance_id for i in range(2)]
            a, b = await asyncio.gather(*(node.infer(i, probe_inputs(b"sleep:0.3")) for i in ids))
            ia, ib = info(a), info(b)
            assert ia["began"] < ib["ended"] and ib["began"] < ia["ended"]   # the two calls overlapped

    asyncio.run(main())


def test_start_from_a_missing_template_or_an_unstartable_rung_fails_clearly() -> None:
    async def main() -> None:
        contract = probe_contract().model_copy(update={"scaling": Scaling(keep_template=False)})
        async with running_node() as node:
            await node.prepare(contract)
            assert not node.has_template(contract.key)
            assert node.template_memory(contract.key) is None
            with pytest.raises(ModelNotReady, match="no template"):
                await node.start(contract, Rung.TEMPLATE, cpu_slice())
            with pytest.raises(InvalidInput, match="rung"):
                await node.start(contract, Rung.HOT, cpu_slice())
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            assert (await node.infer(started.instance_id, probe_inputs(x=[0.5])))["y"].tolist() == [1.0]

    asyncio.run(main())


# --- errors -----------------------------------------------------------------------------------


def test_model_errors_become_error_replies_and_the_instance_lives_on() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            iid = (await node.start(contract, Rung.TEMPLATE, cpu_slice())).instance_id
            with pytest.raises(ModelFailed, match="probe was told to fail"):
                await node.infer(iid, probe_inputs(b"raise"))
            with pytest.raises(InvalidInput, match="the probe rejects it"):
                await node.infer(iid, probe_inputs(b"reject"))
            with pytest.raises(ModelFailed, match="pretends to have crashed"):   # it answered: not a crash
                await node.infer(iid, probe_inputs(b"pretend-crash"))
            bad = {**probe_inputs(), "x": np.ones(2, dtype=np.int32)}
            with pytest.raises(InvalidInput, match="input 'x'"):
                await node.infer(iid, bad)
            assert (await node.infer(iid, probe_inputs(x=[4])))["y"].tolist() == [8]

    asyncio.run(main())


def test_bad_user_module_is_model_not_ready_naming_the_cause_and_leaves_nothing() -> None:
    async def main() -> None:
        contract = broken_contract()
        async with running_node() as node:
            with pytest.raises(ModelNotReady, match="ModuleNotFoundError: No module named 'ember_no_such_dependency'"):
                await node.prepare(contract)
            assert not node.has_template(contract.key)
            with pytest.raises(ModelNotReady, match="ember_no_such_dependency"):
                await node.start(contract, Rung.ZYGOTE, cpu_slice())
            assert list(node.pids()) == ["zygote:python"]   # the runtime's zygote only
            zygote = node.pids()["zygote:python"]
            assert await wait_until_gone(children_of(zygote)) == []
            assert sorted(p.name for p in node.run_dir.iterdir()) == [f"z{1}.s"]

    asyncio.run(main())


# --- pause, stop, crashes -----------------------------------------------------------------


def test_pause_freezes_the_instance_and_resume_lets_it_answer() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            started = await node.start(contract, Rung.TEMPLATE, cpu_slice())
            await node.pause(started.instance_id)
            assert await wait_for_state(started.pid, "T") == "T"
            pending = asyncio.ensure_future(node.infer(started.instance_id, probe_inputs()))
            done, _ = await asyncio.wait({pending}, timeout=0.3)
            assert not done   # a stopped process cannot answer
            await node.resume(started.instance_id)
            assert (await pending)["y"].tolist() == [2, 4, 6]
            assert procinfo.state_of(started.pid) in ("R", "S")

    asyncio.run(main())


def test_stop_drains_in_flight_work_then_exits_cleanly() -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        contract = probe_contract()
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            busy = asyncio.ensure_future(node.infer(started.instance_id, probe_inputs(b"sleep:0.3")))
            await asyncio.sleep(0.05)
            await node.stop(started.instance_id)
            assert info(await busy)["pid"] == started.pid    # in-flight request answered
            assert node.exit_status(started.instance_id) == 0  # left by itself, not SIGKILLed
            assert await wait_until_gone([started.pid]) == []
            with pytest.raises(WorkerCrashed):
                await node.infer(started.instance_id, probe_inputs())
            await node.stop(started.instance_id)   # idempotent

            paused = await node.start(contract, Rung.TEMPLATE, cpu_slice())
            await node.pause(paused.instance_id)
            await node.stop(paused.instance_id)      # a paused instance is resumed to drain
            assert node.exit_status(paused.instance_id) == 0
        assert exits == []   # retiring is not a crash

    asyncio.run(main())


def test_a_polling_node_answers_in_order_pauses_and_reports_a_crash_mid_request() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node(poll_s=0.005) as node:
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            for k in range(1, 6):   # back to back: each request finds the instance polling
                out = await node.infer(started.instance_id, probe_inputs(x=[k]))
                assert out["y"].tolist() == [2 * k] and info(out)["calls"] == 2 + k   # after 2 warmups
            await node.pause(started.instance_id)
            assert await wait_for_state(started.pid, "T") == "T"
            await node.resume(started.instance_id)
            assert (await node.infer(started.instance_id, probe_inputs(x=[9])))["y"].tolist() == [18]
            busy = asyncio.ensure_future(node.infer(started.instance_id, probe_inputs(b"sleep:30")))
            await asyncio.sleep(0.1)
            os.kill(started.pid, signal.SIGKILL)
            with pytest.raises(WorkerCrashed, match=started.instance_id):
                await asyncio.wait_for(busy, 10)

    asyncio.run(main())


@pytest.mark.parametrize("rung", [Rung.TEMPLATE, Rung.ZYGOTE])
def test_sigkill_mid_request_raises_worker_crashed_and_reports_the_exit(rung: Rung) -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        reported = asyncio.Event()
        contract = probe_contract()

        def on_exit(iid: str, status: int) -> None:
            exits.append((iid, status))
            reported.set()

        async with running_node() as node:
            node.on_exit(on_exit)
            await node.prepare(contract)
            started = await node.start(contract, rung, cpu_slice())
            busy = asyncio.ensure_future(node.infer(started.instance_id, probe_inputs(b"sleep:30")))
            await asyncio.sleep(0.1)
            os.kill(started.pid, signal.SIGKILL)
            with pytest.raises(WorkerCrashed, match=started.instance_id):
                await asyncio.wait_for(busy, 10)
            await asyncio.wait_for(reported.wait(), 10)
            assert exits == [(started.instance_id, -signal.SIGKILL)]
            with pytest.raises(WorkerCrashed):
                node.memory(started.instance_id)

            other = await node.start(contract, rung, cpu_slice())   # the node carries on
            reported.clear()
            with pytest.raises(WorkerCrashed):
                await node.infer(other.instance_id, probe_inputs(b"exit:3"))
            await asyncio.wait_for(reported.wait(), 10)
            assert exits[-1] == (other.instance_id, 3)

    asyncio.run(main())


def test_a_dying_template_takes_its_replicas_along_and_reports_them() -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        contract = probe_contract()
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            await node.prepare(contract)
            replica = await node.start(contract, Rung.TEMPLATE, cpu_slice())
            os.kill(node.pids()[f"template:{contract.key}"], signal.SIGKILL)
            assert await wait_until_gone([replica.pid]) == []   # PDEATHSIG
            with pytest.raises(WorkerCrashed):
                await node.infer(replica.instance_id, probe_inputs())
            await eventually(lambda: bool(exits))
            assert exits == [(replica.instance_id, -signal.SIGKILL)]
            assert not node.has_template(contract.key)
            await node.prepare(contract)   # and it can be prepared again
            assert node.has_template(contract.key)

    asyncio.run(main())


@pytest.mark.parametrize("forked", [False, True], ids=["before-fork-reply", "while-loading"])
def test_release_while_an_instance_starts_fails_the_start_and_leaves_no_process(forked: bool) -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        contract = probe_contract(load_sleep_s=30).model_copy(update={"scaling": Scaling(keep_template=False)})
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            await node.prepare(contract)
            zygote = node.pids()["zygote:python"]
            starting = asyncio.ensure_future(node.start(contract, Rung.ZYGOTE, cpu_slice()))
            await asyncio.sleep(0)
            if forked:
                while len(node.pids()) < 2:   # the fork reply gave the instance its pid
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(node.release(contract.key), 5)
            with pytest.raises(ModelNotReady, match="stopped while starting|exited while starting"):
                await asyncio.wait_for(starting, 10)
            assert list(node.pids()) == ["zygote:python"]
            await eventually(lambda: not children_of(zygote))
            assert children_of(zygote) == []
            assert exits == []   # stopped on purpose, not a crash

    asyncio.run(main())


def test_a_cancelled_start_leaves_no_process() -> None:
    async def main() -> None:
        contract = probe_contract(load_sleep_s=30).model_copy(update={"scaling": Scaling(keep_template=False)})
        async with running_node() as node:
            await node.prepare(contract)
            zygote = node.pids()["zygote:python"]
            starting = asyncio.ensure_future(node.start(contract, Rung.ZYGOTE, cpu_slice()))
            await asyncio.sleep(0)   # the fork command is on its way; cancel before its reply
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            await eventually(lambda: not children_of(zygote))
            assert children_of(zygote) == []

    asyncio.run(main())


def test_an_instance_that_loses_its_connection_is_killed_and_reported() -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        contract = probe_contract()
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            await node.prepare(contract)
            started = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            link = node._table.procs[started.instance_id].link   # break the connection, not the process
            assert link is not None
            link.close()
            with pytest.raises(WorkerCrashed):
                for _ in range(100):
                    await node.infer(started.instance_id, probe_inputs())
                    await asyncio.sleep(0.01)
            assert await wait_until_gone([started.pid], within_s=10) == []
            await eventually(lambda: bool(exits))
            assert exits == [(started.instance_id, -signal.SIGKILL)]

    asyncio.run(main())


# --- memory -------------------------------------------------------------------------------


def test_replicas_share_the_templates_weights() -> None:
    async def main() -> None:
        contract = probe_contract(ballast_mb=64)
        async with running_node() as node:
            await node.prepare(contract)
            alone = node.template_memory(contract.key)
            assert alone is not None and alone.rss_bytes > 64 << 20
            replicas = [await node.start(contract, Rung.TEMPLATE, cpu_slice(i)) for i in range(2)]
            shared = node.template_memory(contract.key)
            assert shared is not None
            for replica in replicas:
                usage = node.memory(replica.instance_id)
                assert usage.rss_bytes > 64 << 20                 # it maps the weights...
                assert usage.uss_bytes < alone.rss_bytes * 0.25   # ...but owns few pages of its own
            assert shared.pss_bytes < alone.pss_bytes * 0.6     # the template's share is split three ways

    asyncio.run(main())


# --- release, close, parent death ---------------------------------------------------------


def test_release_stops_the_template_and_every_instance_of_the_model() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            started = [await node.start(contract, rung, cpu_slice()) for rung in (Rung.TEMPLATE, Rung.ZYGOTE)]
            template = node.pids()[f"template:{contract.key}"]
            await node.release(contract.key)
            assert not node.has_template(contract.key)
            assert list(node.pids()) == ["zygote:python"]
            assert await wait_until_gone([template, *(s.pid for s in started)]) == []

    asyncio.run(main())


def test_a_plan_releases_the_template_then_the_zygote_only_once_nothing_depends_on_them() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            replica = await node.start(contract, Rung.TEMPLATE, cpu_slice())
            pids = node.pids()
            assert not await node.release_template(contract.key)    # its replica would die with it
            assert not await node.release_zygote("python")          # so would the template
            assert node.has_template(contract.key) and node.has_zygote("python")
            await node.stop(replica.instance_id)
            assert await node.release_template(contract.key)
            assert await node.release_zygote("python")
            assert not node.pids() and await wait_until_gone(pids.values()) == []
            again = await node.start(contract, Rung.ZYGOTE, cpu_slice())   # the zygote comes back on demand
            assert node.has_zygote("python") and info(await node.infer(again.instance_id, probe_inputs()))

    asyncio.run(main())


def test_close_leaves_no_processes() -> None:
    async def main() -> None:
        contract = probe_contract()
        async with running_node() as node:
            await node.prepare(contract)
            await node.start(contract, Rung.TEMPLATE, cpu_slice())
            paused = await node.start(contract, Rung.ZYGOTE, cpu_slice())
            await node.pause(paused.instance_id)
            pids = list(node.pids().values())
            assert len(pids) == 4
            await node.close()
            assert node.pids() == {}
            assert await wait_until_gone(pids) == []
            assert list(node.run_dir.iterdir()) == []

    asyncio.run(main())


NODE_SCRIPT = """
import asyncio, json, sys
from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node.local_node import LocalNode
from ember.wire.contract import load_contract

async def main():
    node = LocalNode(sys.argv[2])
    contract = load_contract(sys.argv[1])
    await node.prepare(contract)
    await node.start(contract, Rung.TEMPLATE, Slice("cpu", "cpu", 64))
    await node.start(contract, Rung.ZYGOTE, Slice("cpu", "cpu", 64))
    print(json.dumps(list(node.pids().values())), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_processes_die_with_a_killed_node() -> None:
    async def main() -> None:
        state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", NODE_SCRIPT, str(MODELS / "probe.yaml"), state, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        try:
            pids = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            assert len(pids) == 4 and all(procinfo.is_alive(p) for p in pids)
        finally:
            proc.kill()
            await proc.wait()
            shutil.rmtree(state, ignore_errors=True)
        assert await wait_until_gone(pids) == []   # PR_SET_PDEATHSIG down the chain

    asyncio.run(main())


def test_a_dying_zygote_takes_everything_along_and_the_next_prepare_restarts_it() -> None:
    async def main() -> None:
        exits: list[tuple[str, int]] = []
        contract = probe_contract()
        async with running_node() as node:
            node.on_exit(lambda iid, status: exits.append((iid, status)))
            # concurrent prepares share one zygote and one template
            await asyncio.gather(node.prepare(contract), node.prepare(contract))
            assert sorted(node.pids()) == [f"template:{contract.key}", "zygote:python"]
            started = [await node.start(contract, rung, cpu_slice()) for rung in (Rung.TEMPLATE, Rung.ZYGOTE)]
            before = list(node.pids().values())
            os.kill(node.pids()["zygote:python"], signal.SIGKILL)
            assert await wait_until_gone(before) == []
            await eventually(lambda: len(exits) == 2)
            assert sorted(exits) == sorted((s.instance_id, -signal.SIGKILL) for s in started)
            assert node.pids() == {} and not node.has_template(contract.key)
            await node.prepare(contract)
            again = await node.start(contract, Rung.TEMPLATE, cpu_slice())
            assert (await node.infer(again.instance_id, probe_inputs(x=[1])))["y"].tolist() == [2]

    asyncio.run(main())
