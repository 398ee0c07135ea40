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


def test_a_peers_image_is_trusted_only_signed_with_this_clusters_token(tmp_path: Path) -> None:
    from ember.node import image_sharing

    image = tmp_path / "image"
    image.mkdir()
    (image / "pages-1.img").write_bytes(b"\x01" * 5000)
    (image / "ember.json").write_text("{}")
    (image / image_sharing.SIGNATURE).write_text(image_sharing.signature(image, "token-a"))
    assert image_sharing._unsigned(image, "token-a") is None
    assert "does not match" in str(image_sharing._unsigned(image, "token-b"))
    assert "no cluster token" in str(image_sharing._unsigned(image, None))
    (image / "pages-1.img").write_bytes(b"\x02" * 5000)   # a page changed after signing
    assert "does not match" in str(image_sharing._unsigned(image, "token-a"))
    (image / image_sharing.SIGNATURE).unlink()
    assert "not signed" in str(image_sharing._unsigned(image, "token-a"))


def test_a_model_released_while_its_image_is_made_keeps_no_image(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from ember.node import snapshots

    made, release = threading.Event(), threading.Event()

    def make_image(c, path, **_):  # type: ignore[no-untyped-def]
        path.mkdir(parents=True)
        (path / "ember.json").write_text("{}")
        made.set()
        release.wait(5)
        return snapshots.Image(path, 0.1, 0.1, 2, {})

    monkeypatch.setattr(snapshots, "make_image", make_image)
    monkeypatch.setattr(snapshots, "compatible", lambda path, c: "none yet")
    images = NodeImages(tmp_path / "images", False, dict)
    images.enabled = True
    minilm = contract("minilm")

    async def main() -> None:
        making = asyncio.ensure_future(images.ensure(minilm))
        await asyncio.to_thread(made.wait, 5)
        images.drop(minilm.key)   # the model is released mid-make
        release.set()
        await making

    asyncio.run(main())
    assert not images.ready(minilm) and not images.path(minilm).exists()
