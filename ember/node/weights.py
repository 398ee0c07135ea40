"""Store-backed weights on a node: is a model's weights local, fetch them, and hand the store to children.

The node's weight store comes from the server's settings (`StoreConfig`, or None: no store). The node
process asks the store cheaply whether a model needs a fetch (its manifest in the root and one index
query per local tier, never the network) and pulls a model's chunks from the origin in a worker thread
(the FETCH rung, or a template's prepare). Zygote children get the settings in their fork command and
open their own store after the fork: the zygote itself never holds one, so it forks with one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from ember.core.bandwidth import Bandwidths
from ember.errors import EmberError, InvalidInput, ModelNotReady
from ember.node import procinfo
from ember.runtimes import LoadedModel, Runtime
from ember.runtimes.weights import require_store, store_errors
from ember.store.config import StoreConfig
from ember.store.hashing import one_thread
from ember.store.manifest import Manifest, ModelRef
from ember.store.page_cache import LIBC, MADV_POPULATE_READ, Primed, prime
from ember.store.store import WeightStore
from ember.store.tiers.peer import FetchGate, PeerDirectory
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.node")


def store_to_json(config: StoreConfig | None) -> dict[str, Any] | None:
    return None if config is None else config.model_dump(mode="json")


def store_from_json(data: object) -> StoreConfig | None:
    """The store settings of a fork command (None: the node has no weight store)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise InvalidInput("fork: 'store' must be an object or null")
    return StoreConfig.build(**data)


def load_model(runtime: Runtime, contract: ModelContract, config: StoreConfig | None) -> LoadedModel:
    """In a zygote's child: load the contract's model, through a store of its own when its weights are in one.

    The store is closed once the model is loaded (its views stay valid): that joins the store's threads,
    so a template that loaded through it can fork. Its chunk digests (a chunk copied up to the memory tier is
    hashed) run on one thread: blake3's pool would outlive the store. The memory tier is the node's, shared
    with every instance: a child never removes it, even if it happened to create it.
    """
    if contract.store_ref is None:
        return runtime.load(contract)
    if config is None:
        return runtime.load(contract, store=None)  # the runtime says that this node has no store
    with child_store(contract, config) as store:
        return runtime.load(contract, store=store)


@contextlib.contextmanager
def child_store(contract: ModelContract, config: StoreConfig) -> Iterator[WeightStore]:
    """A store of the child's own for `contract`'s weights, closed (its threads joined) on leaving."""
    with one_thread():
        try:
            store = WeightStore(config.model_copy(update={"keep_memory_tier": True}))
        except EmberError as err:
            raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r}: {err.message}") from None
        try:
            yield store
        finally:
            store.close()


def _fill(store: WeightStore, ref: str) -> None:
    try:
        store.fill(ref)
    except (EmberError, RuntimeError) as err:   # RuntimeError: the store closed meanwhile
        log.info("weights %s: memory tier not filled: %s", ref, err)


def prime_mapped(contract: ModelContract) -> Primed | None:
    """The contract's GGUF file (mapped whole by llama.cpp), if it names one by path, into 2 MiB page-cache folios
    (ember/store/page_cache.py): at deploy, so that no start after it maps the file page by page. A store-backed
    model's GGUF is written so by the store. None: nothing to prime, or the file cannot be read (its load says
    why)."""
    try:
        path = contract.weights_path()
    except EmberError:
        return None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        return prime(path)
    except OSError as err:
        log.warning("model %s: cannot prime %s in huge pages: %s", contract.key, path, err)
        return None


def weight_roots(contract: ModelContract, config: StoreConfig | None) -> list[Path]:
    """Where the model's mapped weight files live: its weights path, or the store's chunk directories."""
    if contract.store_ref is None:
        try:
            path = contract.weights_path()
        except EmberError:
            return []
        return [] if path is None else [path]
    if config is None:
        return []
    roots = [config.root / "chunks", config.root / "models"]   # chunk views; files materialized whole (a GGUF)
    if config.memory_enabled and config.memory_dir is not None:
        roots.append(config.memory_dir / "chunks")
    return roots


