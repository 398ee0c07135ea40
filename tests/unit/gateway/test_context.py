"""off_loop: large bodies' work on worker threads, the largest one at a time."""

from __future__ import annotations

import asyncio
import threading

import anyio.to_thread

from ember.gateway.context import ONE_AT_A_TIME_BYTES, off_loop


def test_large_bodies_run_one_at_a_time_and_those_waiting_hold_no_worker_thread() -> None:
    """The gateway's thread pool serves every other off-loop call: a large body waiting its turn must not take a
    thread from it."""
    gate, running, most = threading.Event(), [0], [0]

    def work(wait: bool) -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        if wait:
            gate.wait()
        running[0] -= 1
        return 1

    async def main() -> int:
        limiter = anyio.to_thread.current_default_thread_limiter()
        first = asyncio.ensure_future(off_loop(ONE_AT_A_TIME_BYTES, work, True))
        while limiter.borrowed_tokens == 0:
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(off_loop(ONE_AT_A_TIME_BYTES, work, False)) for _ in range(3)]
        await asyncio.sleep(0.05)
        held = limiter.borrowed_tokens
        gate.set()
        done = await asyncio.gather(first, *rest)
        assert held == 1, f"{held} worker threads held while one large body ran"
        return sum(done)

    assert asyncio.run(main()) == 4
    assert most[0] == 1


def test_each_event_loop_has_its_own_turn() -> None:
    """A process may run several loops (one after another, or a test client's beside the server's)."""
    async def two_at_once() -> list[int]:
        return list(await asyncio.gather(*(off_loop(ONE_AT_A_TIME_BYTES, len, b"ab") for _ in range(2))))

    for _ in range(2):
        assert asyncio.run(two_at_once()) == [2, 2]
