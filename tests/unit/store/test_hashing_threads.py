"""`hashing.one_thread` blocks that overlap across threads (a node keeping two instances' snapshots at once):
digests stay one-threaded until the last block ends, and are threaded again after it."""

from __future__ import annotations

import threading

import blake3

from ember.store import hashing


def test_overlapping_blocks_keep_digests_one_threaded_until_the_last_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def first() -> None:
        with hashing.one_thread():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(5)
    with hashing.one_thread():   # enters while the first is open, leaves after it
        second_in.set()
        first_out.wait(5)
        seen.append(hashing._auto())
    thread.join(5)
    seen.append(hashing._auto())
    assert seen == [1, blake3.blake3.AUTO]
