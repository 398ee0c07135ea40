"""Runtime adapters: turn a model contract into a loaded model with `infer(inputs) -> outputs`.

A runtime is used in two steps that match the cold-start ladder:
`preload()` runs once in the per-runtime zygote (heavy imports, no thread pools);
`load(contract)` runs in a forked child or a template and returns a `LoadedModel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ember.errors import ModelNotReady
from ember.wire.contract import ModelContract


class LoadedModel(Protocol):
    """A model in memory. Inputs were validated against the contract by the caller."""

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Runtime(Protocol):
    name: str

    def preload(self) -> None:
        """Import what every model of this runtime needs. Must not start thread pools."""

    def load(self, contract: ModelContract) -> LoadedModel:
        """Load the weights named by the contract (mmap where the format allows)."""


def get_runtime(name: str) -> Runtime:
    """The runtime registered under `name` (imported lazily: the gateway never imports torch)."""
    if name == "sentence-transformers":
        from ember.runtimes.embedding import EmbeddingRuntime

        return EmbeddingRuntime()
    if name == "python":
        from ember.runtimes.python import PythonRuntime

        return PythonRuntime()
    raise ModelNotReady(f"runtime: unknown runtime {name!r} (known: sentence-transformers, python)")


KNOWN_RUNTIMES = ("sentence-transformers", "python")
