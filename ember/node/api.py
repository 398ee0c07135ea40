"""What the serving core needs from a node (local today, remote later).

The controller owns the pool's bookkeeping; a node only does what it is told:
prepare a model's local rungs, start an instance from a rung onto a slice, route a
request to it, pause, resume and stop it, and report instance exits and memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


@dataclass(frozen=True)
class StartedInstance:
    instance_id: str
    pid: int
    rung: Rung                 # TEMPLATE, ZYGOTE or FETCH: how it was started
    time_to_ready_s: float     # from the start call to warmup done (a FETCH's pull included)


@dataclass(frozen=True)
class MemoryUsage:
    rss_bytes: int
    pss_bytes: int
    uss_bytes: int = 0         # private pages only: what this process alone adds (0 if unknown)


ExitCallback = Callable[[str, int], None]  # (instance_id, exit status or -signal)


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

    def weights_local(self, contract: ModelContract) -> bool:
        """True when starting the model needs no fetch: weights that are not in a weight store, or whose
        every chunk is in a local tier. Cheap (a manifest read and an index query, never the network);
        False when not even the manifest is local."""

    async def start(self, contract: ModelContract, rung: Rung, slice_: Slice) -> StartedInstance:
        """Fork an instance from `rung` pinned to `slice_`; return once warm.

        TEMPLATE forks the model's template; ZYGOTE forks the runtime's zygote, which loads the weights;
        FETCH first pulls a store-backed model's weights into the local tiers, then forks like ZYGOTE
        (its `time_to_ready_s` includes the pull).
        """

    async def infer(self, instance_id: str, inputs: Tensors) -> Tensors:
        """Run one request. Raises WorkerCrashed if the instance dies, ModelFailed if the model raised."""

    async def pause(self, instance_id: str) -> None: ...

    async def resume(self, instance_id: str) -> None: ...

    async def stop(self, instance_id: str) -> None:
        """Retire an instance: it drains in-flight work and leaves with os._exit."""

    def memory(self, instance_id: str) -> MemoryUsage: ...

    def template_memory(self, model_key: str) -> MemoryUsage | None:
        """The template's memory, or None when the model has no template."""

    def on_exit(self, callback: ExitCallback) -> None:
        """Call `callback` when an instance exits on its own (crash, OOM kill)."""

    async def close(self) -> None:
        """Stop everything this node started."""
