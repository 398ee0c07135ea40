"""The controller on a FakeNode, a real SQLite job store and a FakeClock."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.slices import cpu_slices
from ember.core.states import Rung
from ember.errors import DeadlineExceeded, ModelNotFound, ModelNotReady, WorkerCrashed
from ember.keepalive.policies import FixedKeepAlive, FixedZygote, LadderPolicy
from ember.keepalive.pooled_prior import POOL_EPOCH_S
from ember.node.api import collect
from ember.serving.controller import Controller, ControllerSettings
from ember.serving.repository import Repository
from ember.serving.results import InferResult, JobAccepted
from ember.testing.clock import FakeClock
from ember.testing.controller import World, X, settle, write
from ember.testing.node import FakeNode

pytestmark = pytest.mark.anyio

@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    write(tmp_path, "m")
    return tmp_path


async def test_first_request_forks_the_template_then_runs_hot(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    assert w.ctl.server_ready()
    first = await w.infer()
    assert first.rung is Rung.TEMPLATE
    assert np.allclose(first.outputs["y"], [2, 2, 2])
    second = await w.infer()
    assert second.rung is Rung.HOT and second.instance_id == first.instance_id
    text = w.metrics.text().decode()
    assert 'ember_ladder_time_to_first_response_seconds_count{model="m",rung="template",version="1"} 1.0' in text


async def test_without_template_the_zygote_forks(tmp: Path) -> None:
    write(tmp, "m", template=False)
    w = World(tmp)
    await w.ctl.deploy_all()
    assert (await w.infer()).rung is Rung.ZYGOTE


async def test_idle_instance_is_paused_resumed_and_recycled(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    iid = (await w.infer()).instance_id
    await w.run_for(3)
    assert iid in w.node.paused
    resumed = await w.infer()
    assert resumed.rung is Rung.PAUSED and iid not in w.node.paused
    await w.run_for(59)
    assert iid in w.node.instances
    await w.run_for(2)
    assert iid not in w.node.instances
    assert (await w.infer()).rung is Rung.TEMPLATE


async def test_a_crash_mid_request_is_retried_once_on_a_new_instance(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    iid = (await w.infer()).instance_id
    w.node.crash_next.add(iid)
    retried = await w.infer()
    assert retried.instance_id != iid and retried.rung is Rung.TEMPLATE
    assert 'ember_worker_crashes_total{model="m",version="1"} 1.0' in w.metrics.text().decode()


async def test_a_second_crash_answers_worker_crashed(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    first = (await w.infer()).instance_id
    w.node.crash_next.add(first)
    w.node.crash_new = True
    with pytest.raises(WorkerCrashed):
        await w.infer()


async def test_no_capacity_queues_a_durable_job_that_runs_when_a_slice_frees(tmp: Path) -> None:
    write(tmp, "m", max_scale=1)
    w = World(tmp, slots=1)
    w.node.infer_delay = 0.2
    await w.ctl.deploy_all()
    busy = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)
    accepted = await w.ctl.infer(w.ctl.contract("m"), X)
    assert isinstance(accepted, JobAccepted)
    assert w.ctl.job(accepted.job_id).state == "queued"
    await busy
    status = await settle(w, accepted.job_id, "succeeded", tick=True)
    assert status.state == "succeeded" and status.outputs is not None
    assert np.allclose(status.outputs["y"], [2, 2, 2])


async def test_respond_async_always_makes_a_job(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    accepted = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert isinstance(accepted, JobAccepted)
    assert (await settle(w, accepted.job_id, "succeeded")).state == "succeeded"


async def test_another_models_idle_instance_is_evicted_for_a_new_one(tmp: Path) -> None:
    write(tmp, "other")
    w = World(tmp, slots=1)
    await w.ctl.deploy_all()
    iid = (await w.infer("m")).instance_id
    result = await w.infer("other")
    assert result.rung is Rung.TEMPLATE and iid not in w.node.instances


async def test_a_model_that_fails_to_load_leaves_the_others_serving(tmp: Path) -> None:
    write(tmp, "broken")
    (tmp / "models" / "bad.yaml").write_text("name: bad\nruntime: python\n")
    w = World(tmp)
    w.node.fail_prepare.add("broken:1")
    await w.ctl.deploy_all()
    assert w.ctl.server_ready()
    states = {e.name: (e.state, e.reason) for e in w.ctl.repository_index()}
    assert states["m"][0] == "READY"
    assert states["broken"][0] == "UNAVAILABLE" and "told to fail" in states["broken"][1]
    assert states["bad"][0] == "UNAVAILABLE" and "inputs: Field required" in states["bad"][1]
    status = {s.name: s.state for s in w.ctl.status()}   # what `ember status` shows
    assert status["bad"].startswith("UNAVAILABLE: ") and "inputs: Field required" in status["bad"]
    assert status["broken"].startswith("UNAVAILABLE") and status["m"] == "READY"
    with pytest.raises(ModelNotReady):
        await w.ctl.infer(w.ctl.contract("broken"), X)
    assert (await w.infer("m")).rung is Rung.TEMPLATE


async def test_a_model_larger_than_every_slice_is_refused_at_deploy(tmp: Path) -> None:
    write(tmp, "huge", memory=4096)
    w = World(tmp)
    await w.ctl.deploy_all()
    states = {e.name: e for e in w.ctl.repository_index()}
    assert states["huge"].state == "UNAVAILABLE" and "4096 MB" in states["huge"].reason


async def test_unload_and_load_through_the_repository(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    await w.infer()
    await w.ctl.unload_model("m")
    assert not w.node.instances and not w.ctl.model_ready("m")
    with pytest.raises(ModelNotFound):
        w.ctl.contract("m")
    await w.ctl.load_model("m")
    assert (await w.infer()).rung is Rung.TEMPLATE
    with pytest.raises(ModelNotFound):
        await w.ctl.load_model("nope")


async def test_min_scale_prestarts_on_tick_and_status_reports_instances(tmp: Path) -> None:
    write(tmp, "m", min_scale=1)
    w = World(tmp)
    await w.ctl.deploy_all()
    await w.ctl.tick()
    await asyncio.sleep(0.01)
    assert len(w.node.instances) == 1
    (model,) = w.ctl.status()
    assert model.name == "m" and model.instances[0]["state"] == "idle" and model.template is not None
    assert (await w.infer()).rung is Rung.HOT


async def test_the_clusters_share_of_min_scale_replaces_the_contracts_on_this_node(tmp: Path) -> None:
    write(tmp, "m", min_scale=2)
    w = World(tmp)
    await w.ctl.deploy_all()
    await w.run_for(2)
    assert len(w.node.instances) == 2
    assert w.ctl.set_min_scale("m:1", 1) and not w.ctl.set_min_scale("m:1", 1) and not w.ctl.set_min_scale("x:1", 1)
    await w.run_for(400)                                     # past max_idle_s: the one above the share goes
    assert len([i for i in w.ctl.snapshot().instances if i.state.ready or i.state.name == "PAUSED"]) == 1
    assert w.ctl.set_min_scale("m:1", 5) and w.ctl.snapshot().models["m:1"].min_scale == 2   # max scale bounds it


async def test_node_status_lists_zygotes_and_the_job_queue_per_model(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    w.jobs.submit("m", "1", X)
    w.jobs.submit("m", "1", X)
    node = await w.ctl.node_status()
    assert [z["runtime"] for z in node["zygotes"]] == ["python"] and node["zygotes"][0]["pss_bytes"] > 0
    (queue,) = node["jobs"]
    assert (queue["model"], queue["version"], queue["queued"]) == ("m", "1", 2) and queue["oldest_age_s"] >= 0


async def test_a_queued_job_survives_a_restart(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    job_id = w.jobs.submit("m", "1", X)
    assert w.jobs.claim_next() is not None  # a server died while running it
    w.jobs.close()
    w2 = World(tmp)
    await w2.ctl.deploy_all()
    await w2.ctl.tick()
    assert (await settle(w2, job_id, "succeeded")).state == "succeeded"


async def test_a_keepalive_policy_overrides_the_contracts_idle_knobs(tmp: Path) -> None:
    w = World(tmp, keepalive=FixedKeepAlive(keep_alive_s=10))
    await w.ctl.deploy_all()
    iid = (await w.infer()).instance_id
    await w.run_for(5)
    assert iid in w.node.instances and iid not in w.node.paused  # the contract would have paused it at 2 s
    await w.run_for(6)
    assert iid not in w.node.instances  # the contract would have kept it until 60 s
    # The fixed policy keeps nothing after its 10 s: the template and the zygote went too.
    assert not w.node.templates and not w.node.zygotes
    assert (await w.infer()).rung is Rung.FETCH
    assert w.node.templates == {"m:1"} and w.node.started[-1][1] is Rung.TEMPLATE   # made again on the way
    fetches = w.metrics.registry.get_sample_value("ember_cold_starts_total",
                                                  {"model": "m", "version": "1", "rung": "fetch"})
    assert fetches == 1   # counted on the rung it began from, not the template it forked from


async def test_a_plan_that_drops_to_the_zygote_keeps_it_and_the_healer_does_not_remake_the_template(
        tmp: Path) -> None:
    w = World(tmp, keepalive=FixedZygote(keep_alive_s=10))
    await w.ctl.deploy_all()
    await w.infer()
    await w.run_for(20)
    assert not w.node.instances and not w.node.templates and w.node.zygotes == {"python"}
    assert w.ctl.status()[0].state == "READY"   # released on purpose: not degraded
    assert (await w.infer()).rung is Rung.ZYGOTE
    await w.run_for(1)
    assert w.node.templates == {"m:1"}


def _store_backed(tmp: Path, name: str) -> None:
    write(tmp, name, template=False)
    path = tmp / "models" / f"{name}.yaml"
    path.write_text(path.read_text() + f'weights: "store:{name}:1"\n')


async def test_a_plan_that_keeps_nothing_releases_the_memory_tier_copy_and_fills_it_on_the_way_back(
        tmp: Path) -> None:
    _store_backed(tmp, "a")
    _store_backed(tmp, "b")
    w = World(tmp, keepalive=FixedKeepAlive(keep_alive_s=10))
    await w.ctl.deploy_all()
    await w.infer("a")
    await w.run_for(5)
    await w.infer("b")            # b served 5 s later: still kept while a's plan keeps nothing
    await w.run_for(8)
    assert not any(m == "a:1" for m in w.node.instances.values())
    # m (not store-backed) has nothing in the tier; b keeps its weights, so the chunks it shares with a stay.
    assert w.node.weight_releases == [("a:1", frozenset({"b:1"}))]
    await w.run_for(5)            # b's turn: a keeps nothing either, nothing of a's is kept for it
    assert w.node.weight_releases == [("a:1", frozenset({"b:1"})), ("b:1", frozenset())]
    assert w.node.weight_fills == []
    result = await w.infer("a")   # a start after the release works (m, never served, keeps the zygote)
    assert result.rung is Rung.ZYGOTE
    await w.run_for(1)
    assert w.node.weight_fills == ["a:1"] and len(w.node.weight_releases) == 2


async def test_an_instance_hung_past_the_deadline_is_stopped_and_its_slice_freed(tmp: Path) -> None:
    write(tmp, "m", max_scale=1)
    w = World(tmp, slots=1, request_timeout_s=0.1)
    await w.ctl.deploy_all()
    w.node.infer_delay, w.node.cancellable = 3600, False   # a model that never checks `stop`
    with pytest.raises(DeadlineExceeded):
        await w.infer()
    await asyncio.sleep(0.3)  # one more request timeout of grace, then it is stopped
    assert not w.node.instances and not w.ctl.status()[0].instances
    w.node.infer_delay = 0
    result = await w.infer()
    assert result.rung is Rung.TEMPLATE and result.instance_id == "fake-2"


async def test_a_models_own_request_timeout_overrides_the_servers(tmp: Path) -> None:
    """`limits.request_timeout_s` in a contract: an LLM's long generation outlives the server's default, and a
    model may also ask for less."""
    write(tmp, "slow")
    write(tmp, "m")
    path = tmp / "models" / "slow.yaml"
    path.write_text(path.read_text() + "limits: {request_timeout_s: 5}\n")
    path = tmp / "models" / "m.yaml"
    path.write_text(path.read_text() + "limits: {request_timeout_s: 0.1}\n")
    w = World(tmp, request_timeout_s=0.2)
    await w.ctl.deploy_all()
    w.node.infer_delay = 0.4
    result = await w.infer("slow")                    # past the server's 0.2 s, within its own 5 s
    assert result.outputs
    w.node.infer_delay = 0.15
    with pytest.raises(DeadlineExceeded, match=r"no answer within 0.1s"):
        await w.infer("m")                            # within the server's 0.2 s, past its own 0.1 s


async def test_a_request_arriving_as_its_instance_is_recycled_waits_for_the_slice(tmp: Path) -> None:
    write(tmp, "m", max_scale=1)
    w = World(tmp, slots=1, queue_wait_s=1)
    await w.ctl.deploy_all()
    first = await w.infer()
    w.clock.advance(61)  # idle past max_idle_s: the next tick recycles it
    pending = asyncio.ensure_future(w.infer())  # scheduled before the tick, runs after it
    await w.ctl.tick()
    result = await pending
    assert result.instance_id != first.instance_id and result.rung is Rung.TEMPLATE
    assert 'ember_worker_crashes_total{model="m",version="1"}' not in w.metrics.text().decode()


async def test_unloading_a_model_answers_its_waiting_requests_not_ready(tmp: Path) -> None:
    write(tmp, "m", max_scale=1)
    w = World(tmp, slots=1, queue_wait_s=5)
    await w.ctl.deploy_all()
    w.node.infer_delay = 0.2
    running = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(w.infer())  # waits for the busy instance
    await asyncio.sleep(0.05)
    await w.ctl.unload_model("m")
    with pytest.raises(ModelNotReady, match="unloaded"):
        await waiting
    await asyncio.gather(running, return_exceptions=True)


async def test_the_queue_in_seconds_is_the_waiting_requests_over_the_measured_rate(tmp: Path) -> None:
    write(tmp, "m", max_scale=1)
    w = World(tmp, slots=1, queue_wait_s=5)
    await w.ctl.deploy_all()

    async def two_waiting() -> tuple[list[asyncio.Future[InferResult]], float, int]:
        w.node.infer_delay = 0.2
        running = [asyncio.ensure_future(w.infer()) for _ in range(3)]   # one in the instance, two waiting
        await asyncio.sleep(0.05)
        seen = w.ctl.queue_s(unmeasured_s=9.0), w.ctl.waiting()
        return running, *seen

    running, unmeasured, waiting = await two_waiting()
    assert (unmeasured, waiting) == (18.0, 2)        # no rate yet: 9 s a request
    await asyncio.gather(*running)
    w.node.infer_delay = 0.0
    for _ in range(3):                               # 6 completions within 3 s of the fake clock: 2 a second
        w.clock.advance(1.0)
        await w.infer()
    running, measured, waiting = await two_waiting()
    assert waiting == 2 and measured == pytest.approx(2 / (6 / 3.0))
    await asyncio.gather(*running)


async def test_a_job_whose_serving_raises_a_bug_fails_instead_of_running_forever(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()

    def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("a bug")

    w.node.model = broken
    accepted = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert isinstance(accepted, JobAccepted)
    status = await settle(w, accepted.job_id, "failed")
    assert status.state == "failed" and "RuntimeError" in (status.error or "")


async def test_weights_not_on_the_node_are_fetched_by_the_first_start_then_the_zygote_serves(tmp: Path) -> None:
    write(tmp, "m", template=False)
    w = World(tmp)
    w.node.remote.add("m:1")
    await w.ctl.deploy_all()
    first = await w.infer()
    assert first.rung is Rung.FETCH and w.node.fetched == ["m:1"]
    text = w.metrics.text().decode()
    assert 'ember_ladder_time_to_first_response_seconds_count{model="m",rung="fetch",version="1"} 1.0' in text
    await w.run_for(61)  # recycled: the next start forks the zygote from local weights
    assert (await w.infer()).rung is Rung.ZYGOTE
    w.node.remote.add("m:1")  # the store evicted them meanwhile
    await w.run_for(61)
    assert (await w.infer()).rung is Rung.FETCH


async def test_a_template_fetches_at_deploy_so_no_request_waits_for_a_fetch(tmp: Path) -> None:
    w = World(tmp)
    w.node.remote.add("m:1")
    await w.ctl.deploy_all()
    assert w.node.fetched == ["m:1"]
    assert (await w.infer()).rung is Rung.TEMPLATE


async def test_unloading_a_model_fails_its_queued_jobs_so_they_do_not_fill_the_queue(tmp: Path) -> None:
    write(tmp, "other")
    w = World(tmp)
    await w.ctl.deploy_all()
    job_id = w.jobs.submit("m", "1", X)  # queued: no tick has run it yet
    await w.ctl.unload_model("m")
    status = w.ctl.job(job_id)
    assert status.state == "failed" and "unloaded" in (status.error or "")
    assert w.jobs.queued_count() == 0


async def test_jobs_of_a_model_gone_from_the_repository_fail_at_startup(tmp: Path) -> None:
    w = World(tmp)
    gone = w.jobs.submit("vanished", "1", X)
    kept = w.jobs.submit("m", "1", X)
    await w.ctl.deploy_all()
    assert w.ctl.job(gone).state == "failed" and "not in the repository" in (w.ctl.job(gone).error or "")
    assert w.ctl.job(kept).state in ("queued", "running", "succeeded")


async def test_with_a_shared_job_store_other_nodes_models_keep_their_jobs(tmp: Path) -> None:
    write(tmp, "other")
    w = World(tmp, shared_jobs=True)
    elsewhere = w.jobs.submit("served-elsewhere", "1", X)
    await w.ctl.deploy_all()
    unloaded = w.jobs.submit("m", "1", X)      # queued: no tick has run it yet
    await w.ctl.unload_model("m")
    assert w.ctl.job(elsewhere).state == "queued" and w.ctl.job(unloaded).state == "queued"


async def test_requests_waiting_on_a_start_share_the_new_instance_when_it_has_room(tmp: Path) -> None:
    write(tmp, "m", max_scale=1, concurrency=4, template=False)
    w = World(tmp, slots=1, queue_wait_s=0.3)
    w.node.start_delay, w.node.infer_delay = 0.1, 0.5
    await w.ctl.deploy_all()
    first = asyncio.ensure_future(w.ctl.infer(w.ctl.contract("m"), X))
    await asyncio.sleep(0.01)
    waiting = [asyncio.ensure_future(w.ctl.infer(w.ctl.contract("m"), X)) for _ in range(3)]
    results = await asyncio.gather(first, *waiting)
    assert all(isinstance(r, InferResult) for r in results)
    assert [r.rung for r in results] == [Rung.ZYGOTE, Rung.HOT, Rung.HOT, Rung.HOT]  # type: ignore[union-attr]


class SlowStartNode(FakeNode):
    """A start that takes `start_s` of the world's fake time (a long fetch)."""

    def __init__(self, clock: FakeClock, start_s: float) -> None:
        super().__init__()
        self.clock, self.start_s = clock, start_s

    async def start(self, contract: Any, rung: Rung, slice_: Any) -> Any:
        self.clock.advance(self.start_s)
        return await super().start(contract, rung, slice_)


