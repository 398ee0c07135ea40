"""Runtime adapters: turn a model contract into a loaded model with `infer(inputs) -> outputs`.

A runtime is used in two steps that match the cold-start ladder:
`preload()` runs once in the per-runtime zygote (heavy imports, no thread pools);
`load(contract)` runs in a forked child or a template and returns a `LoadedModel`.

A loaded model answers a request with one reply (`infer`) or, if it `streams`, with several
(`stream`, a generator: tokens, chunks). Both take `stop`, a check the model may call between
steps of long work: True means nobody wants the answer any more (the client left, the deadline
passed) and the model should raise `ember.errors.Cancelled`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import numpy as np
from pydantic import BaseModel, ValidationError

from ember.errors import ContractInvalid, ModelNotReady
from ember.wire.contract import ModelContract

if TYPE_CHECKING:
    from ember.store import WeightStore


StopCheck = Callable[[], bool]
Options = TypeVar("Options", bound=BaseModel)


class LoadedModel(Protocol):
    """A model in memory. Inputs were validated against the contract by the caller."""

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]: ...


class StreamingModel(LoadedModel, Protocol):
    """A model that may answer one request with several replies. A stream may yield None: no reply yet (the
    model did a step of shared work, such as a batch for other streams); the caller asks again later.
    One that keeps what a request leaves behind for later requests per tenant (the llm runtime's prefix cache)
    says `per_tenant = True`: its `stream` then also takes `tenant=`, the caller's (None: none)."""

    streams: bool

    def stream(self, inputs: Mapping[str, np.ndarray],
               stop: StopCheck | None = None) -> Iterator[dict[str, np.ndarray] | None]:
        ...


def parse_options(contract: ModelContract, model: type[Options]) -> Options:
    """The contract's `options` as a runtime's pydantic model; ContractInvalid naming each `options.<key>`."""
    try:
        return model.model_validate(contract.options)
    except ValidationError as err:
        parts = [f"options.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        raise ContractInvalid(f"model '{contract.key}': " + "; ".join(parts)) from None


def replies_of(model: LoadedModel, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None,
               tenant: str | None = None) -> Iterator[dict[str, np.ndarray] | None]:
    """Every reply `model` gives to one request (by `tenant`'s caller): its stream if it streams (None: none yet,
    ask again), else its one reply."""
    if getattr(model, "streams", False):
        scoped = {"tenant": tenant} if getattr(model, "per_tenant", False) else {}
        yield from model.stream(inputs, stop, **scoped)  # type: ignore[attr-defined]
    else:
        yield model.infer(inputs, stop)


class Runtime(Protocol):
    """A runtime may also say `sandboxed_load = True`: its load runs the model's own code, so a node loads it
    after the sandbox's lock-down, its store-backed weights staged as local files first (`ember.node.loading`).
    Without it (ember's built-in runtimes, which read and write the weight store while loading), the lock-down
    follows the load."""

    name: str

    def preload(self) -> None:
        """Import what every model of this runtime needs. Must not start thread pools."""

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> LoadedModel:
        """Load the weights named by the contract (mmap where the format allows).

        `store` is the node's weight store, for contracts whose weights are `store:NAME[:VERSION]`;
        such a contract without a store is a ModelNotReady that says so.
        """


@runtime_checkable
class HoldingRuntime(Protocol):
    """A runtime whose zygote can hold a deployed model's weights mapped (no thread, no context), so that an
    instance forked after it starts without loading them (`ember.node.zygote`)."""

    def hold(self, contract: ModelContract) -> bool:
        """Load what every instance of the model shares, in this process, for the children forked after it;
        False when this model cannot be held (the instance then loads it all)."""

    def drop(self, contract: ModelContract) -> None:
        """Let go of what `hold` loaded for the contract."""

    def keep(self, contract: ModelContract) -> None:
        """In a child just forked: let go of everything held but the contract's own."""


def get_runtime(name: str) -> Runtime:
    """The runtime registered under `name` (imported lazily: the gateway never imports torch)."""
    if name == "sentence-transformers":
        from ember.runtimes.embedding import EmbeddingRuntime

        return EmbeddingRuntime()
    if name == "python":
        from ember.runtimes.python import PythonRuntime

        return PythonRuntime()
    if name == "llm":
        from ember.runtimes.llm import LLMRuntime

        return LLMRuntime()
    if name == "vllm":   # only in the vllm environment (ember env build vllm), where vLLM is installed
        from ember.runtimes.vllm import VLLMRuntime

        return VLLMRuntime()
    raise ModelNotReady(f"runtime: unknown runtime {name!r} (known: {', '.join(KNOWN_RUNTIMES)})")


KNOWN_RUNTIMES = ("sentence-transformers", "python", "llm", "vllm")
