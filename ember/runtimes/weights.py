"""Store-backed weights for the runtimes: the model's files and tensors from the node's weight store.

A contract whose `weights` is `store:NAME[:VERSION]` is loaded through the `WeightStore` the node hands
the runtime (built from the server's settings, never a default store): `materialize` writes the small
files (tokenizer.json, config.json, ...) into a directory under the store root once per node, and
`open_tensors` maps the tensors as zero-copy views of the chunk files that every process of the node
shares. Store errors become ModelNotReady naming the model, its weights and the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import EmberError, InvalidInput, ModelNotFound, ModelNotReady, StoreError
from ember.wire.contract import ModelContract

if TYPE_CHECKING:  # the store's loader imports torch: only when tensors are opened
    import torch

    from ember.store import WeightStore


def describe_store(store: WeightStore) -> str:
    origin = f", origin {store.config.origin}" if store.config.origin else ""
    return f"weight store {store.root}{origin}"


def local_weights(contract: ModelContract) -> Path | None:
    """The contract's weights path (None: no weights); ModelNotReady naming the model when it cannot be resolved
    (say a pkg: package that is not installed). The contract's message names `weights` already."""
    try:
        return contract.weights_path()
    except EmberError as err:
        raise ModelNotReady(f"model '{contract.key}': {err.message}") from None


def require_store(contract: ModelContract, store: WeightStore | None) -> tuple[str, WeightStore]:
    """The contract's store name and the store to read it from; ModelNotReady when the node has no store."""
    ref = contract.store_ref
    if ref is None:
        raise ValueError(f"model '{contract.key}': weights {contract.weights!r} are not in a weight store")
    if store is None:
        raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r} are in a weight store and this "
                            "node has none configured (ember serve --store-root / --store-origin)")
    return ref, store


@contextmanager
def store_errors(contract: ModelContract, store: WeightStore) -> Iterator[None]:
    """Translate the store's errors (no such model, corrupt chunk, unreachable origin) into ModelNotReady."""
    try:
        yield
    except (ModelNotFound, StoreError, InvalidInput) as err:
        where = "" if str(store.root) in err.message else f" ({describe_store(store)})"
        raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r}{where}: {err.message}") from None
    except OSError as err:  # e.g. out of file descriptors: every mapped chunk holds one
        raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r} ({describe_store(store)}): "
                            f"{err.strerror or err}") from None


def store_files(contract: ModelContract, store: WeightStore | None, *, tensors: bool = False) -> Path:
    """A directory holding the model's files from the store (its safetensors files too with `tensors`)."""
    ref, store = require_store(contract, store)
    with store_errors(contract, store):
        return store.materialize(ref, tensors=tensors)


def store_tensors(contract: ModelContract, store: WeightStore | None, file: str) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file of the model (`file` relative to the model directory), as views.

    Views of mapped chunk files, each brought into a local tier (or fetched) as it is read. No prefetch
    threads: a template forks after loading, and a process with threads cannot be forked safely.
    """
    from ember.store import open_tensors

    ref, store = require_store(contract, store)
    with store_errors(contract, store):
        tensor_map = open_tensors(ref, store=store, prefetch=False)
        try:
            entry = next((f for f in tensor_map.manifest.files if f.path == file), None)
            if entry is None or entry.kind != "safetensors":
                raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r} "
                                    f"({describe_store(store)}): no safetensors file {file!r} in the model")
            return {name: tensor_map[name] for name in entry.tensors}
        finally:
            tensor_map.close()
