"""Instance states and the rungs of the cold-start ladder."""

from __future__ import annotations

from enum import StrEnum


class Rung(StrEnum):
    """Where a request's instance came from, cheapest first."""

    HOT = "hot"            # an idle running instance
    PAUSED = "paused"      # an idle instance frozen with SIGSTOP: SIGCONT it
    SLEEP_1 = "sleep-1"    # an instance whose engine sleeps at level 1 (weights in host memory): wake it
    SLEEP_2 = "sleep-2"    # an instance whose engine sleeps at level 2 (weights discarded): wake, reload them
    TEMPLATE = "template"  # fork the per-model template holding the loaded model
    ZYGOTE = "zygote"      # fork the per-runtime zygote, load weights, warm up
    RESTORE = "restore"    # restore the model's process image (CRIU) from the node's disk: loaded and warm
    FETCH = "fetch"        # weights not on this node: pull them, then zygote
    QUEUED = "queued"      # no capacity: a durable job, answered 202

    @property
    def order(self) -> int:
        return list(Rung).index(self)

    @staticmethod
    def asleep(level: int) -> Rung:
        """The rung of an instance asleep at `level` (1 or 2)."""
        return Rung.SLEEP_1 if level <= 1 else Rung.SLEEP_2


class InstanceState(StrEnum):
    STARTING = "starting"  # forked, loading and warming up
    IDLE = "idle"          # ready, no request in flight
    BUSY = "busy"          # ready, at least one request in flight
    PAUSED = "paused"      # SIGSTOPped while idle
    ASLEEP = "asleep"      # its engine asleep (device memory given back), then SIGSTOPped: its slice may host another
    DRAINING = "draining"  # retiring: finishing in-flight work, takes nothing new
    STOPPED = "stopped"    # gone

    @property
    def ready(self) -> bool:
        return self in (InstanceState.IDLE, InstanceState.BUSY)

    @property
    def resting(self) -> bool:
        """Idle, whether running, paused or asleep: its idle clock runs, and it may be recycled."""
        return self in (InstanceState.IDLE, InstanceState.PAUSED, InstanceState.ASLEEP)

    @property
    def awake(self) -> bool:
        """Holds its slice whole: every live state but asleep."""
        return self not in (InstanceState.ASLEEP, InstanceState.STOPPED)
