"""The sandbox's pure parts: the seccomp program (run on a small BPF interpreter), the new root's layout,
the cgroup path, the plan's wire form and the modes of the node's state files."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

from ember.errors import InvalidInput
from ember.jobs.store import JobStore
from ember.node import seccomp
from ember.node.cgroups import Cgroups, ProcessCgroup, own_memory_cgroup
from ember.node.forkserver import listen_unix
from ember.node.sandbox import SandboxPlan, in_cgroup, plan_for, python_paths
from ember.node.sandboxes import Sandboxes
from ember.node.view import layout, linked_from
from ember.wire.contract import ModelContract

_CONTRACT = {"name": "m", "runtime": "python", "entrypoint": "m:M",
             "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
             "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}


def run_bpf(prog: list[seccomp.Insn], arch: int, nr: int, arg0: int = 0) -> int:
    """Classic BPF, as much of it as the filter uses, over one struct seccomp_data."""
    words = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            acc = words[k]
        elif code == 0x06:
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("name", sorted(seccomp.ARCHES))
def test_the_filter_denies_what_models_never_need_and_allows_the_rest(name: str) -> None:
    arch = seccomp.ARCHES[name]
    prog = seccomp.build_filter(arch)
    nums = arch.numbers
    eperm = seccomp.RET_ERRNO | errno.EPERM
    for denied in seccomp.DENIED:
        assert run_bpf(prog, arch.audit, nums[denied]) == eperm, denied
    assert run_bpf(prog, arch.audit, 0) == seccomp.RET_ALLOW          # read (aarch64: io_setup) and friends
    assert run_bpf(prog, arch.audit, 63) == seccomp.RET_ALLOW
    assert run_bpf(prog, arch.audit, nums["clone"], 0x3D0F00) == seccomp.RET_ALLOW   # a thread
    assert run_bpf(prog, arch.audit, nums["clone"], seccomp.CLONE_NEWUSER | 0x11) == eperm
    assert run_bpf(prog, arch.audit, nums["clone3"]) == seccomp.RET_ERRNO | errno.ENOSYS
    assert run_bpf(prog, 0x40000003, 0) == seccomp.RET_KILL_PROCESS   # i386 numbers: not ours to judge
    if arch.x32:
        assert run_bpf(prog, arch.audit, 0x40000000 + 1) == eperm


def test_the_program_fits_the_kernels_limits_and_is_assembled_once() -> None:
    arch = seccomp.ARCHES["x86_64"]
    assert len(seccomp.build_filter(arch)) < 4096
    assert seccomp.program(arch) is seccomp.program(arch) and len(seccomp.program(arch)) % 8 == 0


def test_the_view_binds_the_top_most_paths_and_makes_the_links_on_the_way(tmp_path: Path) -> None:
    """Each path at its real place, nested ones inside their top-most; a symbolic link on the way (merged /usr's
    /lib, a home behind a link) made in the new root too, unless a bound tree holds it already."""
    real = tmp_path / "real"
    (real / "python" / "lib").mkdir(parents=True)
    (real / "models" / "m").mkdir(parents=True)
    (tmp_path / "alias").symlink_to("real")
    plan = layout([str(tmp_path / "alias" / "python"), str(real / "python" / "lib"), str(real / "models" / "m"),
                   "/", "/tmp"])
    assert plan.binds == [str(real / "models" / "m"), str(real / "python")]   # "/" and "/tmp" never bound
    assert plan.links == {str(tmp_path / "alias"): "real"}
    assert plan.covers == plan.rebinds == plan.writable == []


def test_the_nodes_state_inside_a_bound_directory_is_covered_and_the_sockets_directory_bound_again(
        tmp_path: Path) -> None:
    """A contract directory holding the server's state directory: the state is covered by an empty tmpfs, and the
    template's socket directory (writable) and weights below it are bound again on the cover."""
    proj = tmp_path / "proj"
    (proj / "state" / "run" / "rt2").mkdir(parents=True)
    (proj / "state" / "store").mkdir()
    plan = layout([str(proj), str(proj / "state" / "store")], writable=[str(proj / "state" / "run" / "rt2")],
                  hidden=[str(proj / "state")])
    assert plan.binds == [str(proj)]
    assert plan.covers == [str(proj / "state")]
    assert plan.rebinds == [str(proj / "state" / "store")]
    assert plan.writable == [str(proj / "state" / "run" / "rt2")]
    assert layout([str(proj / "m")], hidden=[str(proj / "state")]).covers == []   # not in view: nothing to cover