async def test_a_start_that_outlasts_the_deadline_answers_504_and_leaves_the_instance_warm(tmp: Path) -> None:
    w = World(tmp, request_timeout_s=1)
    w.node = SlowStartNode(w.clock, start_s=2)
    w.ctl = Controller(w.node, w.jobs, w.metrics, w.clock, cpu_slices(2, 1024), Repository([tmp / "models"]),
                       ControllerSettings(queue_wait_s=0.05, request_timeout_s=1))
    await w.ctl.deploy_all()
    with pytest.raises(DeadlineExceeded, match="no instance ready"):
        await w.infer()
    (instance,) = w.ctl.status()[0].instances
    assert instance["state"] == "idle" and instance["served"] == 0
    assert (await w.infer()).rung is Rung.HOT


async def test_a_failing_prestart_backs_off_instead_of_retrying_every_tick(tmp: Path) -> None:
    write(tmp, "m", min_scale=1, template=False)
    w = World(tmp)
    await w.ctl.deploy_all()
    w.node.fail_start.add("m:1")
    await w.run_for(10, step=0.25)
    attempts = w.node.attempts.count("m:1")
    assert 3 <= attempts <= 5  # 1, 2, 4 s apart: not 40 tries in 40 ticks


async def test_a_model_that_gets_no_slice_is_logged_once_until_it_has_room(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp, "other")
    w = World(tmp, slots=1)
    w.node.infer_delay = 0.2
    await w.ctl.deploy_all()
    busy = asyncio.ensure_future(w.infer("m"))   # m holds the only slice, busy: nothing to evict
    await asyncio.sleep(0.05)
    caplog.set_level(logging.INFO, logger="ember.controller")
    for _ in range(3):
        assert isinstance(await w.ctl.infer(w.ctl.contract("other"), X), JobAccepted)
    short = [r.getMessage() for r in caplog.records if "no capacity" in r.getMessage()]
    assert short == ["no capacity: other:1: no free cpu slice with 512 MB "
                     "(its requests become jobs until a slice frees)"]
    await busy
    assert (await w.infer("other")).rung is Rung.TEMPLATE   # m's idle instance is evicted
    assert [r.getMessage() for r in caplog.records if "room again" in r.getMessage()] == [
        "model other:1 has room again"]


