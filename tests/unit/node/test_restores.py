"""Which models get a process image (ember.node.restores.snapshot_refused)."""

import asyncio
from pathlib import Path

from ember.errors import ModelNotFound
from ember.node.restores import NodeImages, snapshot_refused
from ember.wire.contract import example_contracts_dir, load_contract


def contract(name: str):  # type: ignore[no-untyped-def]
    return load_contract(example_contracts_dir() / f"{name}.yaml")


def test_built_in_runtimes_that_load_only_embers_code_are_imaged() -> None:
    assert snapshot_refused(contract("minilm")) is None
    assert snapshot_refused(contract("smollm2")) is None


def test_a_model_whose_load_runs_its_own_code_is_never_imaged_outside_its_sandbox() -> None:
    assert snapshot_refused(contract("iris")) == ("the python runtime's load may run the model's own code, which runs "
                                                  "only in its sandbox")


def test_a_runtime_in_an_environment_of_its_own_is_not_imaged() -> None:
    vllm = contract("smollm2").model_copy(update={"runtime": "vllm"})
    assert "environment of its own" in (snapshot_refused(vllm) or "")


class FailingStore:
    """A weight store without the image whose peer lookup fails as a full disk does (writing the manifest)."""

    def manifest(self, ref: object) -> None:
        raise ModelNotFound("weight store: no model")

    def peer_manifest(self, ref: object) -> None:
        raise OSError(28, "No space left on device")


def test_an_image_the_store_cannot_give_leaves_the_model_prepared_without_one(tmp_path: Path) -> None:
    images = NodeImages(tmp_path / "images", False, dict, store=lambda _: FailingStore())  # type: ignore[arg-type,return-value]
    images.enabled = True
    assert asyncio.run(images.found(contract("minilm"))) is False
    assert not images.ready(contract("minilm"))
