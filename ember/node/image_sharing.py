"""A model's process image as content of the weight store: kept there once made, taken from there (or from a
peer's store) by a node that has none, so that a new node's first start of a model is a restore, not a load.

An image is stored as a model of the store named `image-KEY:1` (chunks, dedupe, tiers, peer fetch and the digest
check on every chunk, as weights are). KEY is a digest of everything an image must match to be restored: the
snapshot host's format, CRIU's version, the CPU's features and llama.cpp's build (`cpu_probe.host_key`), ember's
environment, and the contract. The files the process maps (the GGUF, the libraries) are checked again once the
image is on this node's disk (`snapshots.compatible`): they must be the same files, at the same paths.

Peers serve the manifest (`GET /v2/store/manifests/image-KEY/1.json`, ember/gateway/store_api.py) beside the
chunks; a node asks its static peers (`--store-peers`) in turn (the cluster's chunk directory finds holders by chunk
digest, not by model name: it names none for an image).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path

from ember.errors import EmberError
from ember.node import criu as criu_
from ember.node import snapshots
from ember.runtimes.cpu_probe import host_key
from ember.store.store import WeightStore
from ember.wire.contract import ModelContract
from ember.wire.refs import ModelRef

log = logging.getLogger("ember.node")


def image_ref(contract: ModelContract) -> ModelRef:
    """The store's name for the contract's image on a host like this one."""
    found = criu_.find()
    parts = [str(snapshots.FORMAT), found.version or "?", host_key(), snapshots.environment(),
             snapshots.contract_text(contract)]
    return ModelRef(f"image-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:32]}", "1")


def publish(store: WeightStore, images: Path, contract: ModelContract) -> None:
    """Put a made image into the store (its chunks pinned on disk until the model is released)."""
    store.push(images, image_ref(contract).key)


def take(store: WeightStore, images: Path, contract: ModelContract) -> bool:
    """Write the contract's image out of the store (fetched from a peer or the origin when not held here) into
    `images`; False when no store this node reaches holds one. Every chunk is checked against its digest."""
    ref = image_ref(contract)
    try:
        store.manifest(ref)
    except EmberError:
        if store.peer_manifest(ref) is None:
            return False
    try:
        store.pull(ref.key)
        made = store.materialize(ref.key)
    except EmberError as err:
        log.warning("snapshots: model '%s': its image in the store could not be fetched (%s)", contract.key,
                    err.message)
        return False
    building = images.with_name(f"{images.name}.new")
    shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(made, building, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(".*"))
    shutil.rmtree(made, ignore_errors=True)   # the chunks stay in the store; the copy is in `images`
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(images)
    building.rename(images)
    return True


def withdraw(store: WeightStore, contract: ModelContract) -> None:
    """The model is released: its image's manifest goes, so the store's gc may take its chunks."""
    store.remove_manifest(image_ref(contract))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