async def test_a_model_larger_than_every_slice_is_logged_at_deploy(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp, "huge", memory=4096)
    caplog.set_level(logging.ERROR, logger="ember.controller")
    await World(tmp).ctl.deploy_all()
    assert "cannot deploy huge:1: resources: no cpu slice on this node holds 4096 MB" in caplog.messages


async def test_after_a_burst_the_kpa_scales_down_to_one_and_the_contract_takes_the_last(tmp: Path) -> None:
    write(tmp, "m", max_scale=3)
    w = World(tmp, slots=3)
    w.node.infer_delay = 0.05
    await w.ctl.deploy_all()
    burst = await asyncio.gather(*(w.infer() for _ in range(3)))
    assert len({r.instance_id for r in burst}) == 3
    # The stable window's average of a 50 ms burst asks for one instance: the two others go at the next tick,
    # not after the contract's max_idle_s (60 s), which then takes the last one.
    await w.run_for(1)
    assert len(w.node.instances) == 1
    await w.run_for(58)
    assert len(w.node.instances) == 1
    await w.run_for(3)
    assert len(w.node.instances) == 0


async def test_sustained_load_keeps_the_instances_the_kpa_wants(tmp: Path) -> None:
    """The other side of the scale-down: while three requests stay in flight, no instance is taken."""
    write(tmp, "m", max_scale=3)
    w = World(tmp, slots=3)
    w.node.infer_delay = 0.3
    await w.ctl.deploy_all()
    for _ in range(5):   # three requests in flight through most of each tick for 5 s: the KPA wants 3
        ticking = asyncio.ensure_future(w.run_for(1, step=0.25))
        await asyncio.gather(*(w.infer() for _ in range(3)))
        await ticking
    assert len(w.node.instances) == 3


