"""Sandboxed instances (ember/node/sandbox.py) with real processes: what one model's instance can no longer do.

Each check runs where the instance's hello says that the step is enforced; a step the machine does not permit
must be reported with its reason instead (and the node logs it). On a root VM with cgroups every step holds.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.states import Rung
from ember.errors import WorkerCrashed
from ember.node.local_node import LocalNode
from ember.node.sandbox import UID_BASE, UID_SPAN, model_uid
from ember.wire.contract import ModelContract, Resources, load_contract

from .test_local_node import MODELS, cpu_slice, running_node

STEPS = ("memory:cgroup", "filesystem:read-only", "processes:hidden", "network:none", "user", "seccomp")
NETWORKED = tuple(s for s in STEPS if s != "network:none")


def jail(name: str = "jail", **resources: int) -> ModelContract:
    contract = load_contract(MODELS / "jail.yaml").model_copy(update={"name": name})
    return contract.model_copy(update={"resources": Resources(**resources)}) if resources else contract


async def attempt(node: LocalNode, iid: str, cmd: str) -> tuple[int, int, int]:
    command = np.empty(1, dtype=object)
    command[0] = cmd.encode()
    out = await node.infer(iid, {"cmd": command})
    code, uid, pid = (int(v) for v in out["result"])
    return code, uid, pid


def report(node: LocalNode, iid: str, steps: tuple[str, ...] = STEPS) -> dict[str, Any]:
    found: dict[str, Any] = node.startup(iid)["sandbox"]
    for step in steps:   # every step is either enforced or skipped with its reason
        assert step in found["enforced"] or found["skipped"].get(step), (step, found)
    return found


def test_each_model_gets_its_own_uid_in_the_reserved_range() -> None:
    uids = {model_uid(f"m{i}:1") for i in range(50)}
    assert len(uids) == 50 and all(UID_BASE <= u < UID_BASE + UID_SPAN for u in uids)
    assert model_uid("jail:1") == model_uid("jail:1") != model_uid("jail:2")


def test_one_models_instance_cannot_read_or_trace_another_models_memory() -> None:
    async def main() -> None:
        async with running_node() as node:
            a, b = jail("jail-a"), jail("jail-b")
            await asyncio.gather(node.prepare(a), node.prepare(b))
            ia = await node.start(a, Rung.TEMPLATE, cpu_slice(0))
            ib = await node.start(b, Rung.ZYGOTE, cpu_slice(1))
            ra, rb = report(node, ia.instance_id), report(node, ib.instance_id)
            if "user" not in ra["enforced"]:
                pytest.skip(f"no uid drop here: {ra['skipped']['user']}")
            assert (ra["uid"], rb["uid"]) == (model_uid(a.key), model_uid(b.key))
            code, uid, _ = await attempt(node, ia.instance_id, f"peek:{ib.pid}")
            # PermissionError, or not there at all where its /proc hides other users' processes
            assert uid == model_uid(a.key) and code in (errno.EACCES, errno.EPERM, errno.ENOENT)
            assert (await attempt(node, ib.instance_id, f"peek:{ia.pid}"))[0] in (errno.EACCES, errno.EPERM,
                                                                                  errno.ENOENT)
            assert (await attempt(node, ia.instance_id, f"ptrace:{ib.pid}"))[0] == errno.EPERM
            assert node.memory(ib.instance_id).pss_bytes > 0   # the node still sees every instance

    asyncio.run(main())


def test_files_are_read_only_but_scratch_network_is_gone_and_seccomp_denies(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    async def main() -> None:
        async with running_node() as node:
            contract = jail()
            await node.prepare(contract)
            for rung in (Rung.TEMPLATE, Rung.ZYGOTE):
                iid = (await node.start(contract, rung, cpu_slice(0))).instance_id
                found = report(node, iid)
                enforced = found["enforced"]
                if "filesystem:read-only" in enforced:
                    code = (await attempt(node, iid, f"write:{MODELS}/escaped.txt"))[0]
                    assert code in (errno.EROFS, errno.EACCES) and not (MODELS / "escaped.txt").exists()
                    assert (await attempt(node, iid, "write:/tmp/scratch.txt"))[0] == 0
                    assert not Path("/tmp/scratch.txt").exists()   # its /tmp is its own
                if "network:none" in enforced:
                    assert (await attempt(node, iid, f"connect:{port}"))[0] == errno.ENETUNREACH
                if "seccomp" in enforced:
                    assert (await attempt(node, iid, "status"))[0] == 12   # no_new_privs 1, seccomp mode 2
                    assert (await attempt(node, iid, "unshare"))[0] == errno.EPERM
                    assert (await attempt(node, iid, f"ptrace:{os.getpid()}"))[0] == errno.EPERM
                await node.stop(iid)

    try:
        asyncio.run(main())
    finally:
        listener.close()


def test_a_weights_file_in_a_closed_directory_is_bound_back_alone(tmp_path: Path) -> None:
    """Weights that are one file in a directory other users may not enter (a home directory's cache, say): the view
    binds that file back, and nothing else of its directory, and the template still forks replicas (a file's
    mount point was made a directory: the view failed half-built and hid the template's socket directory)."""
    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)
    home.chmod(0o700)
    weights, other = home / "cache" / "w.bin", home / "cache" / "other.bin"
    weights.write_bytes(b"w" * 4096)
    other.write_bytes(b"not the model's")
    contract = jail("jail-file").model_copy(update={"weights": str(weights)})

    async def main() -> None:
        async with running_node() as node:
            await node.prepare(contract)
            for rung in (Rung.TEMPLATE, Rung.ZYGOTE):
                iid = (await node.start(contract, rung, cpu_slice(0))).instance_id
                found = report(node, iid)
                assert "move_mount" not in found["skipped"].get("filesystem:read-only", ""), found
                if "filesystem:read-only" in found["enforced"]:
                    assert (await attempt(node, iid, f"read:{weights}"))[0] == 0
                    assert (await attempt(node, iid, f"read:{other}"))[0] in (errno.ENOENT, errno.EACCES)
                await node.stop(iid)

    asyncio.run(main())


@pytest.mark.slow
def test_a_node_run_from_the_directory_holding_its_state_serves_and_a_model_sees_only_its_own_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cd DIR && ember serve --state-dir DIR/state`, DIR in a directory closed to others: the zygote had DIR on
    its path, the view bound DIR back whole with the node's 0700 `state/run` in it, and no template replica could
    bind its socket (PermissionError on `state/run/rt2/i3.s`). And every model read every world-readable file:
    the server's working directory, another model's contract directory and the secret beside it, every process's
    command line. Now a model sees its own files and the runtime's, and nothing else."""
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "notes.txt").write_text("the project's")
    other = tmp_path / "b"   # another model's contract directory, with a secret beside its contract
    other.mkdir()
    (other / "jail.yaml").write_text((MODELS / "jail.yaml").read_text().replace("name: jail", "name: jail-b"))
    (other / "jail.py").symlink_to(MODELS / "jail.py")   # its module lives elsewhere: read through the link
    (other / "secret.txt").write_text("b's")
    monkeypatch.chdir(proj)

    async def main() -> None:
        node = LocalNode(proj / "state")
        try:
            a, b = jail("jail-a"), load_contract(other / "jail.yaml")
            await asyncio.gather(node.prepare(a), node.prepare(b))
            ia = (await node.start(a, Rung.TEMPLATE, cpu_slice(0))).instance_id   # failed: PermissionError
            ib = await node.start(b, Rung.ZYGOTE, cpu_slice(1))
            found = report(node, ia)
            if "filesystem:read-only" not in found["enforced"]:
                pytest.skip(f"no view of its own here: {found['skipped']['filesystem:read-only']}")
            gone = (errno.ENOENT,)
            assert (await attempt(node, ia, f"read:{proj / 'notes.txt'}"))[0] in gone     # the server's cwd
            assert (await attempt(node, ia, f"read:{other / 'secret.txt'}"))[0] in gone   # another model's
            assert (await attempt(node, ib.instance_id, f"read:{other / 'secret.txt'}"))[0] == 0   # its own
            assert (await attempt(node, ib.instance_id, f"read:{MODELS / 'jail.yaml'}"))[0] in gone
            assert (await attempt(node, ia, f"read:{MODELS / 'jail.yaml'}"))[0] == 0
            assert (await attempt(node, ia, f"read:{os.__file__}"))[0] == 0              # the runtime's
            assert (await attempt(node, ia, "read:/proc/self/cmdline"))[0] == 0
            if "processes:hidden" in found["enforced"]:
                for pid in (os.getpid(), ib.pid):   # the node's command line, another model's
                    assert (await attempt(node, ia, f"read:/proc/{pid}/cmdline"))[0] in gone
        finally:
            await node.close()

    asyncio.run(main())


def test_the_contract_may_keep_the_network() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    async def main() -> None:
        async with running_node() as node:
            base = jail("jail-net")
            contract = base.model_copy(update={"sandbox": base.sandbox.model_copy(update={"network": True})})
            await node.prepare(contract)
            iid = (await node.start(contract, Rung.TEMPLATE, cpu_slice(0))).instance_id
            found = report(node, iid, NETWORKED)
            assert "network:none" not in found["enforced"] and "network:none" not in found["skipped"]
            assert (await attempt(node, iid, f"connect:{listener.getsockname()[1]}"))[0] == 0

    try:
        asyncio.run(main())
    finally:
        listener.close()


def test_a_model_over_its_memory_dies_alone_and_the_node_serves_the_next_request() -> None:
    async def main() -> None:
        async with running_node() as node:
            contract = jail("jail-hog", memory_mb=96)
            await node.prepare(contract)
            iid = (await node.start(contract, Rung.TEMPLATE, cpu_slice(0))).instance_id
            found = report(node, iid)
            assert (await attempt(node, iid, "alloc:16"))[0] == 0   # within its contract: fine
            if "memory:cgroup" in found["enforced"]:
                with pytest.raises(WorkerCrashed):
                    await attempt(node, iid, "alloc:400")
                await asyncio.sleep(0.1)
                assert node.exit_status(iid) == -9   # the kernel's OOM killer
            else:   # the address-space limit: the allocation fails, the instance lives
                assert "memory:rlimit_as" in found["enforced"], found
                assert (await attempt(node, iid, "alloc:400"))[0] == errno.ENOMEM
            again = (await node.start(contract, Rung.TEMPLATE, cpu_slice(0))).instance_id
            assert (await attempt(node, again, "alloc:16"))[0] == 0

    asyncio.run(main())


def test_sandbox_off_runs_instances_as_the_node_and_sockets_are_the_nodes_alone() -> None:
    """The control: without the sandbox one model's instance reads another's memory (the attack the tests above
    see fail)."""
    async def main() -> None:
        async with running_node(sandbox=False) as node:
            a, b = jail("jail-a"), jail("jail-b")
            await asyncio.gather(node.prepare(a), node.prepare(b))
            iid = (await node.start(a, Rung.TEMPLATE, cpu_slice(0))).instance_id
            other = await node.start(b, Rung.ZYGOTE, cpu_slice(1))
            assert "sandbox" not in node.startup(iid)
            code, uid, _ = await attempt(node, iid, f"peek:{other.pid}")
            assert uid == os.getuid() and (code == 0 or os.getuid() != 0)
            assert stat.S_IMODE(node.run_dir.stat().st_mode) == 0o700
            socks = list(node.run_dir.glob("*.s"))
            assert socks and all(stat.S_IMODE(s.stat().st_mode) == 0o600 for s in socks)

    asyncio.run(main())


def test_load_runs_in_the_sandbox_with_a_pids_limit_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """The model's own `load()` (a template's and a zygote child's) runs after the lock-down: it reads nothing of
    the node's, writes nothing, dials nothing, forks no more than its pids limit, and a daemon it leaves behind is
    killed with the process that made it."""
    secret = tmp_path / "node-secret"
    secret.write_text("the node's")
    secret.chmod(0o600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    cmds = [f"read:{secret}", "read:/etc/shadow", f"peek:{os.getpid()}", f"write:{MODELS}/escaped-at-load.txt",
            f"connect:{listener.getsockname()[1]}", "fork:40", "daemon"]
    base = jail("jail-load")
    contract = base.model_copy(update={"options": {"load": cmds},
                                       "sandbox": base.sandbox.model_copy(update={"pids": 24})})

    async def main() -> None:
        async with running_node() as node:
            await node.prepare(contract)
            template_daemon = 0
            for rung in (Rung.TEMPLATE, Rung.ZYGOTE):
                iid = (await node.start(contract, rung, cpu_slice(0))).instance_id
                found = report(node, iid, (*STEPS, "pids:cgroup"))
                assert found["load_sandboxed"], found
                if "user" not in found["enforced"]:
                    pytest.skip(f"no uid drop here: {found['skipped']['user']}")
                at_load = [await attempt(node, iid, f"loaded:{i}") for i in range(len(cmds))]
                assert {r[1] for r in at_load} == {model_uid(contract.key)}   # load() ran as the model's user
                assert at_load[0][0] in (errno.EACCES, errno.ENOENT), at_load   # the node's file: out of view
                assert at_load[1][0] in (errno.EACCES, errno.ENOENT)           # root's, in view: not its user's
                assert at_load[2][0] in (errno.EACCES, errno.EPERM, errno.ENOENT)   # the node's memory
                assert at_load[3][0] in (errno.EROFS, errno.EACCES) and not (MODELS / "escaped-at-load.txt").exists()
                assert at_load[4][0] == errno.ENETUNREACH
                if "pids:cgroup" in found["enforced"]:
                    assert at_load[5][0] == errno.EAGAIN                      # 40 forks against a limit of 24
                daemon = at_load[6][2]
                assert daemon > 0 and _alive(daemon)
                await node.stop(iid)
                if rung is Rung.TEMPLATE:
                    template_daemon = daemon   # the template's: lives as long as the template
                    assert _alive(daemon)
                    await node.release(contract.key)
                elif "pids:cgroup" in found["enforced"] or "memory:cgroup" in found["enforced"]:
                    await _gone_soon(daemon)
            if "memory:cgroup" in found["enforced"]:
                await _gone_soon(template_daemon)

    try:
        asyncio.run(main())
    finally:
        listener.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


async def _gone_soon(pid: int) -> None:
    for _ in range(100):
        if not _alive(pid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"pid {pid} outlived the process that left it")
