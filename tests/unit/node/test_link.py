"""What waits in the node's memory for one request is bounded, not only each frame: a streaming instance that writes
faster than its consumer reads fails that request (ModelFailed naming the limit) and is asked to cancel it; a
collected answer is bounded by the reply budget in total."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from ember.errors import ModelFailed
from ember.node.api import collect
from ember.node.framing import PayloadLimits, encode_frame, read_frame
from ember.node.link import Link
from ember.wire.tensors import Tensors

LIMIT = 4096   # one reply's limit, and so the most that may wait unread


def result(request_id: int, nbytes: int, more: bool) -> bytes:
    frame = encode_frame({"op": "result", "id": request_id, "more": more}, {"y": np.zeros(nbytes, np.uint8)})
    return b"".join(frame)


async def a_link() -> tuple[Link, asyncio.StreamReader, asyncio.StreamReader]:
    """A link whose process side is a feedable reader (what it sends) and a reader of what the node sends."""
    loop = asyncio.get_running_loop()
    from_process = asyncio.StreamReader()
    to_process = asyncio.StreamReader()
    transport = _Pipe(to_process)
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    writer = asyncio.StreamWriter(transport, protocol, None, loop)   # type: ignore[arg-type]
    link = Link("instance t", from_process, writer, lambda header: None, lambda: None,
                limits=PayloadLimits({"result": LIMIT}))
    return link, from_process, to_process


class _Pipe(asyncio.WriteTransport):
    def __init__(self, into: asyncio.StreamReader) -> None:
        super().__init__()
        self._into = into

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._into.feed_data(bytes(data))

    def writelines(self, chunks: object) -> None:
        for chunk in chunks:   # type: ignore[attr-defined]
            self.write(chunk)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self._into.feed_eof()

    def get_write_buffer_size(self) -> int:
        return 0


def test_unread_replies_past_the_reply_limit_fail_the_request_and_cancel_it() -> None:
    async def main() -> None:
        link, from_process, to_process = await a_link()
        replies = await link.request({"op": "infer"})
        request = await read_frame(to_process)
        assert request is not None and request.header["op"] == "infer"
        for _ in range(100):   # each frame within its limit, many together far past it; nobody reads
            from_process.feed_data(result(replies.id, LIMIT // 2, more=True))
        cancel = await asyncio.wait_for(read_frame(to_process), 5)
        assert cancel is not None and cancel.header == {"op": "cancel", "id": replies.id}
        with pytest.raises(ModelFailed, match=f"reply limit of {LIMIT} bytes"):
            await replies.next_frame()
        assert not replies.done   # the instance has not let go yet
        from_process.feed_data(result(replies.id, 0, more=False))
        await asyncio.wait_for(replies.settled(), 5)
        assert await replies.next_frame() is None
        link.close()

    asyncio.run(main())


def test_a_reader_keeping_up_gets_every_reply() -> None:
    async def main() -> None:
        link, from_process, _ = await a_link()
        replies = await link.request({"op": "infer"})
        for i in range(10):
            from_process.feed_data(result(replies.id, LIMIT, more=i < 9))
            frame = await asyncio.wait_for(replies.next_frame(), 5)
            assert frame is not None and len(frame.payload) == LIMIT
        assert await replies.next_frame() is None
        link.close()

    asyncio.run(main())


class Replies:
    """A stream of `count` replies of `nbytes` each, recording whether it was withdrawn."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count, self.nbytes, self.taken, self.closed = count, nbytes, 0, False

    def __aiter__(self) -> AsyncIterator[Tensors]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Tensors]:
        while self.taken < self.count:
            self.taken += 1
            yield {"y": np.zeros(self.nbytes, np.uint8)}

    async def aclose(self) -> None:
        self.closed = True


def test_collect_refuses_replies_past_its_budget_and_withdraws_the_request() -> None:
    stream = Replies(count=1000, nbytes=LIMIT // 2)
    with pytest.raises(ModelFailed, match=f"more than {LIMIT} bytes"):
        asyncio.run(collect(stream, LIMIT))
    assert stream.closed and stream.taken == 3


def test_collect_within_its_budget_concatenates() -> None:
    stream = Replies(count=2, nbytes=LIMIT // 2)
    answer = asyncio.run(collect(stream, LIMIT))
    assert answer["y"].nbytes == LIMIT and not stream.closed
