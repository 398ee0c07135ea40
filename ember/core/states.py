"""Instance states and the rungs of the cold-start ladder."""

from __future__ import annotations

from enum import StrEnum


class Rung(StrEnum):
    """Where a request's instance came from, cheapest first."""

    HOT = "hot"            # an idle running instance
    PAUSED = "paused"      # an idle instance frozen with SIGSTOP: SIGCONT it
    TEMPLATE = "template"  # fork the per-model template holding the loaded model
    ZYGOTE = "zygote"      # fork the per-runtime zygote, load weights, warm up
    FETCH = "fetch"        # weights not on this node: pull them, then zygote
    QUEUED = "queued"      # no capacity: a durable job, answered 202

    @property
    def order(self) -> int:
        return list(Rung).index(self)


class InstanceState(StrEnum):
    STARTING = "starting"  # forked, loading and warming up
    IDLE = "idle"          # ready, no request in flight
    BUSY = "busy"          # ready, at least one request in flight
    PAUSED = "paused"      # SIGSTOPped while idle
    DRAINING = "draining"  # retiring: finishing in-flight work, takes nothing new
    STOPPED = "stopped"    # gone

    @property
    def ready(self) -> bool:
        return self in (InstanceState.IDLE, InstanceState.BUSY)
