"""Why a model gets no slice, logged when that changes: once, not once per request (a busy node would flood)."""

from __future__ import annotations

import logging

log = logging.getLogger("ember.controller")


class CapacityLog:
    def __init__(self) -> None:
        self._short: dict[str, str] = {}   # model key -> the reason it last got no slice

    def short(self, key: str, reason: str) -> None:
        """`key` got no slice for `reason` (which names the model, its slice kind and memory)."""
        if self._short.get(key) != reason:
            self._short[key] = reason
            log.warning("no capacity: %s (its requests become jobs until a slice frees)", reason)

    def room(self, key: str) -> None:
        """`key` got room (an instance, a free slice or an evicted one)."""
        if self._short.pop(key, None) is not None:
            log.info("model %s has room again", key)