class NodeWeights:
    """The node process's view of its weight store (opened on first use; None settings: no store)."""

    def __init__(self, config: StoreConfig | None, *, peers: PeerDirectory | None = None,
                 gate: FetchGate | None = None) -> None:
        """`peers`, `gate`: the cluster's peer directory and fetch gate (ember/cluster/peers.py); None: the
        config's static peers, this node alone."""
        self.config = config
        self._peers, self._gate = peers, gate
        self._store: WeightStore | None = None
        self.fetch_s = 0.0   # seconds of the node's own pulls (FETCH rung, template prepare)
        self._open_lock = threading.Lock()
        self._manifests: dict[str, tuple[tuple[int, int], Manifest]] = {}
        self._starting: list[ModelContract] = []   # a start or a template's load in flight for each (`starting`)

    def store(self, contract: ModelContract) -> WeightStore | None:
        if self.config is None:
            return None
        with self._open_lock:
            if self._store is None:
                try:
                    self._store = WeightStore(self.config, peers=self._peers, gate=self._gate)
                except EmberError as err:
                    raise ModelNotReady(f"model '{contract.key}': weights {contract.weights!r}: "
                                        f"{err.message}") from None
            return self._store

    def check(self, contract: ModelContract) -> None:
        """ModelNotReady when the contract's weights are in a store and this node has none."""
        if contract.store_ref is not None:
            require_store(contract, self.store(contract))

    def local(self, contract: ModelContract) -> bool:
        """True when loading the model needs no fetch: every chunk of its manifest is in a local tier."""
        if contract.store_ref is None:
            return True
        held = self._held(contract)
        return held is not None and held[1] >= held[0]

    def size(self, contract: ModelContract) -> tuple[int, int] | None:
        """(bytes of the model's distinct chunks, of those in a local tier) from the manifest in the store root;
        None for weights not in a store; (0, 0) when the manifest is not here (size unknown)."""
        if contract.store_ref is None:
            return None
        return self._held(contract) or (0, 0)

    def _held(self, contract: ModelContract) -> tuple[int, int] | None:
        """`size`, None when the manifest is not in the store root (or the store cannot say)."""
        ref = contract.store_ref
        if ref is None or self.config is None:
            return None
        try:
            store = self.store(contract)
            manifest = self._local_manifest(ref)
            if store is None or manifest is None:
                return None
            chunks = list(manifest.unique_chunks().values())
            missing = chunks
            for tier in store.locals:
                if not missing:
                    break
                held = tier.indexed(missing)
                missing = [c for c in missing if c.digest not in held]
        except EmberError as err:
            log.warning("model %s: cannot tell whether its weights are local: %s", contract.key, err)
            return None
        total = sum(c.size for c in chunks)
        return (total, total - sum(c.size for c in missing))

    def _local_manifest(self, ref: str) -> Manifest | None:
        """The manifest in the store root (never the origin's), parsed again only when its file changed."""
        assert self.config is not None
        path = self.config.root / ModelRef.parse(ref).manifest_path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise ModelNotReady(f"weight store: cannot read {path}: {err.strerror}") from None
        stamp = (st.st_mtime_ns, st.st_size)
        cached = self._manifests.get(ref)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            manifest = Manifest.from_json(path.read_bytes(), str(path))
        except OSError as err:
            raise ModelNotReady(f"weight store: cannot read {path}: {err.strerror}") from None
        self._manifests[ref] = (stamp, manifest)
        return manifest

    async def fetch(self, contract: ModelContract) -> None:
        """Pull every chunk of the model into the local tiers (a worker thread; the event loop runs on)."""
        if contract.store_ref is None:
            return
        ref, store = require_store(contract, self.store(contract))
        started = time.monotonic()
        try:
            with store_errors(contract, store):
                await asyncio.to_thread(store.pull, ref)
        finally:
            self.fetch_s += time.monotonic() - started

    def memory_tier(self, contract: ModelContract) -> bool:
        """The model's weights are in the node's store, which keeps a memory tier (`release_memory` frees it)."""
        return contract.store_ref is not None and self.config is not None and self.config.memory_enabled

    async def release_memory(self, contract: ModelContract, keep: Sequence[ModelContract]) -> int:
        """Remove the model's chunks from the memory tier but those of the models in `keep` and of the models
        starting on the node (from their manifests in the store root); the bytes removed. A worker thread: an
        index query and an unlink per chunk."""
        if not self.memory_tier(contract):
            return 0
        ref, store = require_store(contract, self.store(contract))
        kept = [*keep, *self._starting]   # a start reads them now, whatever the plan said before it came

        def release() -> int:
            with store_errors(contract, store):   # the manifests' reads too: every failure an EmberError
                digests: set[str] = set()
                for other in kept:
                    manifest = None if other.store_ref is None else self._local_manifest(other.store_ref)
                    digests |= set(manifest.unique_chunks()) if manifest is not None else set()
                return store.release_memory(ref, digests)

        return await asyncio.to_thread(release)

    async def fill_memory(self, contract: ModelContract) -> None:
        """Copy the model's chunks held on disk alone up to the memory tier (queued: they follow in the
        background, behind any load in flight)."""
        if not self.memory_tier(contract):
            return
        ref, store = require_store(contract, self.store(contract))

        def fill() -> None:
            with store_errors(contract, store):
                store.fill(ref)

        await asyncio.to_thread(fill)

    def fetched(self) -> dict[str, int]:
        """Chunk bytes the node's store fetched so far, by source (peer, origin); empty before it is opened."""
        store = self._store
        return {} if store is None else store.fetched_bytes()

    def bandwidths(self) -> Bandwidths:
        """The node's store's measured transfer rates (none before the store is opened)."""
        store = self._store
        return Bandwidths() if store is None else store.meters.bandwidths()

    def usage(self) -> dict[str, int]:
        """Bytes held per local tier of the node's store (empty until a model needed the store)."""
        store = self._store
        if store is None:
            return {}
        return {tier.name: tier.usage().used for tier in store.locals}

    def child_json(self) -> dict[str, Any] | None:
        """What a fork command carries so that the child opens the same store. A child never copies chunks up
        to the memory tier: its store's close would wait for the copies, and so would its start; the node
        does it behind the start (`starting`)."""
        config = self.config
        return store_to_json(None if config is None else config.model_copy(update={"promote_from_disk": False}))

    @contextlib.asynccontextmanager
    async def starting(self, contract: ModelContract) -> AsyncIterator[None]:
        """Around a start or a template's load: the memory-tier fills of the node's store (the copies up
        from disk: a kernel copy and a hash per chunk) wait until it is done, then the model's chunks on disk
        alone are copied up behind it, for the next starts. A release that begins meanwhile leaves the model's
        chunks in the memory tier (`release_memory`); one already running when the start began may still take
        them, and the load then reads those from disk (`ember.store.loader` reads a chunk gone again)."""
        self._starting.append(contract)
        try:
            async with self._filled_behind(contract):
                yield
        finally:
            self._starting.remove(contract)

    @contextlib.asynccontextmanager
    async def _filled_behind(self, contract: ModelContract) -> AsyncIterator[None]:
        ref = contract.store_ref
        store = None if ref is None else self.store(contract)
        if ref is None or store is None or store.memory is None or not store.config.promote_from_disk:
            yield
            return
        store.pause_fills()
        try:
            yield
        finally:
            store.resume_fills()
            # Not awaited: the start is done; reading the manifest and the index is the fill's business.
            threading.Thread(target=_fill, args=(store, ref), name="ember-fill", daemon=True).start()

    def close(self) -> None:
        with self._open_lock:
            store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(EmberError):
                store.close()


def populate_weights(contract: ModelContract, store: StoreConfig | None = None) -> int:
    """Map the resident pages of the contract's mmapped weight files into this process; bytes covered.

    Store-backed weights are views of chunk files in the store's tiers: those mappings are covered.
    """
    roots = [root.resolve() for root in weight_roots(contract, store)]
    if not roots:
        return 0
    covered = 0
    for start, end, path in procinfo.file_mappings():
        mapped = Path(path)
        if not any(mapped == root or root in mapped.parents for root in roots):
            continue
        if LIBC.madvise(start, end - start, MADV_POPULATE_READ) == 0:
            covered += end - start
        else:  # an older kernel: replicas then fault their own views (correct, just less shared)
            logging.getLogger("ember.node").info("madvise(POPULATE_READ) on %s: errno %d", path, ctypes.get_errno())
    return covered
