"""Contract directories in the weight store: a model pushed whole (contract, code, weights) served on any node.

`ember store push DIR NAME:VERSION` stores a directory of contract files with what they need beside them; a
node given `--models store:NAME:VERSION` (or handed such a contract by its cluster) pulls that object into its
own store, from its peers or the origin like any weights, writes it out under its own store root and reads the
contracts there. A contract read so carries `bundle` (the store's name), so another node deploying it never
reads the first node's path: it writes the same directory out of its own store (`localize`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import ContractInvalid, EmberError, ModelNotReady
from ember.wire.contract import STORE_PREFIX, ModelContract, find_contracts, load_contract
from ember.wire.refs import ModelRef

if TYPE_CHECKING:
    from ember.store import WeightStore

log = logging.getLogger("ember.serving")


def bundle_ref(source: str) -> str | None:
    """The store's `name:version` of a `--models store:NAME[:VERSION]` source (None: a path). A bad name is an
    InvalidInput naming it."""
    if not source.startswith(STORE_PREFIX):
        return None
    return ModelRef.parse(source[len(STORE_PREFIX):]).key


class StoreBundles:
    """Contract directories written out of this node's weight store. `open_store` builds the node's store (its
    peers and origin included) the first time one is needed; the store is kept for the server's life."""

    def __init__(self, open_store: Callable[[], WeightStore]) -> None:
        self._open_store = open_store
        self._store: WeightStore | None = None
        self._lock = threading.Lock()     # one pull at a time: the store's single flight is per chunk

    def directory(self, ref: str) -> Path:
        """The directory of store object `ref` on this node, pulled first when its chunks are not all here
        (blocking: run it in a worker thread). ModelNotReady naming the object when the store cannot give it."""
        with self._lock:
            store = self._store_now()
            try:
                store.pull(ref)
                return store.materialize(ref, tensors=True)
            except EmberError as err:
                raise ModelNotReady(f"store:{ref}: {err.message}") from None
            except OSError as err:
                raise ModelNotReady(f"store:{ref}: cannot write it out under {store.root}: {err}") from None

    def contracts(self, ref: str) -> list[ModelContract]:
        """Every contract file at the top of object `ref`'s directory, read with `bundle` set. ContractInvalid
        naming the object when it holds none (a model's weights pushed alone are not a contract directory)."""
        found = [p for p in find_contracts(self.directory(ref)) if p.is_file()]
        if not found:
            raise ContractInvalid(f"store:{ref} holds no contract file (*.yaml at its top): push the directory "
                                  "that holds the model's contract")
        return [load_contract(p).model_copy(update={"bundle": ref}) for p in found]

    def localize(self, contract: ModelContract) -> ModelContract:
        """`contract` as this node reads it out of its own store (its `source` a path here); the contract itself
        when it did not come from the store. ModelNotReady when the object no longer holds that model."""
        if contract.bundle is None:
            return contract
        for mine in self.contracts(contract.bundle):
            if mine.key == contract.key:
                return mine
        raise ModelNotReady(f"model '{contract.key}': store:{contract.bundle} holds no contract of that model")

    def store(self) -> WeightStore:
        """The node's store as this object reads it (opened on first use): the gateway's prompt check reads a
        stored GGUF's head through it (ember.gateway.prompt_check)."""
        if self._store is None:
            with self._lock:
                return self._store_now()
        return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def _store_now(self) -> WeightStore:
        if self._store is None:
            self._store = self._open_store()
            log.info("contract directories from the weight store at %s", self._store.root)
        return self._store
