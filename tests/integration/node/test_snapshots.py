"""Process snapshots with CRIU (ember.node.snapshots): a model's process dumped once and restored as copies that
answer as the process did, re-seeded, without request data in the image, refused where it was not made."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ember.node import criu, snapshots
from ember.node.framing import recv_frame, send_frame
from ember.runtimes import get_runtime, replies_of
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow
MINILM = example_contracts_dir() / "minilm.yaml"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[snapshots.Image]:
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")
    where = tmp_path_factory.mktemp("images")
    yield snapshots.make_image(load_contract(MINILM), where / "minilm")
    shutil.rmtree(where, ignore_errors=True)


def embed(restored: snapshots.Restored, text: str) -> np.ndarray:
    arr = np.empty(1, dtype=object)
    arr[0] = text.encode()
    send_frame(restored.conn, {"op": "infer"}, {"text": arr})
    frame = recv_frame(restored.conn)
    assert frame is not None and frame.op == "reply", frame
    return np.asarray(frame.tensors()["embedding"])


def test_copies_of_one_image_answer_side_by_side_as_the_model_does(image: snapshots.Image) -> None:
    model = get_runtime("sentence-transformers").load(load_contract(MINILM))
    arr = np.empty(1, dtype=object)
    arr[0] = b"ember keeps models warm"
    expected = next(r for r in replies_of(model, {"text": arr}) if r is not None)["embedding"]
    first, second = snapshots.restore(image.path), snapshots.restore(image.path)   # two at once: own pid spaces
    try:
        for copy in (first, second):
            np.testing.assert_allclose(embed(copy, "ember keeps models warm"), expected, rtol=1e-5, atol=1e-6)
    finally:
        first.close()
        second.close()
    assert image.bytes > 0 and image.dump_s > 0


def test_a_request_never_reaches_the_image(image: snapshots.Image) -> None:
    secret = "the launch code is 7Q-ZULU-4471"
    copy = snapshots.restore(image.path)
    try:
        embed(copy, secret)
    finally:
        copy.close()
    for path in image.path.iterdir():
        assert secret.encode() not in path.read_bytes(), path.name


def test_an_image_made_elsewhere_is_refused_with_its_reason(image: snapshots.Image, tmp_path: Path) -> None:
    contract = load_contract(MINILM)
    assert snapshots.compatible(image.path, contract) is None
    moved = tmp_path / "moved"
    shutil.copytree(image.path, moved)
    meta = json.loads((moved / "ember.json").read_text())
    (moved / "ember.json").write_text(json.dumps({**meta, "host": "another-cpu"}))
    assert snapshots.compatible(moved, contract) == ("the image was made on a CPU with other features (or another "
                                                   "llama.cpp build)")
    edited = contract.model_copy(update={"version": "2"})
    assert snapshots.compatible(image.path, edited) == "the contract changed since the image was made"
    files = meta["files"]
    weights = next(p for p in files if p.endswith(".safetensors"))   # mapped again on restore, not in the image
    (moved / "ember.json").write_text(json.dumps({**meta, "files": {**files, weights: [1, 1]}}))
    assert snapshots.compatible(moved, contract) == f"a file the image maps changed since it was made: {weights}"
    (moved / "ember.json").write_text(json.dumps({**meta, "environment": "another"}))
    assert "another ember, Python or set of installed packages" in (snapshots.compatible(moved, contract) or "")


def test_a_copys_monotonic_clock_goes_on_from_the_dump_not_from_the_host(image: snapshots.Image) -> None:
    """The image sat on disk 5 s; the copy's monotonic clock (in its own time namespace) resumes where the
    dump left it, as it would on a host booted since: it never goes back, and the time on disk is not in it."""
    import time

    time.sleep(max(0.0, 5.0 - (time.time() - float(image.meta["dumped_at"]))))
    copy = snapshots.restore(image.path)
    try:
        on_disk = time.time() - float(image.meta["dumped_at"])   # >= 5 s: the host's clocks ran on meanwhile
        ran = float(copy.hello["monotonic"]) - float(image.meta["monotonic"])   # type: ignore[arg-type]
        assert 0 <= ran < on_disk - 2.5, (ran, on_disk)   # the dump and the restore, not the time on disk
    finally:
        copy.close()
