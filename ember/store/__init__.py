"""The weight store: content-addressed chunks in tiers (memory, disk, remote origin), opened lazily as tensors.

Runtimes call `open_tensors("name:version")` to get a model's tensors as zero-copy views, and
`WeightStore.materialize(name)` for a directory holding its other files (tokenizer.json, config.json, ...).
`open_tensors` and `TensorMap` (which need torch) are imported on first use, so that the gateway, the
contract parser and the python runtime can use the store's names, config and files without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.store.config import StoreConfig
from ember.store.manifest import Manifest, ModelRef
from ember.store.store import WeightStore

if TYPE_CHECKING:
    from ember.store.loader import TensorMap, open_tensors

__all__ = ["Manifest", "ModelRef", "StoreConfig", "TensorMap", "WeightStore", "open_tensors"]


def __getattr__(name: str) -> Any:
    if name in ("TensorMap", "open_tensors"):
        from ember.store import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'ember.store' has no attribute {name!r}")
