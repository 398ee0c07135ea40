"""A contract's share of the cores (`resources.cpu_weight`, `cpu_max`) on real processes: its instance sits in a cpu
cgroup of its own with that weight and quota, and the cgroup is gone with the node; an instance at the default
share has none. Where the machine has no cpu cgroup controller, the instance still serves (the step is skipped)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ember.core.states import Rung
from ember.node.cgroups import own_cgroup

from .test_local_node import cpu_slice, running_node
from .test_sandbox import jail


def cpu_cgroup(pid: int) -> Path | None:
    found = own_cgroup(Path(f"/proc/{pid}/cgroup").read_text(), "cpu")
    return found[0] if found is not None else None


def test_the_weight_and_cap_land_in_the_instances_cpu_cgroup_and_leave_with_the_node() -> None:
    async def main() -> Path | None:
        async with running_node() as node:
            base = jail("jail-cpu")
            shared = base.model_copy(update={"resources": base.resources.model_copy(
                update={"cpu_weight": 300, "cpu_max": 0.5})})
            await node.prepare(shared)
            started = await node.start(shared, Rung.TEMPLATE, cpu_slice(0))
            found = node.startup(started.instance_id)["sandbox"]
            plain = jail("jail-plain")
            await node.prepare(plain)
            other = await node.start(plain, Rung.TEMPLATE, cpu_slice(0))
            if "cpu:cgroup" not in found["enforced"]:
                return None   # no cpu controller here (or no cgroups at all): nothing more to see
            group = cpu_cgroup(node.pids()[started.instance_id])
            assert group is not None and group.name == started.instance_id.replace("/", "_")
            if (group / "cpu.weight").exists():
                assert (group / "cpu.weight").read_text().strip() == "300"
                assert (group / "cpu.max").read_text().split() == ["50000", "100000"]
            else:
                assert (group / "cpu.shares").read_text().strip() == str(300 * 1024 // 100)
                assert (group / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert "cpu:cgroup" not in node.startup(other.instance_id)["sandbox"]["enforced"]
            assert cpu_cgroup(node.pids()[other.instance_id]) != group
            return group

    group = asyncio.run(main())
    assert group is None or not group.exists()
