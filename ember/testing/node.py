"""An in-process node: real bookkeeping, no processes. Implements `ember.node.api.Node`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from ember.core.bandwidth import Bandwidths
from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import Cancelled, InvalidInput, ModelFailed, ModelNotReady, WorkerCrashed
from ember.node.api import ExitCallback, MemoryUsage, StartedInstance, StoreUsage, collect
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


def sum_model(inputs: Tensors) -> Tensors:
    """Default behaviour: each output is the row sums of the first numeric input (or lengths of BYTES)."""
    first = next(iter(inputs.values()))
    if first.dtype == object:
        values = np.array([len(x) for x in first.reshape(-1)], dtype=np.float32)
    else:
        values = first.reshape(first.shape[0], -1).sum(axis=1).astype(np.float32)
    return {"y": values}


class FakeReplies:
    """A request in flight on a fake instance: its model runs as a task; `cancel()` stops it, unless the node
    plays a model that never checks `stop` (`cancellable = False`), which only the instance's death ends."""

    def __init__(self, node: FakeNode, instance_id: str, task: asyncio.Future[list[Tensors]]) -> None:
        self._node, self.instance_id, self._task = node, instance_id, task
        self._killed = False
        self._cancel_sent = False

    def on_done(self, callback: Callable[[FakeReplies], None]) -> None:
        self._task.add_done_callback(lambda _: callback(self))

    def kill(self) -> None:
        """The instance was stopped: the request dies with it."""
        self._killed = True
        self._task.cancel()

    def __aiter__(self) -> AsyncIterator[Tensors]:
        return self._replies()

    async def _replies(self) -> AsyncIterator[Tensors]:
        try:
            replies = await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._task.cancelled() and self._killed:
                raise WorkerCrashed(f"instance {self.instance_id} was stopped") from None
            if self._task.cancelled():
                raise Cancelled(f"instance {self.instance_id} stopped the request") from None
            raise
        for reply in replies:
            yield reply

    @property
    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        if self._task.done() or not self._node.cancellable or self._cancel_sent:
            return
        self._cancel_sent = True
        self._node.cancelled.append(self.instance_id)
        self._task.cancel()

    async def settled(self) -> None:
        await asyncio.wait([self._task])


