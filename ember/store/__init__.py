"""The weight store: content-addressed chunks in tiers (memory, disk, remote origin), opened lazily as tensors.

Runtimes call `open_tensors("name:version")` to get a model's tensors as zero-copy views, and
`WeightStore.materialize(name)` for a directory holding its other files (tokenizer.json, config.json, ...).
"""

from __future__ import annotations

from ember.store.config import StoreConfig
from ember.store.loader import TensorMap, open_tensors
from ember.store.manifest import Manifest, ModelRef
from ember.store.store import WeightStore

__all__ = ["Manifest", "ModelRef", "StoreConfig", "TensorMap", "WeightStore", "open_tensors"]
