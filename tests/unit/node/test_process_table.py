"""The node's process table: a restored template's replicas, named by their pid in its pid namespace."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from ember.errors import ModelNotReady
from ember.node.cgroups import ProcessCgroup
from ember.node.framing import Frame
from ember.node.polling import PollPolicy
from ember.node.process_table import ProcessTable
from ember.node.sandboxes import Sandboxes


class ForkedLink:
    """A restored template's link: it answers each fork with a pid in its own pid namespace."""

    def __init__(self, ns_pid: int) -> None:
        self.ns_pid = ns_pid

    async def call(self, header: dict[str, Any]) -> Frame:
        return Frame({"op": "forked", "pid": self.ns_pid})


def test_a_replica_not_found_in_its_templates_namespace_is_refused_and_never_given_pid_0(tmp_path: Path) -> None:
    """Gone before the node looked (reaped by its template): pid 0 written to cgroup.procs would move the node."""
    async def main() -> None:
        table = ProcessTable(tmp_path / "run", Sandboxes(), PollPolicy(0.0), None, 5.0)
        template = table.new("template:m:1", "template", "t.s", None, own_pidns=True, pid=os.getpid())
        template.link = ForkedLink(ns_pid=2**22 + 7)   # type: ignore[assignment]
        replica = table.new("m-1", "instance", "i1.s", template)
        (tmp_path / "memory").mkdir()
        replica.cgroup = ProcessCgroup(tmp_path / "memory", None)
        with pytest.raises(ModelNotReady, match="exited while starting"):
            await table.fork_and_greet(replica, "replica", {})
        assert not (tmp_path / "memory" / "cgroup.procs").exists()
        assert replica.exited.done() and "m-1" not in table.procs

    asyncio.run(main())
