"""Contract directories in the weight store (`ember.serving.bundles`, `Repository(refs=...)`): read out of this
node's own store, a contract another node read elsewhere localized here, and clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ember.cli import main
from ember.config import load_serve_config
from ember.errors import ContractInvalid, InvalidInput, ModelNotReady
from ember.serving.bundles import StoreBundles, bundle_ref
from ember.serving.repository import Repository
from ember.store import StoreConfig, WeightStore
from ember.wire.contract import load_contract

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "bundles" / "scaler"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A node's store root holding the scaler directory as scaler:1 and a weights-only object as bare:1 (fetching
    them from peers or an origin is the store's, tested there and end to end in tests/e2e)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    (src / "weights").mkdir()
    save_file({"scale": np.array([2.5], np.float32)}, str(src / "weights" / "scale.safetensors"))
    with WeightStore(StoreConfig(root=tmp_path / "node", memory_dir=None)) as store:
        store.push(src, "scaler:1")
        store.push(src / "weights", "bare:1")
    shutil.rmtree(src)
    return tmp_path / "node"


def bundles(root: Path) -> StoreBundles:
    return StoreBundles(lambda: WeightStore(StoreConfig(root=root, memory_dir=None)))


def test_a_contract_is_read_out_of_the_nodes_own_store_with_its_bundle_set(tmp_path: Path, root: Path) -> None:
    mine = bundles(root)
    try:
        (contract,) = mine.contracts("scaler:1")
    finally:
        mine.close()
    assert contract.key == "scaler:1" and contract.bundle == "scaler:1"
    assert contract.source is not None and Path(contract.source).is_relative_to(root)
    weights = contract.weights_path()
    assert weights is not None and load_file(str(weights))["scale"].tolist() == [2.5]   # the tensors written out
    assert (Path(contract.source).parent / "scaler_model" / "model.py").is_file()


def test_a_contract_read_on_another_node_is_localized_to_this_one(tmp_path: Path, root: Path) -> None:
    elsewhere = load_contract(FIXTURE / "scaler.yaml").model_copy(update={"bundle": "scaler:1",
                                                                           "source": "/nowhere/scaler.yaml"})
    repo = Repository([], refs=(), bundles=bundles(root))
    here = repo.localize(elsewhere)
    assert here.source is not None and Path(here.source).is_relative_to(root)
    plain = load_contract(FIXTURE / "scaler.yaml")
    assert repo.localize(plain) is plain


def test_the_repository_lists_store_objects_once_fetched_and_their_errors(tmp_path: Path, root: Path) -> None:
    repo = Repository([], refs=("scaler:1", "bare:1", "gone:1"), bundles=bundles(root))
    before = {e.name: e.error for e in repo.scan()}
    assert all("not fetched" in (error or "") for error in before.values()) and len(before) == 3
    repo.fetch()
    entries = {str(e.path): e for e in repo.scan()}
    (good,) = [e for e in entries.values() if e.contract is not None]
    assert good.contract is not None and good.contract.bundle == "scaler:1"
    assert "holds no contract file" in (entries["store:bare:1"].error or "")
    assert "gone:1" in (entries["store:gone:1"].error or "")
    assert repo.find("scaler")[0].key == "scaler:1"


def test_without_a_store_a_store_contract_is_refused_by_name(tmp_path: Path) -> None:
    contract = load_contract(FIXTURE / "scaler.yaml").model_copy(update={"bundle": "scaler:1"})
    with pytest.raises(ContractInvalid, match="scaler:1"):
        Repository([]).localize(contract)
    repo = Repository([], refs=("scaler:1",))
    repo.fetch()
    assert "no weight store" in (repo.scan()[0].error or "")


def test_a_store_object_without_that_model_is_not_ready(tmp_path: Path, root: Path) -> None:
    other = load_contract(FIXTURE / "scaler.yaml").model_copy(update={"bundle": "scaler:1", "name": "other"})
    with pytest.raises(ModelNotReady, match="holds no contract of that model"):
        bundles(root).localize(other)


def test_store_sources_are_told_from_paths() -> None:
    assert bundle_ref("store:scaler") == "scaler:latest"
    assert bundle_ref("store:scaler:2") == "scaler:2"
    assert bundle_ref("models/scaler.yaml") is None


def test_push_names_the_contracts_of_a_directory_and_refuses_weights_outside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "scaler"
    shutil.copytree(FIXTURE, src)
    (src / "weights").mkdir()
    save_file({"scale": np.array([2.5], np.float32)}, str(src / "weights" / "scale.safetensors"))
    store = ["store", "--root", str(tmp_path / "store"), "--no-memory", "--quiet"]
    assert main([*store, "push", str(src), "scaler:1"]) == 0
    assert "contracts: scaler:1 (serve them on any node: ember serve --models store:scaler:1)" \
        in capsys.readouterr().out
    contract = src / "scaler.yaml"
    contract.write_text(contract.read_text().replace("weights/scale.safetensors", str(tmp_path / "elsewhere.bin")))
    assert main([*store, "push", str(src), "scaler:2"]) == 2
    assert "lie outside" in capsys.readouterr().err
    with WeightStore(StoreConfig(root=tmp_path / "store", memory_dir=None)) as pushed:
        assert pushed.models() == ["scaler:1"]   # nothing stored for the refused push


def test_serve_takes_store_names_beside_paths_and_refuses_a_bad_one() -> None:
    config = load_serve_config(store_models=("scaler", "scaler:2"))
    assert config.store_models == ("scaler:latest", "scaler:2")
    with pytest.raises(InvalidInput, match="store_models"):
        load_serve_config(store_models=("bad name",))
