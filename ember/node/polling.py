"""Brief busy polling before sleeping, on both ends of a node link.

Why: a core that goes idle halts, and waking it again costs a trip through the hypervisor on a VM
whose kernel does not halt-poll (`haltpoll.guest_halt_poll_ns=0`, as on the dev machine: a Unix-socket
round trip measured 0.21 ms back to back, 0.36 ms after 8 ms asleep). A hot request pays that twice:
the instance sleeps between requests and the gateway sleeps while the instance computes. Polling for a
bounded while instead keeps both awake where a reply or the next request is about to come.

Polling only happens while some core runs none of the node's requests (`PollPolicy`), and yields the core
(`sched_yield`) on every turn, so that it spends cycles nobody wanted; and the gateway polls for a reply only when
that reply is due soon enough for the wake it saves to matter (`WORTH_POLLING_S`). A spinning core still costs the
computing one beside it on these VMs: an LLM's 8 streams through `ember serve`, a reply per ~80 ms engine step,
ran 0.970x of vLLM's own rate with the gateway polling and 0.989x without, and in a second run 0.991x and 0.987x
(medians of 6 rounds; without polling higher in 5 of 6 rounds in each run: docs/llm.md, vLLM figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# The gateway starts polling this long before a reply is due: event-loop timers (libuv's) fire with
# millisecond resolution, and a timer that fires late must not miss the reply.
_LEAD_S = 0.002
_EWMA = 0.2   # weight of the newest duration in the expected one
# A wake from halt costs ~0.15 ms (0.36 vs 0.21 ms a round trip, above): polling saves under 1% of a reply due later
# than this, while spinning up to twice the budget beside a computing core.
WORTH_POLLING_S = 0.015


def poll_readable(sock: socket.socket, budget_s: float) -> bool:
    """Spin until `sock` has data (True) or `budget_s` is spent (False); then the caller blocks as usual."""
    if budget_s <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP)
    end = time.perf_counter() + budget_s
    while not poller.poll(0):
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def usable_cores() -> int:
    """Cores this process may run on: its affinity, capped by a cgroup v2 CPU quota (a container's `cpu.max`)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, int(int(quota) // int(period))))


class PollPolicy:
    """When polling pays, for a whole node: a budget, and only while some core has no instance of the node on it
    computing or polling.

    With every core busy a poller takes cycles a computing instance wants (measured here, polling always: 12-14%
    less throughput with two clients on two instances; with this rule: within the noise), so then both ends
    sleep at once as usual.
    """

    def __init__(self, budget_s: float, cores: int | None = None) -> None:
        self.budget_s = budget_s
        self.cores = cores if cores is not None else usable_cores()
        self.busy = 0   # instances computing a request or polling after one

    def spare_core(self) -> bool:
        return self.budget_s > 0 and self.busy < self.cores


class ReplyPoller:
    """Keeps an asyncio loop polling (instead of sleeping in epoll) around the time a reply is due.

    One per instance link. The due time is a moving average of the link's past durations: polling starts
    `_LEAD_S` before it and stops when the reply arrives, `budget_s` after it, or as soon as no core is spare; a
    reply due later than `WORTH_POLLING_S` (a long inference, an LLM's engine step) is awaited without polling.
    The instance counts as busy in its `PollPolicy` from a request until it has answered every request and
    polled for as long as it was told to (a next request to it ends that poll at once).
    """

    def __init__(self, policy: PollPolicy) -> None:
        self.policy = policy
        self.expected_s = 0.0
        self.spins = 0      # loop turns spent polling, for tests and curiosity
        self._inflight = 0
        self._lingering: asyncio.TimerHandle | None = None   # the instance's poll after its last reply
        self._last_poll_s = 0.0

    @contextlib.contextmanager
    def request(self) -> Iterator[float]:
        """Count one request in flight while it runs; yields how long its instance should poll after answering."""
        poll_s = self.begin()
        try:
            yield poll_s
        finally:
            self.end()

    def begin(self) -> float:
        """One more request in flight; returns how long its instance should poll after answering."""
        if self._lingering is not None:
            self._lingering.cancel()     # this request reaches the instance while it polls: still one busy core
            self._lingering = None
        elif self._inflight == 0:
            self.policy.busy += 1
        self._inflight += 1
        poll_s = self.policy.budget_s if self.policy.spare_core() else 0.0
        self._last_poll_s = poll_s
        return poll_s

    def end(self) -> None:
        """A request was answered; once none is left, the instance polls for as long as it was last told."""
        self._inflight -= 1
        if self._inflight == 0:
            if self._last_poll_s > 0:
                self._lingering = asyncio.get_running_loop().call_later(self._last_poll_s, self._idle)
            else:
                self.policy.busy -= 1

    def _idle(self) -> None:
        self._lingering = None
        self.policy.busy -= 1

    async def wait(self, future: asyncio.Future[T]) -> T:
        """Await `future` (a reply just asked for), polling around its expected time."""
        started = time.perf_counter()
        timer = None
        if self.policy.spare_core() and self.expected_s <= WORTH_POLLING_S:
            loop = asyncio.get_running_loop()
            stop_at = started + self.expected_s + self.policy.budget_s
            timer = loop.call_later(max(0.0, self.expected_s - _LEAD_S), self._spin, loop, future, stop_at)
        try:
            result = await future
        finally:
            if timer is not None:
                timer.cancel()   # it holds the reply (and its tensors) until it fires
        self.observe(time.perf_counter() - started)
        return result

    def observe(self, duration_s: float) -> None:
        """One finished call's duration (seconds): the next reply is expected after about as long."""
        self.expected_s = duration_s if self.expected_s == 0 else (1 - _EWMA) * self.expected_s + _EWMA * duration_s

    def _spin(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], stop_at: float) -> None:
        # A callback that re-queues itself makes the loop's next epoll_wait a non-blocking one.
        if future.done() or time.perf_counter() >= stop_at or not self.policy.spare_core():
            return
        self.spins += 1
        os.sched_yield()
        loop.call_soon(self._spin, loop, future, stop_at)
