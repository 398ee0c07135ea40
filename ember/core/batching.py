"""Dynamic batching decisions: which queued requests an instance runs together, and when.

Triton's dynamic batcher, as a pure function of the queue and `now`: requests of one group (same
trailing tensor shapes) are coalesced in arrival order up to `max_batch_size` rows. A batch runs at
once when it reaches a preferred size (or is full); otherwise it waits for more rows at most
`max_queue_delay_s` after its oldest request arrived.

Without preferred sizes the target is learned: `DemandEstimate` tracks how many rows an instance holds
over a batch cycle (those it ran plus those that queued meanwhile). With one client that is one row, so
a lone request never waits; with eight closed-loop clients it is eight, so the instance waits (briefly)
for all eight instead of running a batch of one and a batch of seven.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int              # rows per forward pass; 1 runs requests one by one
    max_queue_delay_s: float = 0.002
    preferred: tuple[int, ...] = ()  # empty: learn the target from demand

    @property
    def batches(self) -> bool:
        return self.max_batch_size > 1


@dataclass(frozen=True)
class Waiting:
    """A queued request as the batcher sees it."""

    id: int
    rows: int
    arrived: float
    group: Hashable = None           # only requests of one group can be concatenated


@dataclass(frozen=True)
class Take:
    ids: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class Hold:
    until: float                     # decide again then, or as soon as another request arrives


def next_batch(queue: Sequence[Waiting], now: float, policy: BatchPolicy, target_rows: int = 1) -> Take | Hold | None:
    """The batch to run now, how long to wait for a better one, or None when nothing is queued."""
    if not queue:
        return None
    head = queue[0]
    ids, rows, full = [head.id], head.rows, False
    for waiting in queue[1:]:
        if waiting.group != head.group or not policy.batches:
            continue
        if rows + waiting.rows > policy.max_batch_size:
            full = True
            break
        ids.append(waiting.id)
        rows += waiting.rows
    take = Take(tuple(ids), rows)
    if not policy.batches or full or rows >= policy.max_batch_size or _reached(rows, policy, target_rows):
        return take
    deadline = head.arrived + policy.max_queue_delay_s
    return take if now >= deadline else Hold(deadline)


def _reached(rows: int, policy: BatchPolicy, target_rows: int) -> bool:
    if policy.preferred:
        return rows in policy.preferred or rows >= max(policy.preferred)
    return rows >= min(target_rows, policy.max_batch_size)


class DemandEstimate:
    """A moving average of the rows an instance held per batch cycle: the learned batch target."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.rows = 1.0

    def observe(self, ran: int, queued_after: int) -> None:
        sample = float(ran + queued_after)
        self.rows = (1 - self.weight) * self.rows + self.weight * sample

    def target(self, max_batch_size: int) -> int:
        # Rounded up past .2: a leftover of one short batch drags the average just below the real demand,
        # and waiting for one row fewer than usually comes splits every later cycle into two batches.
        return max(1, min(max_batch_size, math.ceil(self.rows - 0.2)))
