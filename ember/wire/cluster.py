"""What nodes and the cluster controller tell each other (issue 14): a node's inventory, the cluster's view.

Plain values, pickled by Ray between a node's `ember serve` and the controller actor; request data never
travels in them (it goes gateway to gateway over HTTP).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.errors import EmberError, InvalidInput, error_fields
from ember.wire import bundle
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Held(_Frozen):
    """What a node has of one model it knows (deployed here, or named by the cluster's registry)."""

    model: str                      # "name:version"
    paused: int = Field(default=0, ge=0)
    template: bool = False
    bytes: int = Field(default=0, ge=0)         # the weights' size where this node can tell (0: unknown)
    local_bytes: int = Field(default=0, ge=0)   # of those, in this node's local tiers


class Warm(_Frozen):
    """A ready instance on the node, with how many requests it holds and may hold."""

    id: str
    model: str
    in_flight: int = Field(ge=0)
    max_concurrency: int = Field(ge=1)


class NodeInventory(_Frozen):
    """One node's report: its gateway's URL, capacity, what it holds, its warm instances, its contracts."""

    node: str                       # the Ray node id
    url: str                        # its gateway, reachable from the other nodes
    memory_mb: int = Field(ge=0)
    # Free: no instance holds it, or an idle or paused one the node's scheduler would evict for a start
    # (`ember.core.scheduler.startable_slices`).
    free_memory_mb: int = Field(ge=0)
    slices: dict[str, int]
    free_slices: dict[str, int]
    queue: int = Field(default=0, ge=0)
    # Seconds to work through that queue at the node's measured rates (None: placement takes queue * service_s).
    queue_s: float | None = Field(default=None, ge=0)
    disk_bps: float = Field(gt=0)   # reads of its disk tier: measured by its store (core/bandwidth.py), or assumed
    net_bps: float = Field(gt=0)    # fetches from peers, likewise
    measured: tuple[Literal["disk", "net"], ...] = ()       # which of those two the node measured
    origin_bps: float | None = Field(default=None, gt=0)   # fetches from the origin; None: not measured yet
    held: tuple[Held, ...] = ()
    warm: tuple[Warm, ...] = ()
    contracts: tuple[ModelContract, ...] = ()    # the models it was given (its --models)
    serving: tuple[str, ...] = ()   # the models deployed here (given, or taken up since): its jobs' claimers
    jobs: dict[str, int] = Field(default_factory=dict)   # durable jobs queued per model in the shared store


class ClusterView(_Frozen):
    """The controller's answer to a report: every live node's inventory and the model registry."""

    version: int = Field(ge=0)      # bumped on every change of membership
    nodes: tuple[NodeInventory, ...]
    contracts: tuple[ModelContract, ...]
    refused: dict[str, str] = Field(default_factory=dict)   # models no node could hold: key -> why (at deploy)
    origin_bps: float = Field(gt=0)  # assumed; placement takes the nodes' measured figures over it (to_snapshot)
    service_s: float = Field(ge=0)
    token: str                      # nodes present it to each other's /cluster routes
    # Models whose queued jobs no node serving them can run now, and the node that is to deploy each
    # (`ember.core.backlog`): node id -> model keys.
    take_up: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # Each node's share of every model's min scale it serves (`ember.core.min_scale`): node -> model -> instances.
    min_scale: dict[str, dict[str, int]] = Field(default_factory=dict)
    # False while a (re)started controller may not have heard from every node yet (its first ttl): a node
    # keeps its last view over an incomplete one.
    complete: bool = True


# ----- a stream between gateways: frames of (kind, length, payload) -----------------------------------------
#
# A forwarded stream's body (`POST /cluster/stream/...`) is a run of frames: one byte of kind, four bytes of
# big-endian length, the payload. REPLY carries one reply (a tensor bundle, `ember.wire.bundle.pack`), ERROR the
# error that ended the stream (JSON: kind, message, retry_after), END a clean end. A body cut off before END or
# ERROR is a node that went away mid-stream.

REPLY, ERROR, END = b"R", b"E", b"D"
_HEAD = 5
MAX_FRAME = 1 << 30   # a frame longer than this is not one of ours


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + len(payload).to_bytes(4, "big") + payload


def reply_frame(tensors: Tensors) -> bytes:
    return frame(REPLY, bundle.pack(tensors))


def error_frame(err: EmberError) -> bytes:
    return frame(ERROR, json.dumps(error_fields(err)).encode())


class FrameDecoder:
    """Frames back out of a body read in arbitrary pieces: `feed` each piece, take the frames it completed."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEAD:
            kind, n = bytes(self._buf[:1]), int.from_bytes(self._buf[1:_HEAD], "big")
            if kind not in (REPLY, ERROR, END) or n > MAX_FRAME:
                raise InvalidInput(f"cluster stream: not a frame (kind {kind!r}, length {n})")
            if len(self._buf) < _HEAD + n:
                break
            out.append((kind, bytes(self._buf[_HEAD:_HEAD + n])))
            del self._buf[:_HEAD + n]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a frame not complete yet."""
        return len(self._buf)
