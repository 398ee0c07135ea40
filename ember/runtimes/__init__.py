"""Runtime adapters: turn a model contract into a loaded model with `infer(inputs) -> outputs`.

A runtime is used in two steps that match the cold-start ladder:
`preload()` runs once in the per-runtime zygote (heavy imports, no thread pools);
`load(contract)` runs in a forked child or a template and returns a `LoadedModel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ember.errors import ModelNotReady
from ember.wire.contract import ModelContract

if TYPE_CHECKING:
    from ember.store import WeightStore


class LoadedModel(Protocol):
    """A model in memory. Inputs were validated against the contract by the caller."""

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Runtime(Protocol):
    name: str

    def preload(self) -> None:
        """Import what every model of this runtime needs. Must not start thread pools."""

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> LoadedModel:
        """Load the weights named by the contract (mmap where the format allows).

        `store` is the node's weight store, for contracts whose weights are `store:NAME[:VERSION]`;
        such a contract without a store is a ModelNotReady that says so.
        """


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