async def test_a_contracts_initial_scale_is_started_at_deploy_and_then_scaled_down(tmp: Path) -> None:
    text = (tmp / "models" / "m.yaml").read_text().replace("target_concurrency: 1", "target_concurrency: 1, "
                                                          "initial_scale: 1")
    (tmp / "models" / "m.yaml").write_text(text)
    w = World(tmp)
    await w.ctl.deploy_all()
    await w.run_for(1)
    assert len(w.node.instances) == 1            # Knative's initial scale: up before any request
    assert (await w.infer()).rung is Rung.HOT
    await w.run_for(62)
    assert len(w.node.instances) == 0            # then no load: the contract's max_idle_s takes it


async def test_a_pooled_ladder_plans_live_from_the_prior_of_the_nodes_models(tmp: Path) -> None:
    policy = LadderPolicy(pooled_weight=1.0)
    w = World(tmp, keepalive=policy)
    await w.ctl.deploy_all()
    for _ in range(3):
        await w.infer()
        await w.run_for(3)
    deployment = w.ctl._deployments.all()[0]
    assert deployment.history is not None and deployment.history.total >= 2 and deployment.last_done is not None
    # The first epoch pools none (as the simulator's first): the policy's own prior.
    assert deployment.plan == policy.plan(deployment.history) and deployment.plan_prior is None
    # Renewed at the first tick of the next epoch, from the histories then, m's idle time so far censored.
    await w.run_for(POOL_EPOCH_S)
    prior = policy.pool([deployment.history.table()],
                        [w.ctl._actuator._started + POOL_EPOCH_S - deployment.last_done])
    await w.infer()
    await w.run_for(1)
    assert prior is not None and prior.apps.tolist() == [1] and deployment.plan_prior is not None
    assert np.array_equal(deployment.plan_prior.mass, prior.mass)
    assert deployment.plan == policy.plan(deployment.history, prior)
    assert deployment.plan != policy.plan(deployment.history)   # the pooled prior, not the log-uniform one


