"""What an instance's frames mean to the node: its replies as tensors, its error frames as ember errors."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from ember.errors import Cancelled, EmberError, InvalidInput, ModelFailed, WorkerCrashed, error_named
from ember.node.link import ReplyFrames
from ember.wire.tensors import Tensors


def describe_status(status: int | None) -> str:
    if status is None:
        return "status unknown"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}" if -status in signal.valid_signals() else f"signal {-status}"
    return f"exit code {status}"


def error_from(header: Mapping[str, Any]) -> EmberError:
    """The ember error an error frame names (unknown names become ModelFailed)."""
    name, message = str(header.get("kind", "")), str(header.get("message", ""))
    return error_named(name, message, header.get("retry_after")) or ModelFailed(message or name)



class InstanceReplies:
    """An instance's replies to one request as tensors; its error frames raised as ember errors."""

    def __init__(self, instance_id: str, replies: ReplyFrames) -> None:
        self.instance_id, self._replies = instance_id, replies

    def __aiter__(self) -> InstanceReplies:
        return self

    async def __anext__(self) -> Tensors:
        frame = await self._replies.next_frame()
        if frame is None or frame.op == "end":
            raise StopAsyncIteration
        if frame.op == "result":
            try:
                return frame.tensors()
            except InvalidInput as err:
                raise ModelFailed(f"instance {self.instance_id} sent a malformed reply: {err}") from None
        if frame.op == "cancelled":
            raise Cancelled(f"instance {self.instance_id} stopped the request")
        if frame.op == "error":
            error = error_from(frame.header)
            # A reply proves the instance alive: a model raising WorkerCrashed must not make the
            # caller drop a running process from its books (it would serve no one and never be stopped).
            raise ModelFailed(error.message) if isinstance(error, WorkerCrashed) else error
        raise ModelFailed(f"instance {self.instance_id} answered with an unexpected {frame.op!r} frame")

    @property
    def done(self) -> bool:
        return self._replies.done

    def cancel(self) -> None:
        self._replies.cancel()

    async def settled(self) -> None:
        await self._replies.settled()
