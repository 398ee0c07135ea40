"""Busy polling before sleeping: the blocking side on real sockets, the asyncio side on a real loop."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from ember.node.instance import poll_after
from ember.node.polling import WORTH_POLLING_S, PollPolicy, ReplyPoller, poll_readable, usable_cores


def test_poll_readable_sees_waiting_data_and_leaves_it_for_the_reader() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"next request")
        assert poll_readable(a, 1.0)
        assert a.recv(64) == b"next request"


def test_poll_readable_gives_up_after_its_budget_or_at_once_without_one() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert not poll_readable(a, 0.002)
        assert not poll_readable(a, 0.0)
        b.close()
        assert poll_readable(a, 1.0)   # a closed peer wakes the poller too: the reader then sees EOF


def test_reply_poller_polls_until_the_reply_then_stops_and_learns_its_duration() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        poller = ReplyPoller(PollPolicy(budget_s=0.5, cores=2))
        future: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.02, future.set_result, "reply")
        with poller.request() as instance_poll_s:
            assert instance_poll_s == 0.5
            assert await poller.wait(future) == "reply"
        spins = poller.spins
        assert spins > 0                       # nothing expected yet: it polled from the start
        assert poller.expected_s > 0.01           # about the 20 ms the reply took
        await asyncio.sleep(0.02)
        assert poller.spins == spins           # and stopped with the reply

    asyncio.run(main())


def test_reply_poller_with_no_budget_never_polls_and_a_cancelled_wait_stops_polling() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        idle = ReplyPoller(PollPolicy(budget_s=0))
        future: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, future.set_result, 7)
        with idle.request() as instance_poll_s:
            assert await idle.wait(future) == 7 and idle.spins == 0 and instance_poll_s == 0

        poller = ReplyPoller(PollPolicy(budget_s=5.0))
        waiting = asyncio.ensure_future(poller.wait(loop.create_future()))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        spins = poller.spins
        await asyncio.sleep(0.02)
        assert poller.spins == spins

    asyncio.run(main())


def test_with_every_core_busy_neither_end_polls() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        policy = PollPolicy(budget_s=5.0, cores=2)
        first, second = ReplyPoller(policy), ReplyPoller(policy)
        a: asyncio.Future[str] = loop.create_future()
        b: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.02, a.set_result, "a")
        loop.call_later(0.02, b.set_result, "b")
        with first.request() as poll_a, second.request() as poll_b:
            assert (poll_a, poll_b) == (5.0, 0.0)   # the second instance took the last spare core
            assert await asyncio.gather(first.wait(a), second.wait(b)) == ["a", "b"]
        assert first.spins == second.spins == 0
        assert policy.busy == 1                    # the first instance polls on after its reply
        with second.request() as poll_b:
            assert poll_b == 0.0                   # so no core is spare for the second one yet
        with first.request() as poll_a:            # the first's next request ends its poll: one busy core
            assert poll_a == 5.0 and policy.busy == 1

    asyncio.run(main())


def test_an_instance_counts_as_busy_until_its_poll_after_the_reply_ends() -> None:
    async def main() -> None:
        policy = PollPolicy(budget_s=0.01, cores=1)
        poller = ReplyPoller(policy)
        with poller.request() as poll_s:
            assert poll_s == 0.0                   # one core, taken by this very request
        assert policy.busy == 0                    # told not to poll: free at once
        policy.cores = 2
        with poller.request() as poll_s:
            assert poll_s == 0.01
        assert policy.busy == 1
        await asyncio.sleep(0.05)
        assert policy.busy == 0

    asyncio.run(main())


def test_usable_cores_is_within_this_process_affinity() -> None:
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", [-0.1, 2, "fast", True, None])
def test_an_instance_ignores_a_bad_poll_setting(value: object) -> None:
    assert poll_after({"op": "infer", "poll_s": value}) == 0.0
    assert poll_after({"op": "infer"}) == 0.0 and poll_after({"op": "infer", "poll_s": 0.002}) == 0.002


def test_a_reply_due_later_than_polling_is_worth_is_awaited_without_polling() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        poller = ReplyPoller(PollPolicy(budget_s=0.5, cores=2))
        poller.observe(WORTH_POLLING_S * 4)     # its replies take long (an engine step)
        future: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.01, future.set_result, "reply")
        assert await poller.wait(future) == "reply" and poller.spins == 0
        for _ in range(30):                     # then fast ones: it polls again once they are expected
            poller.observe(0.001)
        future = loop.create_future()
        loop.call_later(0.01, future.set_result, "reply")
        assert await poller.wait(future) == "reply" and poller.spins > 0

    asyncio.run(main())
