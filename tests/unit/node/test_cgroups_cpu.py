"""A contract's share of the cores (`resources.cpu_weight`, `cpu_max`) written into the process's cpu cgroup, v1 and
v2, on trees of plain directories; the default share makes no cpu cgroup."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ember.errors import ContractInvalid
from ember.node.cgroups import Cgroups, CpuShare
from ember.node.sandboxes import cpu_share
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract


def bases(tmp_path: Path) -> tuple[Path, Path]:
    memory, cpu = tmp_path / "memory" / "ember-1", tmp_path / "cpu" / "ember-1"
    memory.mkdir(parents=True)
    cpu.mkdir(parents=True)
    return memory, cpu


def test_v1_writes_shares_and_a_quota(tmp_path: Path) -> None:
    memory, cpu = bases(tmp_path)
    group = Cgroups(memory, 1, None, cpu).create("m-1", 96, 24, CpuShare(weight=300, max_cores=1.5))
    assert group.cpu == cpu / "m-1"
    assert (group.cpu / "cpu.shares").read_text() == str(300 * 1024 // 100)
    assert (group.cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (group.cpu / "cpu.cfs_quota_us").read_text() == "150000"


def test_v2_writes_weight_and_max_in_the_one_directory(tmp_path: Path) -> None:
    base = tmp_path / "ember-1"
    base.mkdir()
    group = Cgroups(base, 2, None, base).create("m-1", 96, 24, CpuShare(weight=50, max_cores=0.5))
    assert group.cpu == group.memory == base / "m-1"
    assert (group.cpu / "cpu.weight").read_text() == "50"
    assert (group.cpu / "cpu.max").read_text() == "50000 100000"


def test_the_default_share_or_no_cpu_controller_makes_no_cpu_cgroup(tmp_path: Path) -> None:
    memory, cpu = bases(tmp_path)
    assert Cgroups(memory, 1, None, cpu).create("m-1", 96, 24).cpu is None
    assert not (cpu / "m-1").exists()
    assert Cgroups(memory, 1, None, None).create("m-2", 96, 24, CpuShare(weight=200)).cpu is None


def test_the_contract_names_its_share_and_a_bad_one_is_refused_naming_the_key() -> None:
    path = example_contracts_dir() / "iris.yaml"
    assert cpu_share(load_contract(path)).default
    data = yaml.safe_load(path.read_text())
    data["resources"].update(cpu_weight=400, cpu_max=2)
    assert cpu_share(parse_contract(data, str(path))) == CpuShare(400, 2.0)
    for key, bad in (("cpu_weight", 0), ("cpu_max", 0), ("dedicated_cores", "maybe")):
        with pytest.raises(ContractInvalid, match=f"resources.{key}"):
            parse_contract({**data, "resources": {"slice": "cpu", key: bad}}, str(path))
    with pytest.raises(ContractInvalid, match="dedicated_cores: only for slice 'cpu'"):
        parse_contract({**data, "resources": {"slice": "mig-1g.18gb", "dedicated_cores": True}}, str(path))
