"""A forwarded stream's frames (`ember.wire.cluster`): back out whole however the body is cut into pieces."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.errors import InvalidInput, Overloaded
from ember.wire import bundle
from ember.wire.cluster import END, ERROR, REPLY, FrameDecoder, error_frame, frame, reply_frame


def body() -> bytes:
    replies = [{"text": np.array([f"word{i} ".encode()], dtype=object),
                "completion_tokens": np.array([i + 1], np.int64)} for i in range(3)]
    return b"".join(reply_frame(r) for r in replies) + frame(END)


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=20))
def test_frames_come_back_whole_and_in_order_however_the_body_is_cut(cuts: list[int]) -> None:
    data, decoder, frames = body(), FrameDecoder(), []
    at = 0
    for cut in [*sorted(min(c, len(data)) for c in cuts), len(data)]:
        frames += decoder.feed(data[at:cut])
        at = cut
    assert [k for k, _ in frames] == [REPLY, REPLY, REPLY, END] and decoder.pending == 0
    second = bundle.unpack(frames[1][1], "cluster body")
    assert second["text"][0] == b"word1 " and second["completion_tokens"].tolist() == [2]


def test_an_error_frame_carries_the_errors_class_message_and_retry_after() -> None:
    [(kind, payload)] = FrameDecoder().feed(error_frame(Overloaded("full", 2.5)))
    assert kind == ERROR and json.loads(payload) == {"kind": "Overloaded", "message": "full", "retry_after": 2.5}


def test_a_cut_off_frame_is_pending_not_returned() -> None:
    whole, decoder = FrameDecoder().feed(body()), FrameDecoder()
    got = decoder.feed(body()[:-7])   # into the third reply (END is 5 bytes)
    assert got == whole[:2] and decoder.pending > 0
    assert decoder.feed(body()[-7:]) == whole[2:] and decoder.pending == 0


@pytest.mark.parametrize("data", [b"X\x00\x00\x00\x00", b"R\xff\xff\xff\xff"])
def test_bytes_that_are_not_a_frame_are_invalid_input(data: bytes) -> None:
    with pytest.raises(InvalidInput, match="cluster stream: not a frame"):
        FrameDecoder().feed(data)
