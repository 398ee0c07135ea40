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

A restored image runs as root until it enters its sandbox, so an image from a peer is used only when the peer
signed it with the cluster's token (`--cluster-token`: an HMAC over every file of the image, `ember.sig`), which
this node checks once the image is on its disk; without a token, or with a signature that does not match, the
image is refused (logged) and the model loads. The node's own store and the origin are trusted as for weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
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


SIGNATURE = "ember.sig"


def signature(images: Path, token: str) -> str:
    """The HMAC-SHA256, keyed by the cluster's token, of every file of the image but its signature."""
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for path in sorted(p for p in images.iterdir() if p.is_file() and p.name != SIGNATURE):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        mac.update(f"{path.name}\0{digest.hexdigest()}\n".encode())
    return mac.hexdigest()


def publish(store: WeightStore, images: Path, contract: ModelContract) -> None:
    """Put a made image into the store (its chunks pinned on disk until the model is released), signed with the
    cluster's token when the node has one (for its peers)."""
    token = store.config.peer_token
    if token:
        (images / SIGNATURE).write_text(signature(images, token))
    store.push(images, image_ref(contract).key)


def take(store: WeightStore, images: Path, contract: ModelContract) -> bool:
    """Write the contract's image out of the store (fetched from a peer or the origin when not held here) into
    `images`; False when no store this node reaches holds one. Every chunk is checked against its digest."""
    ref, from_peer = image_ref(contract), False
    try:
        store.manifest(ref)
    except EmberError:
        if store.peer_manifest(ref) is None:
            return False
        from_peer = True
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
    why = _unsigned(building, store.config.peer_token) if from_peer else None
    if why is not None:
        shutil.rmtree(building, ignore_errors=True)
        store.remove_manifest(ref)
        log.warning("snapshots: model '%s': the image a peer gave is not used (%s); the model loads", contract.key,
                    why)
        return False
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(images)
    building.rename(images)
    return True


def withdraw(store: WeightStore, contract: ModelContract) -> None:
    """The model is released: its image's manifest goes, so the store's gc may take its chunks."""
    store.remove_manifest(image_ref(contract))


def _unsigned(images: Path, token: str | None) -> str | None:
    """Why a peer's image is not to be trusted (None: it is signed with this cluster's token)."""
    if not token:
        return "this node has no cluster token to check its signature with (--cluster-token)"
    try:
        signed = (images / SIGNATURE).read_text().strip()
    except OSError:
        return "it is not signed"
    if not hmac.compare_digest(signed, signature(images, token)):
        return "its signature does not match this cluster's token"
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
