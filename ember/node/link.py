"""One framed connection from the node to one of its processes, multiplexed by request id.

Every request gets a `ReplyFrames`: the frames answering it arrive in order, as they come, and it ends with
a terminal frame (`result` without `more`, `end`, `error`, `cancelled`, or any control reply). Many
requests share the connection at once, in both directions: `cancel()` sends `{op: cancel, id}` while
the instance works, and `settled()` tells when the process has really let go of a request, which is
what a slice's bookkeeping must wait for, not the client.

Frames are read under the link's `PayloadLimits` (`ember.node.framing`): a frame past them ends the link, which
records why in `broken` (its node kills the process: it broke its protocol).

Each frame is bounded, and so is what waits in memory for one request: an infer request's frames not yet taken by
its consumer hold at most the limit of one reply (`PayloadLimits.of` a `result`: the model's memory and the node's
reply budget). A streaming model that writes faster than its consumer reads (a slow SSE client) does not break its
protocol, so it is not killed, and the link is not paused (its other requests would wait on the slow one): the request
past its budget fails with ModelFailed naming the limit, its queue is dropped, the instance is asked to cancel it,
and its later frames are discarded until the terminal one (which still settles it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping

import numpy as np

from ember.errors import InvalidInput, ModelFailed, WorkerCrashed
from ember.node.framing import Frame, Header, PayloadLimits, read_frame, write_frame
from ember.node.polling import ReplyPoller

log = logging.getLogger("ember.node")


def is_terminal(frame: Frame) -> bool:
    return not (frame.op == "result" and frame.header.get("more"))


class ReplyFrames:
    """The frames answering one request, in order; `async for` them, or `await next_frame()`.

    `budget`: the most payload bytes that may wait unread (None: no bound); past it the request fails (ModelFailed)
    and is cancelled, and its later frames are dropped (the module's docstring says why).
    """

    def __init__(self, link: Link, request_id: int, poller: ReplyPoller | None,
                 on_done: Callable[[], None] | None = None, budget: int | None = None) -> None:
        self._link, self.id, self._poller, self._on_done = link, request_id, poller, on_done
        self._frames: collections.deque[Frame | BaseException] = collections.deque()
        self._budget = budget
        self._queued = 0          # payload bytes delivered, not yet taken
        self._dropping = False    # past the budget: frames are discarded until the terminal one
        self._waiter: asyncio.Future[None] | None = None
        self._first = True
        self._over = False        # the consumer has seen the terminal frame
        self._done = asyncio.Event()   # the process has sent it (or died)
        self._cancel_sent = False

    def deliver(self, item: Frame | BaseException) -> None:
        final = isinstance(item, BaseException) or is_terminal(item)
        if isinstance(item, Frame) and not self._dropping:
            size = len(item.payload)
            if self._budget is not None and self._queued + size > self._budget:
                self._overflow(size, final)
            else:
                self._queued += size
                self._frames.append(item)
        elif isinstance(item, BaseException) and not self._done.is_set():
            self._frames.append(item)
        if final and not self._done.is_set():
            self._done.set()
            if self._on_done is not None:
                self._on_done()
        self._wake()

    def _overflow(self, size: int, final: bool) -> None:
        """The unread replies would pass the budget: fail the request, free its queue, ask the instance to stop."""
        unread = self._queued + size
        self._dropping = True
        self._frames.clear()
        self._queued = 0
        self._frames.append(ModelFailed(
            f"{self._link.name}: request {self.id}'s unread replies would reach {unread} bytes, past the "
            f"reply limit of {self._budget} bytes (the model's memory_mb and the server's max_inflight_mb); "
            "read its stream faster, or make the model send less"))
        if not final:
            self.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def next_frame(self) -> Frame | None:
        """The next frame; None after the terminal one. A dead process raises WorkerCrashed."""
        if self._over:
            return None
        while not self._frames:
            self._waiter = asyncio.get_running_loop().create_future()
            if self._first and self._poller is not None:
                await self._poller.wait(self._waiter)
            else:
                await self._waiter
        self._first = False
        item = self._frames.popleft()
        if isinstance(item, BaseException):
            self._over = True
            raise item
        self._queued -= len(item.payload)
        self._over = is_terminal(item)
        return item

    def cancel(self) -> None:
        """Ask the process to drop this request (once; nothing if it has answered already)."""
        if self.done or self._cancel_sent:
            return
        self._cancel_sent = True
        self._link.send({"op": "cancel", "id": self.id})

    async def settled(self) -> None:
        """Wait until the process has sent this request's last frame (or is gone)."""
        await self._done.wait()


class Link:
    """One framed connection to a node process; frames are routed to their request by id."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_event: Callable[[Header], None], on_close: Callable[[], None],
                 poller: ReplyPoller | None = None, limits: PayloadLimits | None = None) -> None:
        self.name = name
        self._poller = poller   # instances' links: poll for infer replies instead of sleeping
        self.limits = limits    # None: only the frame's own bounds
        self.broken: str | None = None   # why the process's frames ended the link, if they did
        self._reader, self._writer = reader, writer
        self._on_event, self._on_close = on_event, on_close
        self._open: dict[int, ReplyFrames] = {}
        self._ids = itertools.count(1)
        self.closed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._read_loop())

    async def call(self, header: Header, tensors: Mapping[str, np.ndarray] | None = None) -> Frame:
        """A request with one reply (fork, ping, drain)."""
        replies = await self.request(header, tensors)
        try:
            frame = await replies.next_frame()
        except asyncio.CancelledError:
            # Nobody waits for the reply any more: it reaches `on_event` (a fork's child is then killed).
            self._open.pop(replies.id, None)
            raise
        assert frame is not None
        return frame

    async def request(self, header: Header, tensors: Mapping[str, np.ndarray] | None = None) -> ReplyFrames:
        """Send a request; its replies come through the returned `ReplyFrames`."""
        if self.closed.is_set():
            raise WorkerCrashed(f"{self.name} is gone")
        request_id = next(self._ids)
        poller = self._poller if header.get("op") == "infer" else None
        if poller is not None:
            # The instance counts as busy (for polling) from this request until it has answered it.
            header = {**header, "poll_s": poller.begin()}
        budget = self.limits.of({"op": "result"}) if self.limits is not None and header.get("op") == "infer" else None
        replies = ReplyFrames(self, request_id, poller, poller.end if poller is not None else None, budget)
        self._open[request_id] = replies
        try:
            write_frame(self._writer, {**header, "id": request_id}, tensors)
            await self._writer.drain()
        except (ConnectionError, OSError):
            self._open.pop(request_id, None)
            replies.deliver(WorkerCrashed(f"{self.name} closed its connection"))
            raise WorkerCrashed(f"{self.name} closed its connection") from None
        return replies

    def send(self, header: Header) -> None:
        """A frame that expects no reply of its own (a cancel)."""
        if not self.closed.is_set():
            with contextlib.suppress(ConnectionError, OSError):
                write_frame(self._writer, header)

    async def _read_loop(self) -> None:
        try:
            while (frame := await read_frame(self._reader, self.limits)) is not None:
                replies = self._open.get(frame.header.get("id"))  # type: ignore[arg-type]
                if replies is None:
                    self._on_event(frame.header)
                    continue
                if is_terminal(frame):
                    del self._open[replies.id]
                replies.deliver(frame)
        except InvalidInput as err:
            self.broken = str(err)
            log.warning("%s broke the frame protocol: %s", self.name, err)
        except (ConnectionError, OSError) as err:
            log.warning("%s: broken connection: %s", self.name, err)
        finally:
            self.closed.set()
            for replies in self._open.values():
                replies.deliver(WorkerCrashed(f"{self.name} died before answering"))
            self._open.clear()
            self._writer.close()
            self._on_close()

    def close(self) -> None:
        self._writer.close()