def test_other_models_directories_are_covered_when_a_path_entry_holds_them(tmp_path: Path) -> None:
    """`PYTHONPATH=$HOME` with every model's contract below it: the entry is read, but the other models'
    directories (and their secrets) are covered by an empty tmpfs; the model's own directory stays in view."""
    home = tmp_path / "home"
    for name in ("a", "b", "c"):
        (home / "models" / name).mkdir(parents=True)
    contracts = {n: ModelContract.model_validate({**_CONTRACT, "name": n,
                                                  "source": str(home / "models" / n / "contract.yaml")})
                 for n in ("a", "b", "c")}
    sandboxes = Sandboxes(hidden=(str(tmp_path / "state"),))
    sandboxes.deployed(contracts["b"])
    sandboxes.deployed(contracts["c"])
    plan = plan_for(contracts["a"], None, sandboxes.hidden_from(contracts["a"]))
    view = layout(plan.readable, hidden=plan.hidden, stable=[str(home)])
    assert view.binds == [str(home)]
    assert view.covers == [str(home / "models" / "b"), str(home / "models" / "c")]
    sandboxes.released(contracts["c"].key)
    assert str(home / "models" / "c") not in sandboxes.hidden_from(contracts["a"])
    assert str(home / "models" / "a") in sandboxes.hidden_from(contracts["b"])


def test_links_out_of_a_contract_directory_are_followed_and_others_are_not(tmp_path: Path) -> None:
    """A contract's module linked from elsewhere, a Hugging Face snapshot's blobs: their targets are read too."""
    own, elsewhere = tmp_path / "own", tmp_path / "elsewhere"
    (own / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "model.py").write_text("")
    (own / "model.py").symlink_to(elsewhere / "model.py")
    (own / "sub" / "inside").symlink_to(own / "sub")
    (own / "dangling").symlink_to(tmp_path / "gone")
    assert linked_from([str(own)]) == [str(own / "model.py")]
    plan = layout([str(own), *linked_from([str(own)])])
    assert plan.binds == [str(elsewhere / "model.py"), str(own)]


def test_python_is_read_but_not_the_working_directory_nor_the_source_tree_around_embers_package() -> None:
    prefixes = ("/venv", "/usr")
    entries = ["", "/proj", "/usr/lib/python3.11", "/venv/lib/site-packages", "/src", "/opt/extra"]
    paths = python_paths(entries, prefixes, "/src/ember", "/proj", "/usr/local/cuda/lib64:relative")
    assert "/proj" not in paths and "/src" not in paths and "/" not in paths
    assert {"/venv", "/usr", "/usr/lib/python3.11", "/venv/lib/site-packages", "/opt/extra", "/src/ember",
            "/usr/local/cuda/lib64"} == set(paths)
    # ember installed into site-packages: that directory is Python's, read whole
    assert "/venv/lib/site-packages" in python_paths(["/venv/lib/site-packages"], prefixes,
                                                     "/venv/lib/site-packages/ember", "/proj")
    # a directory holding the working directory (`PYTHONPATH=$HOME`) is not read either
    assert python_paths(["/home/u", "/home/u/lib"], prefixes, "/src/ember", "/home/u/server")[2:] == ["/home/u/lib",
                                                                                                   "/src/ember"]


def test_the_cgroup_of_this_process_is_found_in_v1_and_v2(tmp_path: Path) -> None:
    v1 = "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n"
    assert own_memory_cgroup(v1, tmp_path) == (tmp_path / "memory" / "process_api" / "abc", 1)
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert own_memory_cgroup("0::/user.slice/ember\n", tmp_path) == (tmp_path / "user.slice" / "ember", 2)
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    assert own_memory_cgroup("0::/x\n", tmp_path) is None