class FakeNode:
    """`remote` holds the keys of models whose weights are not on this node (as with a weight store's
    origin): `weights_local` is False for them until a FETCH start, or the prepare of a model that keeps a
    template, pulls them (`fetch_delay` seconds, counted in the start's `time_to_ready_s`)."""

    def __init__(self, model: Callable[[Tensors], Tensors | list[Tensors]] = sum_model, start_delay: float = 0.0,
                 infer_delay: float = 0.0, remote: set[str] | None = None, fetch_delay: float = 0.0) -> None:
        self.model = model
        self.start_delay = start_delay
        self.infer_delay = infer_delay
        self.remote: set[str] = set(remote or ())
        self.fetch_delay = fetch_delay
        self.measured = Bandwidths()                  # what bandwidths() answers
        self.weight_bytes: dict[str, int] = {}        # store-backed models' sizes (weights_size); 0: unknown
        self.fetched: list[str] = []                 # model keys, once per pull
        self.memory_tier = True                      # the store keeps a memory tier (store_backed)
        self.weight_releases: list[tuple[str, frozenset[str]]] = []   # (model, the models whose chunks stay)
        self.weight_fills: list[str] = []            # model keys, once per fill of the memory tier
        self.prepared: dict[str, ModelContract] = {}
        self.templates: set[str] = set()
        self.images: set[str] = set()                # model keys whose process image restores here (RESTORE)
        self.fail_restore: set[str] = set()          # model keys whose image is there but fails to restore
        self.zygotes: set[str] = set()               # runtimes whose zygote is up
        self.instances: dict[str, str] = {}          # instance id -> model key
        self.paused: set[str] = set()
        self.sleep_levels: dict[str, tuple[int, ...]] = {}   # model key -> the levels its engine can sleep at
        self.held_mb = 0.0                           # what a sleeping instance says it still holds
        self.fail_sleep = False                      # sleep() raises ModelFailed (an engine that cannot sleep now)
        self.fail_wake = False                       # wake() raises ModelFailed (an engine that fails to wake)
        self.sleep_delay = 0.0                       # seconds a sleep takes
        self.wake_delay = 0.0                        # seconds a wake takes (a failing one fails after it)
        self._asleep_until: dict[str, asyncio.Event] = {}   # set by wake(): a request to an asleep instance waits
        self.asleep: dict[str, int] = {}             # instance id -> the level it sleeps at
        self.wakes: list[str] = []                   # instance ids, once per wake
        self.started: list[tuple[str, Rung, str]] = []  # (model, rung, slice id)
        self.attempts: list[str] = []                    # model keys of every start asked for, failed ones too
        self.fail_prepare: set[str] = set()
        self.fail_start: set[str] = set()            # model keys whose starts fail (an origin down, a bad load)
        self.crash_next: set[str] = set()            # instance ids that die on their next request
        self.crash_new = False                       # every instance started from now on dies on its first request
        self.cancellable = True                      # False: a model that never checks stop (only a kill ends it)
        self.opened: list[str] = []                  # instance ids, once per request sent
        self.tenants: list[str | None] = []          # the tenant each request was sent for, in that order
        self.cancelled: list[str] = []               # instance ids whose request was stopped by a cancel
        self._exit: list[ExitCallback] = []
        self._inflight: dict[str, set[FakeReplies]] = {}
        self._ids = itertools.count(1)

    async def prepare(self, contract: ModelContract) -> None:
        if contract.key in self.fail_prepare:
            raise ModelNotReady(f"{contract.key}: cannot load (told to fail)")
        self.prepared[contract.key] = contract
        self.zygotes.add(contract.runtime)
        if contract.scaling.keep_template:
            await self._fetch(contract.key)          # a template loads from local weights
            self.templates.add(contract.key)

    async def release(self, model_key: str) -> None:
        self.prepared.pop(model_key, None)
        self.templates.discard(model_key)
        for iid in [i for i, m in self.instances.items() if m == model_key]:
            await self.stop(iid)

    def has_template(self, model_key: str) -> bool:
        return model_key in self.templates

    def can_restore(self, contract: ModelContract) -> bool:
        return contract.key in self.images

    def snapshot_status(self) -> dict[str, Any]:
        return {"state": "on (fake)" if self.images else "off (fake)", "images": [{"model": k} for k in
                                                                                 sorted(self.images)],
                "loads": 0}

    def has_zygote(self, runtime: str) -> bool:
        return runtime in self.zygotes

    async def start_zygote(self, runtime: str) -> None:
        self.zygotes.add(runtime)

    async def release_template(self, model_key: str) -> bool:
        if any(m == model_key for m in self.instances.values()):
            return False
        self.templates.discard(model_key)
        return True

    async def release_zygote(self, runtime: str) -> bool:
        mine = {k for k, c in self.prepared.items() if c.runtime == runtime}
        if any(m in mine for m in self.instances.values()) or self.templates & mine:
            return False
        self.zygotes.discard(runtime)
        return True

    def weights_local(self, contract: ModelContract) -> bool:
        return contract.key not in self.remote

    def store_backed(self, contract: ModelContract) -> bool:
        return contract.store_ref is not None and self.memory_tier

    async def release_weights(self, contract: ModelContract, keep: Sequence[ModelContract]) -> int:
        self.weight_releases.append((contract.key, frozenset(c.key for c in keep)))
        return self.weight_bytes.get(contract.key, 0)

    async def fill_weights(self, contract: ModelContract) -> None:
        self.weight_fills.append(contract.key)

    def bandwidths(self) -> Bandwidths:
        return self.measured

    def weights_size(self, contract: ModelContract) -> tuple[int, int] | None:
        if contract.store_ref is None:
            return None
        size = self.weight_bytes.get(contract.key, 0)
        return (size, 0 if contract.key in self.remote else size)

    async def _fetch(self, model_key: str) -> float:
        if model_key not in self.remote:
            return 0.0
        await asyncio.sleep(self.fetch_delay)
        self.remote.discard(model_key)
        self.fetched.append(model_key)
        return self.fetch_delay

    async def start(self, contract: ModelContract, rung: Rung, slice_: Slice) -> StartedInstance:
        self.attempts.append(contract.key)
        if contract.key not in self.prepared or (rung is Rung.TEMPLATE and contract.key not in self.templates):
            raise ModelNotReady(f"{contract.key}: not prepared for {rung.value}")
        if contract.key in self.fail_start:
            raise ModelNotReady(f"{contract.key}: cannot start (told to fail)")
        if rung not in (Rung.TEMPLATE, Rung.ZYGOTE, Rung.RESTORE, Rung.FETCH):
            raise InvalidInput(f"rung: an instance starts from 'template', 'zygote', 'restore' or 'fetch', not "
                               f"{rung.value!r}")
        if rung is Rung.RESTORE and (contract.key not in self.images or contract.key in self.fail_restore):
            raise ModelNotReady(f"{contract.key}: no image to restore")
        # A zygote start of a remote model fetches too (chunk by chunk, in the child): either way it ends local.
        if rung in (Rung.ZYGOTE, Rung.FETCH):
            self.zygotes.add(contract.runtime)   # started on demand, as the local node does
        fetch_s = await self._fetch(contract.key)
        await asyncio.sleep(self.start_delay)
        iid = f"fake-{next(self._ids)}"
        self.instances[iid] = contract.key
        self.started.append((contract.key, rung, slice_.id))
        if self.crash_new:
            self.crash_next.add(iid)
        phases = {"spawn": self.start_delay, **({"fetch": fetch_s} if fetch_s else {})}
        return StartedInstance(iid, 10_000 + len(self.started), rung, fetch_s + self.start_delay, phases,
                               self.sleep_levels.get(contract.key, ()))

    async def open(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                   tenant: str | None = None) -> FakeReplies:
        if instance_id not in self.instances or instance_id in self.paused:
            raise WorkerCrashed(f"instance {instance_id} is not running")
        self.opened.append(instance_id)
        self.tenants.append(tenant)
        replies = FakeReplies(self, instance_id, asyncio.ensure_future(self._serve(instance_id, inputs)))
        inflight = self._inflight.setdefault(instance_id, set())
        inflight.add(replies)
        replies.on_done(inflight.discard)
        return replies

    async def infer(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                    tenant: str | None = None) -> Tensors:
        return await collect(aiter(await self.open(instance_id, inputs, timeout_s=timeout_s, tenant=tenant)))

    async def _serve(self, instance_id: str, inputs: Tensors) -> list[Tensors]:
        stopped = self._asleep_until.get(instance_id)
        if stopped is not None:
            await stopped.wait()   # asleep and stopped, as a real node leaves it: only a wake lets it answer
        await asyncio.sleep(self.infer_delay)
        if instance_id in self.crash_next:
            self.crash_next.discard(instance_id)
            self.instances.pop(instance_id)
            for cb in self._exit:
                cb(instance_id, -9)
            raise WorkerCrashed(f"instance {instance_id} died (signal 9)")
        outputs = self.model(inputs)
        return outputs if isinstance(outputs, list) else [outputs]

    async def pause(self, instance_id: str) -> None:
        self.paused.add(instance_id)

    async def resume(self, instance_id: str) -> None:
        self.paused.discard(instance_id)

    async def sleep(self, instance_id: str, level: int) -> float:
        if instance_id not in self.instances:
            raise WorkerCrashed(f"instance {instance_id} is not running")
        self.paused.discard(instance_id)
        await asyncio.sleep(self.sleep_delay)
        if self.fail_sleep or level not in self.sleep_levels.get(self.instances[instance_id], ()):
            raise ModelFailed(f"instance {instance_id} cannot sleep at level {level}")
        self._asleep_until[instance_id] = asyncio.Event()
        self.asleep[instance_id] = level
        return self.held_mb

    async def wake(self, instance_id: str) -> None:
        await asyncio.sleep(self.wake_delay)
        if instance_id not in self.instances:
            raise WorkerCrashed(f"instance {instance_id} is not running")
        self.paused.discard(instance_id)
        if self.fail_wake:
            raise ModelFailed(f"instance {instance_id}: its engine failed to wake")
        if self.asleep.pop(instance_id, None) is not None:
            self.wakes.append(instance_id)
        stopped = self._asleep_until.pop(instance_id, None)
        if stopped is not None:
            stopped.set()

    async def stop(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)
        self.asleep.pop(instance_id, None)
        stopped = self._asleep_until.pop(instance_id, None)
        if stopped is not None:
            stopped.set()   # its requests die with it below
        self.paused.discard(instance_id)
        for replies in self._inflight.pop(instance_id, set()):
            replies.kill()

    def zygote_memory(self) -> dict[str, MemoryUsage]:
        return {c.runtime: MemoryUsage(50 << 20, 40 << 20) for c in self.prepared.values()}

    def store_usage(self) -> StoreUsage:
        return StoreUsage({"disk": 0}, {}, sum(self.fetch_delay for _ in self.fetched))

    def memory(self, instance_id: str) -> MemoryUsage:
        return MemoryUsage(rss_bytes=100 << 20, pss_bytes=20 << 20)

    def template_memory(self, model_key: str) -> MemoryUsage | None:
        return MemoryUsage(300 << 20, 250 << 20) if model_key in self.templates else None

    def on_exit(self, callback: ExitCallback) -> None:
        self._exit.append(callback)

    async def close(self) -> None:
        self.instances.clear()