async def test_arrivals_during_a_models_first_request_are_idle_periods_of_0_and_replanned(tmp: Path) -> None:
    """As in the simulator (and `ember.testing.replay`'s prediction): requests that come while the model's first
    one runs are idle periods of 0, and the plan of the idle period after them is made from them (on the next
    tick), not the plan made before the first arrival (issue 30: three arrivals of the dev-a replay started from
    the zygote where the plan of their history kept the model hot)."""
    policy = LadderPolicy(pooled_weight=1.0)
    w = World(tmp, keepalive=policy, queue_wait_s=1.0)
    w.node.infer_delay = 0.05
    await w.ctl.deploy_all()
    await w.run_for(1)
    deployment = w.ctl._deployments.all()[0]
    assert deployment.plan is not None and deployment.history is not None and deployment.history.total == 0
    await asyncio.gather(*(w.infer() for _ in range(3)))
    assert deployment.history.total == 2 and deployment.plan is None   # two periods of 0; made on the next tick
    await w.run_for(1)
    assert deployment.plan == policy.plan(deployment.history)   # the first epoch: no pooled prior yet


async def test_a_model_serving_is_not_idle_in_the_pooled_prior(tmp_path: Path) -> None:
    """The pooled prior censors each idle model at its idle time so far; a model with a request in flight, or whose
    plan its arrival dropped, is not idle (the period its request ended is in its history already), whether or
    not its reply has come by the tick, as in the replay's prediction (`ember.testing.replay.pooled_prior`)."""
    write(tmp_path, "a")
    write(tmp_path, "b")
    policy = LadderPolicy(pooled_weight=1.0)
    w = World(tmp_path, keepalive=policy, queue_wait_s=1.0)
    await w.ctl.deploy_all()
    for _ in range(2):
        await w.infer("a")
        await w.infer("b")
        await w.run_for(2)
    a, b = w.ctl._deployments.find("a"), w.ctl._deployments.find("b")
    w.clock.advance(POOL_EPOCH_S)   # the next tick begins the second epoch: the pooled prior is renewed
    w.node.infer_delay = 0.2
    running = asyncio.ensure_future(w.infer("a"))
    await asyncio.sleep(0.05)
    assert a.plan is None
    assert a.last_done is not None and b.last_done is not None and a.history is not None and b.history is not None
    tables = [a.history.table(), b.history.table()]
    pooled = w.ctl._actuator._pooled(policy, {"a:1": a, "b:1": b})
    expected = policy.pool(tables, [None, w.clock.now() - b.last_done])
    censored = policy.pool(tables, [w.clock.now() - a.last_done, w.clock.now() - b.last_done])
    assert pooled is not None and expected is not None and censored is not None
    assert np.array_equal(pooled.mass, expected.mass) and not np.array_equal(pooled.mass, censored.mass)
    await running   # replied before the tick: planned as of its arrival all the same, not idle
    pooled = w.ctl._actuator._pooled(policy, {"a:1": a, "b:1": b})
    assert pooled is not None and np.array_equal(pooled.mass, expected.mass)
    await w.ctl.tick()
    assert a.even_plan == policy.plan(a.history, expected) and a.plan_prior is not None
    assert np.array_equal(a.plan_prior.mass, expected.mass)