def test_the_plan_travels_as_json_and_a_bad_one_is_refused() -> None:
    plan = SandboxPlan(uid=200_123, memory_mb=64, network=True, cgroup="/sys/fs/cgroup/memory/x", readable=("/m",),
                       writable=("/run/r1",), hidden=("/state",))
    assert SandboxPlan.from_json(plan.to_json()) == plan
    assert plan.reading(("/store/all",)).readable == ("/m", "/store/all")
    assert plan.reading(("/store/all",)).writable == ("/run/r1",)
    assert plan.reading(("/store/all",)).hidden == ("/state",)
    assert SandboxPlan.from_json(None) is None
    with pytest.raises(InvalidInput, match="sandbox"):
        SandboxPlan.from_json({"uid": 1, "bogus": 2})
    with pytest.raises(InvalidInput, match="sandbox"):
        SandboxPlan.from_json([1])


def test_a_contract_is_sandboxed_without_network_unless_it_says_so() -> None:
    base = _CONTRACT
    contract = ModelContract.model_validate(base)
    assert contract.sandbox.enabled and not contract.sandbox.network
    assert ModelContract.model_validate({**base, "sandbox": {"network": True}}).sandbox.network
    with pytest.raises(ValueError, match="sandbox"):
        ModelContract.model_validate({**base, "sandbox": {"netwrk": True}})


def test_the_job_database_and_the_sockets_are_the_servers_alone(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    path.write_bytes(b"")
    path.chmod(0o644)   # an older server's file is closed too
    with JobStore(path, max_queued=10, result_ttl_s=60):
        for name in ("jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"):
            if (tmp_path / name).exists():
                assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    sock = listen_unix(tmp_path / "s")
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o600
    finally:
        sock.close()


def test_a_dead_nodes_cgroups_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    from ember.node.cgroups import _sweep_stale

    (tmp_path / "ember-999999999" / "model-1").mkdir(parents=True)
    (tmp_path / f"ember-{os.getpid()}" / "model-2").mkdir(parents=True)
    _sweep_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ember-{os.getpid()}"]


def test_a_process_is_in_its_cgroup_once_proc_says_so_in_v1_and_v2() -> None:
    mine = "/sys/fs/cgroup/memory/process_api/abc/ember-7/template:m:1"
    assert not in_cgroup(mine, "8:pids:/\n4:memory:/process_api/abc\n0::/\n")
    assert in_cgroup(mine, "8:pids:/\n4:memory:/process_api/abc/ember-7/template:m:1\n0::/\n")
    assert in_cgroup("/sys/fs/cgroup/ember/ember-7/m-3", "0::/ember/ember-7/m-3\n")
    assert not in_cgroup("/sys/fs/cgroup/ember/ember-7/m-3", "0::/\n")


def test_a_processs_cgroups_get_both_limits_and_what_it_left_is_killed(tmp_path: Path) -> None:
    """On a v1-shaped tree of plain directories: the memory and pids limits are written, and `kill_left` kills
    every pid the cgroup lists (a real process of this test's)."""
    memory, pids = tmp_path / "memory" / "ember-1", tmp_path / "pids" / "ember-1"
    memory.mkdir(parents=True)
    pids.mkdir(parents=True)
    group = Cgroups(memory, 1, pids).create("m-1", 96, 24)
    assert (group.memory / "memory.limit_in_bytes").read_text() == str(96 << 20)
    assert group.pids is not None and (group.pids / "pids.max").read_text() == "24"
    left = subprocess.Popen(["sleep", "60"])
    (group.pids / "cgroup.procs").write_text(f"{left.pid}\n")
    killed: set[int] = set()
    try:
        killed = Cgroups.kill_left(ProcessCgroup(group.memory, group.pids))
    finally:
        assert left.wait(timeout=5) == -9
    assert killed == {left.pid}
    assert Cgroups(memory, 1, None).create("m-2", 96, 24).pids is None   # no pids controller: that part is left out
