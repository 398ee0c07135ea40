"""One instance, many requests at once (real processes via LocalNode): dynamic batching, a bad request in a
batch, streaming, cancel, per-request deadlines, and pings answered while the model works."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import Cancelled, DeadlineExceeded, ModelFailed
from ember.node.local_node import LocalNode
from ember.node.replies import InstanceReplies
from ember.wire.contract import ModelContract, load_contract

MODELS = Path(__file__).resolve().parent / "models"
CPUS = sorted(os.sched_getaffinity(0))


def cpu_slice(index: int = 0, threads: int = 1) -> Slice:
    cpu = CPUS[index % len(CPUS)]
    return Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=512, cpus=(cpu,), threads=threads)


def contract_of(name: str, **options: object) -> ModelContract:
    contract = load_contract(MODELS / f"{name}.yaml")
    return contract.model_copy(update={"options": {**contract.options, **options}})


@asynccontextmanager
async def running_instance(contract: ModelContract, rung: Rung = Rung.TEMPLATE,
                           poll_s: float = 0.0) -> AsyncIterator[tuple[LocalNode, str]]:
    """A node with one instance of `contract` (prepared first, so TEMPLATE can fork the template)."""
    # Unix socket paths are short: pytest's tmp_path can be too long for them.
    state = tempfile.mkdtemp(prefix="ember-many-", dir="/tmp")
    # Unsandboxed: these models tell the test what they saw through files in /tmp, a channel the sandbox closes
    # (its /tmp is the instance's own); test_sandbox.py covers the sandbox.
    node = LocalNode(state, poll_s=poll_s, sandbox=False)
    try:
        await node.prepare(contract)
        started = await node.start(contract, rung, cpu_slice())
        yield node, started.instance_id
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


def rows(*values: Iterable[float]) -> dict[str, np.ndarray]:
    """A batcher request: one row of x per pair of values."""
    return {"x": np.asarray([list(v) for v in values], dtype=np.float32).reshape(-1, 2)}


def stream_inputs(n: int, sleep_s: float = 0.0) -> dict[str, np.ndarray]:
    return {"n": np.array([n], dtype=np.int64), "sleep_s": np.array([sleep_s], dtype=np.float32)}


def read_count(path: Path) -> dict[str, Any]:
    """What the streamer last wrote: {"yielded": N, "closed": bool}."""
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def drain(replies: InstanceReplies) -> list[dict[str, np.ndarray]]:
    return [reply async for reply in replies]


# --- batching ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("rung", "poll_s"), [(Rung.TEMPLATE, 0.0), (Rung.ZYGOTE, 0.005)])
def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(rung: Rung, poll_s: float) -> None:
    async def main() -> None:
        async with running_instance(contract_of("batcher"), rung, poll_s) as (node, iid):
            # 16 requests of 1 or 2 rows each (24 rows: more than one batch of 16), all values distinct.
            requests = [rows(*([10 * i + r, 10 * i + r + 0.5] for r in range(1 + i % 2))) for i in range(16)]
            answers = await asyncio.gather(*(node.infer(iid, request) for request in requests))
            batches = []
            for request, answer in zip(requests, answers, strict=True):
                assert answer.keys() == {"y", "batch"}
                assert answer["y"].shape == request["x"].shape
                assert answer["y"].tolist() == (request["x"] * 2).tolist()
                served = set(answer["batch"].tolist())
                assert len(served) == 1                 # all of a request's rows in one forward pass
                batch = served.pop()
                assert len(request["x"]) <= batch <= 16
                batches.append(batch)
            assert max(batches) > 1                     # requests were run together

    asyncio.run(main())


def test_one_bad_request_in_a_batch_fails_alone() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "calls.jsonl"
            async with running_instance(contract_of("batcher", log=str(log))) as (node, iid):
                # The first request keeps the model busy (50 ms) while the rest queue behind it, so the
                # bad one shares a forward pass with good ones whichever way the frames are read.
                good = [rows([i, i + 0.25]) for i in range(1, 9)]
                bad = rows([-1, 1])
                sent = [rows([0.5, 0.5]), *good[:4], bad, *good[4:]]
                answers = await asyncio.gather(*(node.infer(iid, r) for r in sent), return_exceptions=True)
                failed = answers[5]
                assert isinstance(failed, ModelFailed), failed
                assert "takes no negative x" in failed.message
                for request, answer in zip(sent[:5] + sent[6:], answers[:5] + answers[6:], strict=True):
                    assert isinstance(answer, dict), answer
                    assert answer["y"].tolist() == (request["x"] * 2).tolist()
                calls = read_log(log)
                # The bad row did run in a batch with others, which failed as a whole...
                assert any(c["bad"] and c["rows"] > 1 for c in calls), calls
                # ...and then alone, which is the only failure its batch mates did not share.
                assert {"rows": 1, "bad": True} in calls
                after = await node.infer(iid, rows([3, 4]))
                assert after["y"].tolist() == [[6, 8]]

    asyncio.run(main())


# --- streaming ---------------------------------------------------------------------------------


def test_a_stream_yields_its_replies_in_order_and_infer_concatenates_them() -> None:
    async def main() -> None:
        async with running_instance(contract_of("streamer")) as (node, iid):
            replies = await node.open(iid, stream_inputs(5, 0.01))
            got = await drain(replies)
            assert [reply["i"].tolist() for reply in got] == [[0], [1], [2], [3], [4]]
            await asyncio.wait_for(replies.settled(), 5)
            whole = await node.infer(iid, stream_inputs(7))
            assert whole["i"].tolist() == list(range(7))
            single = await node.infer(iid, stream_inputs(1))
            assert single["i"].tolist() == [0]

    asyncio.run(main())


def test_cancel_stops_a_stream_and_frees_the_instance() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            count = Path(tmp) / "count.json"
            async with running_instance(contract_of("streamer", count_file=str(count))) as (node, iid):
                replies = await node.open(iid, stream_inputs(1000, 0.01))   # 10 s if left alone
                first = await replies.__anext__()
                assert first["i"].tolist() == [0]
                replies.cancel()
                replies.cancel()   # a second cancel is harmless
                await asyncio.wait_for(replies.settled(), 5)
                with pytest.raises(Cancelled):
                    await drain(replies)   # replies already on their way, then the cancel
                stopped = read_count(count)
                assert stopped["closed"] and stopped["yielded"] < 1000   # the generator was closed early
                after = await asyncio.wait_for(node.infer(iid, stream_inputs(3)), 5)
                assert after["i"].tolist() == [0, 1, 2]
                assert read_count(count) == {"yielded": 3, "closed": True}

    asyncio.run(main())


def test_cancel_of_a_queued_request_answers_cancelled_without_running_it() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            count = Path(tmp) / "count.json"
            async with running_instance(contract_of("streamer", count_file=str(count))) as (node, iid):
                running = await node.open(iid, stream_inputs(1000, 0.01))
                await running.__anext__()
                queued = await node.open(iid, stream_inputs(2))      # no batching: it waits its turn
                queued.cancel()
                await asyncio.wait_for(queued.settled(), 5)
                with pytest.raises(Cancelled):
                    await drain(queued)
                assert not read_count(count)["closed"]               # the first stream still runs
                running.cancel()
                await asyncio.wait_for(running.settled(), 5)
                assert (await node.infer(iid, stream_inputs(2)))["i"].tolist() == [0, 1]

    asyncio.run(main())


def test_stop_drains_a_running_and_a_queued_stream_before_the_instance_leaves() -> None:
    async def main() -> None:
        async with running_instance(contract_of("streamer")) as (node, iid):
            running = await node.open(iid, stream_inputs(4, 0.05))
            first = await running.__anext__()
            queued = await node.open(iid, stream_inputs(3, 0.01))
            await asyncio.wait_for(node.stop(iid), 10)
            assert node.exit_status(iid) == 0                      # it drained and left on its own
            rest = await drain(running)
            assert [r["i"].tolist() for r in [first, *rest]] == [[0], [1], [2], [3]]
            assert [r["i"].tolist() for r in await drain(queued)] == [[0], [1], [2]]

    asyncio.run(main())


# --- deadlines ---------------------------------------------------------------------------------


def test_a_request_past_its_timeout_is_stopped_and_the_instance_stays_usable() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            count = Path(tmp) / "count.json"
            async with running_instance(contract_of("streamer", count_file=str(count))) as (node, iid):
                with pytest.raises(DeadlineExceeded, match="while it ran"):
                    await asyncio.wait_for(node.infer(iid, stream_inputs(100, 0.05), timeout_s=0.3), 10)
                stopped = read_count(count)
                assert stopped["closed"] and 1 <= stopped["yielded"] < 100
                assert (await node.infer(iid, stream_inputs(2), timeout_s=5))["i"].tolist() == [0, 1]

    asyncio.run(main())


def test_a_second_stream_runs_beside_a_long_one_instead_of_waiting_for_it() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            count = Path(tmp) / "count.json"
            async with running_instance(contract_of("streamer", count_file=str(count))) as (node, iid):
                running = await node.open(iid, stream_inputs(1000, 0.01))
                await running.__anext__()
                short = await node.infer(iid, stream_inputs(5), timeout_s=5)   # interleaved with the long one
                assert short["i"].tolist() == [0, 1, 2, 3, 4]
                running.cancel()
                await asyncio.wait_for(running.settled(), 5)
                assert read_count(count)["yielded"] < 1000

    asyncio.run(main())


def test_a_request_whose_deadline_passes_in_the_queue_is_never_run() -> None:
    async def main() -> None:
        async with running_instance(contract_of("batcher", sleep_s=0.5)) as (node, iid):
            busy = asyncio.ensure_future(node.infer(iid, rows([1, 1])))
            await asyncio.sleep(0.2)                   # its batch is running: the next request queues
            with pytest.raises(DeadlineExceeded, match="queued"):
                await node.infer(iid, rows([2, 2]), timeout_s=0.05)
            assert (await busy)["y"].tolist() == [[2, 2]]
            assert (await node.infer(iid, rows([3, 3])))["y"].tolist() == [[6, 6]]

    asyncio.run(main())


# --- pings ---------------------------------------------------------------------------------------


def test_a_ping_is_answered_while_a_long_stream_runs() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            count = Path(tmp) / "count.json"
            async with running_instance(contract_of("streamer", count_file=str(count))) as (node, iid):
                replies = await node.open(iid, stream_inputs(1000, 0.01))
                await replies.__anext__()
                for _ in range(3):
                    await asyncio.wait_for(node.ping(iid), 5)
                during = read_count(count)
                assert not during["closed"] and during["yielded"] < 1000   # answered mid-stream
                replies.cancel()
                await asyncio.wait_for(replies.settled(), 5)

    asyncio.run(main())