async def test_a_ladder_prices_the_zygote_at_what_the_other_models_of_its_runtime_leave(tmp_path: Path) -> None:
    """Model a is kept hot (min scale 1), so it holds the python zygote all along: once a whole minute has
    passed, b's plan is made with the zygote free (as in the simulator), keeping b on the zygote where the even
    split drops it to nothing; and it is not made again on every tick."""
    write(tmp_path, "a", min_scale=1)
    write(tmp_path, "b")
    policy = LadderPolicy()
    w = World(tmp_path, keepalive=policy)
    await w.ctl.deploy_all()
    await w.infer("b")
    await w.run_for(2)
    b = w.ctl._deployments.find("b")
    assert b.history is not None and b.plan is not None and b.plan_zygote_others is None   # no whole minute yet
    assert b.plan.rung_at(1e6) is Rung.FETCH                    # the even split: the zygote for b alone
    await w.run_for(60)
    assert b.plan_zygote_others == 1.0
    assert b.plan == policy.plan(b.history, None, 1.0) and b.plan.rung_at(1e6) is Rung.ZYGOTE
    plan = b.plan
    await w.run_for(5)
    assert b.plan is plan                                        # the same share: the same plan, not made again


async def test_a_ladder_prices_a_store_backed_models_memory_tier_copy_on_the_zygote_rung(tmp_path: Path) -> None:
    """As above, the zygote is free for b once a holds it all along; but b's weights (4 GiB) are in the memory tier,
    kept on every rung but FETCH: priced, they are worth letting go, so b's plan still ends on nothing."""
    write(tmp_path, "a", min_scale=1)
    _store_backed(tmp_path, "b")
    policy = LadderPolicy()
    w = World(tmp_path, keepalive=policy)
    w.node.weight_bytes["b:1"] = 4 * 2**30
    await w.ctl.deploy_all()
    assert w.ctl._pool.models["b:1"].memory_copy_mb == 4096 and w.ctl._pool.models["a:1"].memory_copy_mb == 0
    await w.infer("b")
    await w.run_for(62)
    b = w.ctl._deployments.find("b")
    assert b.history is not None and b.plan is not None and b.plan_zygote_others == 1.0
    priced = replace(policy, costs=replace(policy.costs, memory_copy_mb=4096.0))
    assert b.plan == priced.plan(b.history, None, 1.0) and b.plan.rung_at(1e6) is Rung.FETCH
    assert policy.plan(b.history, None, 1.0).rung_at(1e6) is Rung.ZYGOTE   # unpriced, it would keep the copy
    # Priced on every rung it is kept on, it only ever turns a cell to nothing, never a lower rung to a higher one.
    unpriced = policy.plan(b.history, None, 1.0)
    for t in sorted({0.0, *(at for at, _ in unpriced.steps), *(at for at, _ in b.plan.steps)}):
        assert b.plan.rung_at(t) in (unpriced.rung_at(t), Rung.FETCH)


