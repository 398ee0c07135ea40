"""A `NodeScaler` (ember/cluster/state.py) that records what it was asked, in place of Ray's autoscaler."""

from __future__ import annotations


class FakeScaler:
    def __init__(self, fail: bool = False) -> None:
        self.asks: list[int] = []   # every cluster size asked for, in order (0: a request withdrawn)
        self.fail = fail

    def request_nodes(self, nodes: int) -> None:
        if self.fail:
            raise ConnectionError("the autoscaler is away")
        self.asks.append(nodes)
