"""What the serving core needs from a node (local today, remote later).

The controller owns the pool's bookkeeping; a node only does what it is told:
prepare a model's local rungs, start an instance from a rung onto a slice, route a
request to it, pause, resume and stop it, and report instance exits and memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ember.core.bandwidth import Bandwidths
from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import ModelFailed
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


@dataclass(frozen=True)
class StartedInstance:
    instance_id: str
    pid: int
    rung: Rung                 # TEMPLATE, ZYGOTE or FETCH: how it was started
    time_to_ready_s: float     # from the start call to warmup done (a FETCH's pull included)
    # Seconds per phase of the start: spawn (fork and process setup), fetch (FETCH only), load, warmup.
    phases: Mapping[str, float] = field(default_factory=dict)
    sleep_levels: tuple[int, ...] = ()   # the levels its engine can sleep at (vLLM's sleep mode on a GPU)


@dataclass(frozen=True)
class StoreUsage:
    tier_bytes: Mapping[str, int]   # bytes held per local tier of the node's weight store
    fetched_bytes: Mapping[str, int]  # chunk bytes the node's store fetched so far, by source (peer, origin)
    fetch_s: float                  # seconds those pulls took


@dataclass(frozen=True)
class MemoryUsage:
    rss_bytes: int
    pss_bytes: int
    uss_bytes: int = 0         # private pages only: what this process alone adds (0 if unknown)
    pid: int = 0               # the process measured (0 if unknown)


ExitCallback = Callable[[str, int], None]  # (instance_id, exit status or -signal)


class Replies(Protocol):
    """An instance's replies to one request, as they come: one, or several for a streaming model.

    Iterating raises the request's error (ModelFailed, InvalidInput, DeadlineExceeded, Cancelled, or
    WorkerCrashed when the instance died). `cancel()` asks the instance to stop the request; `settled()`
    returns once the instance has let go of it (answered, stopped it, or died): only then is its room free.
    """

    def __aiter__(self) -> AsyncIterator[Tensors]: ...

    @property
    def done(self) -> bool:
        """The instance has let go of the request (what `settled()` waits for)."""

    def cancel(self) -> None: ...

    async def settled(self) -> None: ...


async def collect(replies: AsyncIterable[Tensors], max_bytes: int | None = None) -> Tensors:
    """One answer from all replies: the only one, or each output concatenated along its first axis.

    `max_bytes`: the most tensor bytes the replies together may carry (the server's reply budget; None: no bound).
    Past it the request is withdrawn (the iterable's `aclose()`, else its `cancel()`) and ModelFailed names the
    limit: a streaming model's replies, each within its own limit, never pile up in memory without end.
    """
    parts: list[Tensors] = []
    total = 0
    async for reply in replies:
        total += sum(array.nbytes for array in reply.values())
        if max_bytes is not None and total > max_bytes:
            await _withdraw(replies)
            raise ModelFailed(f"the model's replies came to more than {max_bytes} bytes, the most one answer may "
                              "carry (the server's max_inflight_mb); stream them instead, or make the model send less")
        parts.append(reply)
    if len(parts) == 1:
        return parts[0]
    if not parts:
        raise ModelFailed("the model answered with no replies")
    try:
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    except (KeyError, ValueError) as err:
        raise ModelFailed(f"the model's replies do not concatenate into one answer: {err}") from None


async def _withdraw(replies: object) -> None:
    aclose, cancel = getattr(replies, "aclose", None), getattr(replies, "cancel", None)
    if aclose is not None:
        await aclose()
    elif cancel is not None:
        cancel()


class Node(Protocol):
    async def prepare(self, contract: ModelContract) -> None:
        """Bring up the runtime's zygote and, if the contract keeps one, the model's template.

        Idempotent. Returns when they are ready; raises ModelNotReady naming the cause
        if the model cannot load (bad weights, import error in user code). A template's store-backed
        weights are fetched here; without a template they are not (its first start then takes FETCH).
        """

    async def release(self, model_key: str) -> None:
        """Stop the model's template and every instance of it."""

    def has_template(self, model_key: str) -> bool: ...

    def can_restore(self, contract: ModelContract) -> bool:
        """The model's process image is on this node's disk and restores here (rung RESTORE; snapshots on)."""

    def snapshot_status(self) -> dict[str, Any]:
        """{"state": "on (CRIU 4.1.1)" | "off (why)", "images": [{"model", "mb", "load_s", "dump_s", "restores"}],
        "loads": processes that ran a model's load() on this node since it started}."""

    def has_zygote(self, runtime: str) -> bool:
        """The runtime's zygote is up."""

    async def start_zygote(self, runtime: str) -> None:
        """Bring the runtime's zygote up (idempotent)."""

    async def release_template(self, model_key: str) -> bool:
        """Stop the model's template (a keep-alive plan keeps nothing above the zygote). False, and nothing
        done, while an instance forked from it lives: it would die with its template."""

    async def release_zygote(self, runtime: str) -> bool:
        """Stop the runtime's zygote (a plan keeps nothing). False, and nothing done, while it has a child."""

    def weights_local(self, contract: ModelContract) -> bool:
        """True when starting the model needs no fetch: weights that are not in a weight store, or whose
        every chunk is in a local tier. Cheap (a manifest read and an index query, never the network);
        False when not even the manifest is local."""

    def store_backed(self, contract: ModelContract) -> bool:
        """True when the model's weights are in the node's weight store and that store keeps a memory tier (RAM,
        shared by the node's models): a keep-alive plan that keeps nothing of the model releases its copy there."""

    async def release_weights(self, contract: ModelContract, keep: Sequence[ModelContract]) -> int:
        """Remove the store-backed model's chunks from the memory tier, but those it shares with the models in
        `keep`; the disk copy stays (a later start reads it from there). Returns the bytes removed; pages an
        instance still maps stay its own until it unmaps them."""

    async def fill_weights(self, contract: ModelContract) -> None:
        """Copy the store-backed model's chunks up to the memory tier again (in the background)."""

    def weights_size(self, contract: ModelContract) -> tuple[int, int] | None:
        """(bytes, of those in local tiers) of store-backed weights, from the local manifest ((0, 0) when it is
        not here: unknown); None for weights not in a store. Cheap, never the network."""

    def bandwidths(self) -> Bandwidths:
        """What the node's weight store measured moving chunks (disk, peers, origin); None figures until it
        has (ember/core/bandwidth.py). Cheap: the cluster report asks it twice a second."""

    async def start(self, contract: ModelContract, rung: Rung, slice_: Slice) -> StartedInstance:
        """Fork an instance from `rung` pinned to `slice_`; return once warm.

        TEMPLATE forks the model's template; ZYGOTE forks the runtime's zygote, which loads the weights;
        FETCH first pulls a store-backed model's weights into the local tiers, then forks like ZYGOTE
        (its `time_to_ready_s` includes the pull).
        """

    async def open(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                   tenant: str | None = None) -> Replies:
        """Send one request to the instance; its replies come as they are made. Many requests may be open on
        one instance at once (it batches them). Past `timeout_s` the instance answers DeadlineExceeded.
        `tenant`: the caller's (None: none), which a model keeping state per tenant is told (the llm runtime's
        prefix cache: one tenant's prompts never serve another's)."""

    async def infer(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                    tenant: str | None = None) -> Tensors:
        """`open` and `collect`. Raises WorkerCrashed if the instance dies, ModelFailed if the model raised."""

    async def pause(self, instance_id: str) -> None: ...

    async def resume(self, instance_id: str) -> None: ...

    async def sleep(self, instance_id: str, level: int) -> float:
        """Put an idle instance's engine to sleep at `level` (1: weights to host memory, 2: discarded), then pause
        it; returns the MB it still holds on its slice's device. ModelFailed (or the model's error) if it cannot."""

    async def wake(self, instance_id: str) -> None:
        """Resume an asleep instance and wake its engine (level 2: its weights read again)."""

    async def stop(self, instance_id: str) -> None:
        """Retire an instance: it drains in-flight work and leaves with os._exit."""

    def memory(self, instance_id: str) -> MemoryUsage: ...

    def store_usage(self) -> StoreUsage: ...

    def zygote_memory(self) -> dict[str, MemoryUsage]:
        """Memory of each runtime's zygote that is running, by runtime name."""

    def template_memory(self, model_key: str) -> MemoryUsage | None:
        """The template's memory, or None when the model has no template."""

    def on_exit(self, callback: ExitCallback) -> None:
        """Call `callback` when an instance exits on its own (crash, OOM kill)."""

    async def close(self) -> None:
        """Stop everything this node started."""