async def test_two_idle_models_of_a_runtime_do_not_keep_its_zygote_for_each_other(tmp_path: Path) -> None:
    """Who holds the zygote is judged by the plans at the even split (the simulator's first pass): judged by the
    marginal ones, each idle model would see the other hold it, price it at nothing and keep it for ever."""
    write(tmp_path, "a")
    write(tmp_path, "b")
    policy = LadderPolicy()
    w = World(tmp_path, keepalive=policy)
    await w.ctl.deploy_all()
    await w.infer("a")
    await w.infer("b")
    a = w.ctl._deployments.find("a")
    await w.run_for(2)
    assert a.history is not None and a.even_plan == policy.plan(a.history)
    drop = a.even_plan.steps[-1]
    assert drop[1] is Rung.FETCH                              # the even split lets the zygote go at some point
    # Past both drops neither holds it; the share (the past hour's) falls, its price rises, the plans drop it.
    await w.run_for(drop[0] + 3600 + 300, step=10.0)
    assert a.plan is not None and Rung.FETCH in {r for _, r in a.plan.steps}
    assert w.node.zygotes == set()


async def test_a_model_alone_on_its_runtime_is_planned_at_the_even_split(tmp: Path) -> None:
    policy = LadderPolicy(zygote_share=2.0)
    w = World(tmp, keepalive=policy)
    await w.ctl.deploy_all()
    await w.infer()
    await w.run_for(70)
    deployment = w.ctl._deployments.all()[0]
    assert deployment.history is not None and deployment.plan_zygote_others is None
    assert deployment.plan == policy.plan(deployment.history)


