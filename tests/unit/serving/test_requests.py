"""The request path on fakes: replies as a stream, withdrawn requests, room counted in requests, 429s and jobs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ember.core.states import Rung
from ember.errors import DeadlineExceeded, Overloaded
from ember.serving.results import InferResult, JobAccepted
from ember.testing.controller import World, X, write
from ember.wire.tensors import Tensors

pytestmark = pytest.mark.anyio


def three_replies(inputs: Tensors) -> list[Tensors]:
    return [{"y": np.full(2, i, np.float32)} for i in range(3)]


async def test_a_model_that_streams_hands_each_reply_over_and_infer_concatenates_them(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path)
    w.node.model = three_replies
    await w.ctl.deploy_all()
    stream = await w.ctl.stream(w.ctl.contract("m"), X)
    assert stream.rung is Rung.TEMPLATE
    assert [list(r["y"]) async for r in stream] == [[0, 0], [1, 1], [2, 2]]
    result = await w.infer()
    assert list(result.outputs["y"]) == [0, 0, 1, 1, 2, 2] and result.rung is Rung.HOT


async def test_a_streams_claim_is_told_before_its_first_reply(tmp_path: Path) -> None:
    """The gateway's stream headers carry the rung as soon as an instance holds the request (`on_claim`), not once
    the first reply is in: a long prefill must not lose them."""
    write(tmp_path, "m")
    w = World(tmp_path)
    w.node.model, w.node.infer_delay = three_replies, 0.3
    await w.ctl.deploy_all()
    told: list[tuple[Rung, str]] = []
    opening = asyncio.ensure_future(w.ctl.stream(w.ctl.contract("m"), X, on_claim=lambda *c: told.append(c)))
    while not told:
        assert not opening.done()
        await asyncio.sleep(0.01)
    assert not opening.done()   # the first reply is not in yet
    stream = await opening
    assert told == [(Rung.TEMPLATE, None), (stream.rung, stream.instance_id)] and stream.rung is Rung.TEMPLATE
    assert len([r async for r in stream]) == 3


async def test_a_streams_rung_is_told_before_a_slow_start_ends(tmp_path: Path) -> None:
    """A cold start (a fetch, an engine's load) may take minutes: the gateway's stream headers must not wait for
    it, so the rung is told once the ladder decides it, the instance once one holds the request."""
    write(tmp_path, "m")
    w = World(tmp_path)
    await w.ctl.deploy_all()
    started, w.node.start_delay = len(w.node.started), 0.3
    told: list[tuple[Rung, str | None]] = []
    opening = asyncio.ensure_future(w.ctl.stream(w.ctl.contract("m"), X, on_claim=lambda *c: told.append(c)))
    while not told:
        await asyncio.sleep(0.01)
    assert told == [(Rung.TEMPLATE, None)] and len(w.node.started) == started   # its instance is still starting
    stream = await opening
    assert told[1:] == [(Rung.TEMPLATE, stream.instance_id)] and stream.instance_id is not None
    assert len([r async for r in stream]) == 1


async def test_a_withdrawn_request_is_stopped_in_its_instance_which_serves_on(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1)
    await w.ctl.deploy_all()
    iid = (await w.infer()).instance_id
    w.node.infer_delay = 3600
    pending = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)
    pending.cancel()   # what the gateway does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await pending
    await asyncio.sleep(0.01)
    assert w.node.cancelled == [iid]
    w.node.infer_delay = 0
    again = await w.infer()
    assert again.instance_id == iid and again.rung is Rung.HOT


async def test_a_request_past_its_deadline_is_stopped_without_killing_its_instance(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1, request_timeout_s=0.1)
    await w.ctl.deploy_all()
    iid = (await w.infer()).instance_id
    w.node.infer_delay = 3600
    with pytest.raises(DeadlineExceeded):
        await w.infer()
    w.node.infer_delay = 0
    assert iid in w.node.instances and (await w.infer()).instance_id == iid


async def test_room_counts_requests_so_one_instance_holds_up_to_max_concurrency(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1, max_concurrency=4)
    w = World(tmp_path, slots=2)
    w.node.infer_delay = 0.1
    await w.ctl.deploy_all()
    await w.infer()
    results = await asyncio.gather(*(w.infer() for _ in range(4)))
    assert {r.instance_id for r in results} == {results[0].instance_id} and len(w.node.started) == 1


async def test_requests_spread_over_instances_before_they_pack_into_one(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=2, max_concurrency=4)
    w = World(tmp_path, slots=2)
    w.node.infer_delay = 0.1
    await w.ctl.deploy_all()
    first = await w.infer()
    results = await asyncio.gather(*(w.infer() for _ in range(8)))
    # Over its target (1) the busy instance lets a second one start on the free slice; then both take 4.
    by_instance = [sum(r.instance_id == i for r in results) for i in {r.instance_id for r in results}]
    assert sorted(by_instance) == [4, 4] and first.instance_id in {r.instance_id for r in results}


async def test_a_request_that_must_not_become_a_job_is_refused_with_the_queues_expected_wait(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1, overload_wait_s=0.05)
    await w.ctl.deploy_all()
    for _ in range(10):   # 10 requests in 1 s of the fake clock: 10/s
        await w.infer()
        w.clock.advance(0.1)
    w.node.infer_delay = 0.5
    busy = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as refused:
        await w.ctl.infer(w.ctl.contract("m"), X, when_full="reject")
    assert refused.value.retry_after == 1   # nobody else waits: (0 + 1) / 10 per s, at least 1 s
    accepted = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert isinstance(accepted, JobAccepted) and accepted.retry_after >= 1
    await busy


async def test_queued_jobs_run_as_soon_as_there_is_room_without_waiting_for_a_tick(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1)
    await w.ctl.deploy_all()
    w.node.infer_delay = 0.02
    jobs = [await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True) for _ in range(8)]
    ids = [j.job_id for j in jobs if isinstance(j, JobAccepted)]
    for _ in range(200):   # never a tick: only requests ending make room
        if all(w.ctl.job(i).state == "succeeded" for i in ids):
            break
        await asyncio.sleep(0.01)
    assert [w.ctl.job(i).state for i in ids] == ["succeeded"] * 8
    assert isinstance(await w.infer(), InferResult)


async def test_the_retry_after_of_a_job_grows_with_the_queue_ahead_of_it(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1)
    await w.ctl.deploy_all()
    for _ in range(4):   # 4 requests in 2 s: 2/s
        await w.infer()
        w.clock.advance(0.5)
    assert w.ctl.retry_after("m:1", ahead=0) == 1
    assert w.ctl.retry_after("m:1", ahead=9) == 5


async def test_closing_a_stream_before_reading_it_gives_its_room_back(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1, queue_wait_s=0.05)
    w.node.model = three_replies
    await w.ctl.deploy_all()
    stream = await w.ctl.stream(w.ctl.contract("m"), X)
    await stream.aclose()
    again = await w.ctl.stream(w.ctl.contract("m"), X)
    assert again.instance_id == stream.instance_id and again.rung is Rung.HOT
    assert len([r async for r in again]) == 3


LLM = """\
name: {name}
runtime: llm
weights: /nonexistent/model.gguf
inputs: [{{name: request, datatype: BYTES, shape: [1]}}]
outputs: [{{name: text, datatype: BYTES, shape: [1]}}, {{name: finish_reason, datatype: BYTES, shape: [1]}}]
scaling: {{max_scale: {max_scale}, pause_after_s: 2, max_idle_s: 60, keep_template: true,
          target_concurrency: {target}, max_concurrency: {target2}}}
limits: {{request_timeout_s: {timeout}}}
"""
CHAT = {"request": np.array([b'{"prompt": "Hi"}'], dtype=object)}


def write_llm(tmp: Path, *, max_scale: int = 2, timeout: float = 5, target: int = 2) -> None:
    (tmp / "models").mkdir(exist_ok=True)
    (tmp / "models" / "chat.yaml").write_text(LLM.format(name="chat", max_scale=max_scale, timeout=timeout,
                                                         target=target, target2=2 * target))


def one_token(inputs: Tensors) -> Tensors:
    return {"text": np.array([b"ok"], dtype=object), "finish_reason": np.array([b"stop"], dtype=object)}


async def test_an_llms_requests_its_instance_cannot_begin_yet_wait_at_the_node_for_the_instance_just_started(
        tmp_path: Path) -> None:
    """The warm instance is sent two streams (it has begun neither), the third starts a second instance, the fourth
    waits at the node and goes to that one once it is up, the last two to whichever begins one of its streams first
    (the warm one, whose first replies come first): none queued in a busy instance behind prompts it has not begun."""
    write_llm(tmp_path, target=8)
    w = World(tmp_path, slots=2)
    w.node.model = one_token
    await w.ctl.deploy_all()
    first = await w.ctl.infer(w.ctl.contract("chat"), CHAT)
    assert isinstance(first, InferResult)
    w.node.infer_delay, w.node.start_delay = 0.5, 0.05
    results = await asyncio.gather(*(w.ctl.infer(w.ctl.contract("chat"), CHAT) for _ in range(6)))
    served = {i: sum(isinstance(r, InferResult) and r.instance_id == i for r in results) for i in w.node.instances}
    assert served[first.instance_id] == 4 and sorted(served.values()) == [2, 4] and len(w.node.started) == 2


async def test_an_llm_request_queued_at_the_node_waits_until_its_deadline_then_answers_504(tmp_path: Path) -> None:
    k = 3.0   # every time scaled alike: margins for a loaded CI machine (it flaked at k = 1)
    write_llm(tmp_path, max_scale=1, timeout=0.3 * k)
    w = World(tmp_path, slots=1, queue_wait_s=0.05 * k)
    w.node.model = one_token
    await w.ctl.deploy_all()
    await w.ctl.infer(w.ctl.contract("chat"), CHAT)
    w.node.infer_delay = 0.25 * k
    busy = [asyncio.ensure_future(w.ctl.infer(w.ctl.contract("chat"), CHAT)) for _ in range(2)]
    await asyncio.sleep(0.01 * k)
    queued = asyncio.ensure_future(w.ctl.infer(w.ctl.contract("chat"), CHAT))   # waits past queue_wait_s
    await asyncio.sleep(0.1 * k)
    assert not queued.done() and w.ctl.waiting() == 1
    assert all(isinstance(r, InferResult) for r in await asyncio.gather(*busy))
    assert isinstance(await queued, InferResult)   # a slot freed before its deadline: served, not a job
    w.node.infer_delay, w.node.cancellable = 1.0 * k, False   # requests that hold both slots past the deadline
    busy = [asyncio.ensure_future(w.ctl.infer(w.ctl.contract("chat"), CHAT)) for _ in range(2)]
    await asyncio.sleep(0.01 * k)
    with pytest.raises(DeadlineExceeded, match="no instance began"):
        await w.ctl.infer(w.ctl.contract("chat"), CHAT)
    assert all(isinstance(r, DeadlineExceeded) for r in await asyncio.gather(*busy, return_exceptions=True))
