"""How a forked child (a template, an instance) gets its model inside its sandbox (`ember.node.sandbox`).

Three steps, in this order:

1. `enter`: a mount namespace of its own (the node moves it into its cgroups meanwhile);
2. `stage`, ember's own code with the node's view of the files: a store-backed model whose runtime runs the
   model's code at load (the python runtime: the user's `load()`) has its files materialized into a directory
   of the weight store, which the lock-down then lets it read;
3. once the node has moved it into its cgroups (memory, pids: their limits apply before any model code), the
   lock-down (read-only view, no network, its model's user, seccomp), then the load — so that the model's
   code never runs as the node, sees the network, or writes outside its scratch. A built-in runtime that reads
   the weight store while it loads (sentence-transformers views of the store's chunks; the llm runtime's prefix
   snapshots, which it restores and saves there) loads ember's code before the lock-down instead
   (`Runtime.sandboxed_load` False), and the wait for the cgroups and the lock-down follow the load: before any
   input, as before (the move, 10-16 ms for cgroup v1, lands while it loads, so it costs the start nothing).

A replica forked from a template starts inside the template's sandbox already (`Loaded`): it inherits its user,
view, namespaces and filter, and only its cgroups are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ember.node.sandbox import Report, SandboxPlan, await_cgroup, enter, lock_down
from ember.node.weights import child_store, load_model, populate_weights
from ember.runtimes import LoadedModel, Runtime
from ember.store.config import StoreConfig
from ember.wire.contract import ModelContract


class Loader(Protocol):
    sandboxed: bool     # the load runs model code: after the lock-down

    def stage(self) -> tuple[str, ...]: ...   # before the lock-down; what the load then reads

    def load(self) -> LoadedModel: ...


class ModelLoader:
    """A zygote child's way to its model: the runtime's load, store-backed weights staged first where the
    load runs model code (see the module docstring)."""

    def __init__(self, runtime: Runtime, contract: ModelContract, store: StoreConfig | None, *,
                 template: bool = False) -> None:
        self.runtime, self.contract, self.store = runtime, contract, store
        self.sandboxed = bool(getattr(runtime, "sandboxed_load", False))
        # A runtime may load differently for a template, whose replicas share what it loads (`template_contract`:
        # the llm runtime's `repack: template`).
        adapt = getattr(runtime, "template_contract", None) if template else None
        if adapt is not None:
            self.contract = adapt(contract)

    def stage(self) -> tuple[str, ...]:
        if not self.sandboxed or self.contract.store_ref is None or self.store is None:
            return ()
        path = materialize(self.contract, self.store)
        self.contract = self.contract.model_copy(update={"weights": str(path)})
        return (str(path),)

    def load(self) -> LoadedModel:
        """Load, then map the weights' page-table entries in one madvise (an 8B's first forward pass otherwise
        faults a million pages in one by one: 0.9 s against 0.1 s for the madvise, measured)."""
        model = load_model(self.runtime, self.contract, self.store)
        populate_weights(self.contract, self.store)
        return model


class Loaded:
    """The model is loaded already: a template's replica (its sandbox the template's), or a process restored from
    its image (`ember.node.snapshot_host`: it enters its sandbox, then takes this load)."""

    def __init__(self, model: LoadedModel, *, sandboxed: bool = True) -> None:
        self.model = model
        self.sandboxed = sandboxed   # False for a restored process: its load ran outside, and the report says so

    def stage(self) -> tuple[str, ...]:
        return ()

    def load(self) -> LoadedModel:
        return self.model


def materialize(contract: ModelContract, config: StoreConfig) -> str:
    """A store-backed model's files (its safetensors too) in a directory of the store, fetched if missing."""
    from ember.runtimes.weights import store_files

    with child_store(contract, config) as store:
        return str(store_files(contract, store, tensors=True))


def load_sandboxed(loader: Loader, plan: SandboxPlan | None, report: Report, *,
                   before_lock: Callable[[], None] = lambda: None) -> LoadedModel:
    """The three steps of the module docstring (no plan: just the load). `before_lock` runs between entering
    and the lock-down (an instance's slice: its CPUs and thread count)."""
    if plan is None:
        before_lock()
        return loader.load()
    enter(plan, report)
    before_lock()
    plan = plan.reading(loader.stage())
    if loader.sandboxed:
        await_cgroup(plan, report)
        lock_down(plan, report)
        report.load_sandboxed = True
        return loader.load()
    model = loader.load()      # ember's code: the node's cgroup move lands meanwhile, off the critical path
    await_cgroup(plan, report)
    lock_down(plan, report)
    return model