async def test_a_cheaper_zygote_leaves_a_plan_that_never_drops_to_nothing_as_it_is(tmp_path: Path) -> None:
    write(tmp_path, "a", min_scale=1)
    write(tmp_path, "b")
    policy = LadderPolicy(latency_value=1e6)
    w = World(tmp_path, keepalive=policy)
    await w.ctl.deploy_all()
    await w.infer("b")
    await w.run_for(2)
    b = w.ctl._deployments.find("b")
    plan = b.plan
    assert plan is not None and Rung.FETCH not in {r for _, r in plan.steps}
    await w.run_for(62)
    assert b.plan is plan and b.plan_zygote_others == 1.0    # its price fell: no plan can change (to_replan)


async def test_a_node_with_no_slices_deploys_nothing_and_offers_its_models(tmp: Path) -> None:
    w = World(tmp, slots=0)
    await w.ctl.deploy_all()
    assert w.ctl.contracts() == [] and not w.ctl.has_models() and w.node.prepared == {} and w.node.started == []
    assert [c.key for c in w.ctl.offered()] == ["m:1"]
    await w.ctl.load_model("m")                  # a repository load deploys nothing there either
    assert not w.ctl.has_models() and w.node.prepared == {}
    with pytest.raises(ModelNotFound):
        await w.ctl.load_model("nope")
    full = World(tmp)
    await full.ctl.deploy_all()
    assert [c.key for c in full.ctl.offered()] == [c.key for c in full.ctl.contracts()] == ["m:1"]


async def test_each_request_reaches_its_instance_with_its_callers_tenant(tmp: Path) -> None:
    """Whichever way a request comes (collected, streamed, a job run later), the node is told its caller's tenant:
    a model keeping state per tenant (the llm runtime's prefix cache) keeps one tenant's from another."""
    w = World(tmp)
    await w.ctl.deploy_all()
    contract = w.ctl.contract("m")
    await w.ctl.infer(contract, X, tenant="acme")
    await collect(aiter(await w.ctl.stream(contract, X, tenant="beta")))
    accepted = await w.ctl.infer(contract, X, respond_async=True, tenant="gamma")
    assert isinstance(accepted, JobAccepted)
    assert (await settle(w, accepted.job_id, "succeeded")).state == "succeeded"
    await w.infer()   # authentication off: no tenant
    assert w.node.tenants == ["acme", "beta", "gamma", None]


async def test_a_model_whose_starts_fail_is_not_ready_says_why_and_is_ready_again_once_one_starts(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every fork failing (as `cd ~/proj && ember serve --state-dir ~/proj/state` once did) answered 503 while
    `/v2/health/ready` said 200 and nothing was logged. A model whose last start failed and that has no instance to
    serve from is not ready; the failure is logged once with its reason (not again while the reason is the same);
    the tick tries a start again, with no request to make one, and readiness comes back when it succeeds."""
    w = World(tmp)
    await w.ctl.deploy_all()
    assert w.ctl.server_ready() and w.ctl.model_ready("m")
    w.node.fail_start.add("m:1")
    caplog.set_level(logging.INFO, logger="ember.controller")
    for _ in range(2):
        with pytest.raises(ModelNotReady, match="told to fail"):
            await w.infer()
    assert not w.ctl.model_ready("m") and not w.ctl.server_ready()
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        "m:1: a start from the template failed (1 in a row; not ready until a start succeeds): "
        "m:1: cannot start (told to fail)"]
    reasons = {e.name: e.reason for e in w.ctl.repository_index()}
    assert reasons["m"] == "its last 2 start(s) failed: m:1: cannot start (told to fail)"
    w.node.fail_start.clear()
    await w.run_for(1, step=0.25)
    assert w.ctl.model_ready("m") and w.ctl.server_ready()
    assert [i["state"] for i in w.ctl.status()[0].instances] == ["idle"]   # the tick's start, ready for the next
    assert any("ready again" in r.getMessage() for r in caplog.records)
    assert (await w.infer()).rung is Rung.HOT


async def test_a_deploy_under_way_or_done_is_a_deployment_and_a_failed_one_is_not(tmp_path: Path) -> None:
    """A take-up (`ember.cluster.service`) deploys what this node has no deployment of: not a model loading since
    startup again, but a model whose deploy failed, again."""
    write(tmp_path, "m")
    (tmp_path / "models" / "big.yaml").write_text((tmp_path / "models" / "m.yaml").read_text()
                                                  .replace("name: m", "name: big").replace("memory_mb: 512",
                                                                                          "memory_mb: 999999"))
    w = World(tmp_path)
    assert not w.ctl.has_deployment("m:1")
    await w.ctl.deploy_all()
    assert w.ctl.has_deployment("m:1")
    assert w.ctl.repository_index() and not w.ctl.has_deployment("big:1")
