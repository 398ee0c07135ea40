"""open_tensors: a model's tensors as zero-copy views of mapped chunk files, fetched lazily, prefetched in order.

Opening returns once the manifest is read. A tensor's chunk is brought into a local tier the first time the
tensor is read; meanwhile a background prefetch brings every other chunk in the order the model read them on
its first load (kept in the manifest) and pages them in with MADV_POPULATE_READ, in parallel and without a
copy. Each chunk file is mapped private (copy on write): the model may write to its tensors, the store's
bytes never change, and every process of a node shares the same page-cache or tmpfs pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future

import torch

from ember.errors import StoreError
from ember.store.manifest import Chunk, Manifest, TensorEntry
from ember.store.page_cache import LIBC, MADV_POPULATE_READ
from ember.store.store import WeightStore
from ember.store.tiers.files import FileTier

log = logging.getLogger("ember.store")

# Small steps: populating holds the mmap lock, which a concurrent mmap() (the next view) waits for.
_POPULATE_STEP = 8 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


def _map(path: str, size: int) -> mmap.mmap:
    """A private (copy-on-write) mapping of a chunk file: writable for torch, never written back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def populate(mapped: mmap.mmap, size: int) -> None:
    """Page a mapping in (reading the file where it is not cached) without copying it.

    madvise through ctypes, because ctypes lets go of the GIL during the call and mmap.madvise does not:
    several prefetch threads then keep several reads in flight.
    """
    anchor = ctypes.c_char.from_buffer(mapped)
    base = ctypes.addressof(anchor)
    try:
        for start in range(0, size, _POPULATE_STEP):
            length = min(_POPULATE_STEP, size - start)
            if LIBC.madvise(base + start, length, MADV_POPULATE_READ) != 0:  # kernel < 5.14: ask for readahead
                LIBC.madvise(base + start, length, mmap.MADV_WILLNEED)
    finally:
        del anchor


class TensorMap(Mapping[str, torch.Tensor]):
    """The tensors of one model; iteration follows the recorded load order."""

    def __init__(self, store: WeightStore, manifest: Manifest, *, prefetch: bool = True, record: bool = True) -> None:
        self.store = store
        self.manifest = manifest
        self._entries = manifest.tensor_entries()
        self._chunks = manifest.tensor_chunks()
        self._order = manifest.ordered_tensors()
        self._protect = {c.digest for c in self._chunks.values() if c is not None}
        self._lock = threading.Lock()
        self._located: dict[str, FileTier] | None = None
        self._locate_lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._built: dict[str, torch.Tensor] = {}  # views made when the chunks were located, not read yet
        self._tensors: dict[str, torch.Tensor] = {}  # views read
        self._first_reads: list[str] = []
        self._record = record and not manifest.load_order
        self._prefetch: list[Future[None]] = []
        self._submitted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if not prefetch:
            self._submitted.set()
        else:
            store.pause_fills()  # resumed when the prefetch ends: copies to the memory tier wait for the load
            self._thread = threading.Thread(target=self._prefetch_all, name="ember-prefetch", daemon=True)
            try:
                self._thread.start()
            except BaseException:
                store.resume_fills()
                raise

    # -- Mapping -------------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is not None:
            return tensor
        entry = self._entries[name]
        self._locate()
        tensor = self._built.get(name)
        if tensor is None:
            tensor = self._view(name, entry, self._chunks[name])
        with self._lock:
            if name not in self._tensors:
                self._tensors[name] = tensor
                self._first_reads.append(name)
                complete = len(self._first_reads) == len(self._entries)
            else:
                return self._tensors[name]
        if complete and self._record:
            self._record = False
            self._save_order()
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    # -- views ---------------------------------------------------------------------------------------------------
    def _view(self, name: str, entry: TensorEntry, chunk: Chunk | None) -> torch.Tensor:
        dtype, count = self._layout(name, entry, chunk)
        if chunk is None or count == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(self._mapping(chunk), dtype=dtype, count=count).view(entry.shape)

    def _layout(self, name: str, entry: TensorEntry, chunk: Chunk | None) -> tuple[torch.dtype, int]:
        """The tensor's torch dtype and element count, checked against its chunk's size."""
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise StoreError(f"model {self.manifest.key}: tensor {name!r} has dtype {entry.dtype}, unknown to torch")
        count = 1
        for dim in entry.shape:
            count *= dim
        if chunk is not None and count and chunk.size != count * dtype.itemsize:
            raise StoreError(f"model {self.manifest.key}: tensor {name!r} is {chunk.size} bytes, "
                             f"its shape needs {count * dtype.itemsize}")
        return dtype, count

    def _mapping(self, chunk: Chunk) -> mmap.mmap:
        mapped = self._maps.get(chunk.digest)
        if mapped is not None:
            return mapped
        tier = self._locate().get(chunk.digest) or self.store.ensure(chunk, self.manifest.key, self._protect)
        try:
            mapped = _map(tier.path(chunk.digest), chunk.size)
        except OSError as err:  # evicted between locate and open: bring it back once
            log.info("chunk %s left the %s tier (%s); fetching it again", chunk.digest, tier.name, err.strerror)
            with self._lock:
                if self._located is not None:
                    self._located.pop(chunk.digest, None)
            tier = self.store.ensure(chunk, self.manifest.key, self._protect)
            mapped = _map(tier.path(chunk.digest), chunk.size)
        with self._lock:
            return self._maps.setdefault(chunk.digest, mapped)

    def _locate(self) -> dict[str, FileTier]:
        """Where the chunks are, looked up once for all of them (one index query and a stat per chunk); in the
        same step every local chunk is mapped and every tensor on one gets its view.

        One thread does this while the others wait for it (without the GIL), and the prefetch pages chunks in
        only afterwards. When the reader made its views while the prefetch mapped the same chunks and paged
        them in, both mapped most chunks, and every mmap() waited for the mmap lock that the page-ins held.
        """
        located = self._located
        if located is None:
            with self._locate_lock:  # one thread looks, the others wait for its answer
                if self._located is None:
                    chunks = {c.digest: c for c in self._chunks.values() if c is not None}
                    found = self.store.locate(chunks.values(), self.manifest.key, self._protect)
                    self._open_local(found)
                    self._located = found
                located = self._located
        return located

    def _open_local(self, found: dict[str, FileTier]) -> None:
        """Map every chunk a local tier holds and build the views on them, in load order. A chunk that left its
        tier meanwhile is dropped from `found` (it is fetched when read); a tensor with a bad layout gets no view
        here (reading it raises)."""
        maps: dict[str, mmap.mmap] = {}
        built: dict[str, torch.Tensor] = {}
        for name in self._order:
            chunk = self._chunks[name]
            if chunk is None or chunk.digest not in found:
                continue
            mapped = maps.get(chunk.digest)
            if mapped is None:
                try:
                    mapped = maps[chunk.digest] = _map(found[chunk.digest].path(chunk.digest), chunk.size)
                except OSError:
                    del found[chunk.digest]
                    continue
            with contextlib.suppress(StoreError):
                dtype, count = self._layout(name, self._entries[name], chunk)
                if count:
                    built[name] = torch.frombuffer(mapped, dtype=dtype, count=count).view(self._entries[name].shape)
        with self._lock:
            for digest, mapped in maps.items():
                self._maps.setdefault(digest, mapped)
        self._built = built

    # -- prefetch ------------------------------------------------------------------------------------------------
    def _prefetch_all(self) -> None:
        try:
            self._start_prefetch()
        except Exception as err:  # a failed prefetch only costs speed: each read brings its own chunk
            log.warning("model %s: prefetch stopped: %s", self.manifest.key, err)
        finally:
            self._submitted.set()
            self.store.resume_fills()

    def _start_prefetch(self) -> None:
        # Chunks already in the memory tier need nothing more: they are in RAM, and mapped by _locate.
        located = self._locate()
        in_memory = {d for d, tier in located.items() if tier is self.store.memory}
        seen: set[str] = set()
        ordered: list[Chunk] = []
        for name in self._order:
            chunk = self._chunks[name]
            if chunk is not None and chunk.digest not in seen and chunk.digest not in in_memory:
                seen.add(chunk.digest)
                ordered.append(chunk)
        # Every local chunk is mapped and its views exist by now (_locate): paging in holds the mmap lock and
        # takes CPU time, and would slow the views down if it ran beside them. Submitted without holding
        # self._lock, which a reader takes for each first read; a chunk submitted after close() is skipped.
        futures: list[Future[None]] = []
        with contextlib.suppress(RuntimeError):  # the store was closed meanwhile
            for chunk in ordered:
                if self._closed:
                    break
                futures.append(self.store.pool.submit(self._bring_in, chunk))
        with self._lock:
            self._prefetch = futures
            self._submitted.set()
            if self._closed:
                for fut in futures:
                    fut.cancel()
        for fut in self._prefetch:
            with contextlib.suppress(BaseException):
                fut.result()
        for tier in self.store.locals:
            with contextlib.suppress(StoreError):
                tier.touch(d for d in seen | in_memory if located.get(d) is tier)

    def _bring_in(self, chunk: Chunk) -> None:
        if self._closed:
            return
        mapped = self._mapping(chunk)
        # A memory-tier chunk is in RAM already; one mapped from disk may still have to be read.
        if self._locate().get(chunk.digest) is not self.store.memory:
            populate(mapped, chunk.size)

    def wait(self, timeout: float | None = None) -> TensorMap:
        """Block until every chunk is local and paged in (with prefetch on); raise the first prefetch error.

        Also waits for the prefetch thread to end (it only marks the chunks used): until then it holds this
        map, so a map dropped right after wait() would otherwise be torn down (every chunk unmapped) in that
        thread, at a moment nobody chose, e.g. during the next load.
        """
        self._submitted.wait(timeout)
        for fut in list(self._prefetch):
            fut.result(timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return self

    def _save_order(self) -> None:
        try:
            self.store.record_load_order(self.manifest.ref, list(self._first_reads))
        except StoreError as err:
            log.warning("model %s: could not record its load order: %s", self.manifest.key, err)

    def close(self) -> None:
        """Stop prefetching and keep the load order seen so far (if none is kept yet); views stay valid."""
        with self._lock:
            self._closed = True
            for fut in self._prefetch:
                fut.cancel()
            record, self._record = self._record and bool(self._first_reads), False
        if record:
            self._save_order()

    def to_device(self, device: str | torch.device, **options: int) -> dict[str, torch.Tensor]:
        from ember.store.gpu import load_to_device

        return load_to_device(self, torch.device(device), **options)


def open_tensors(model: str, *, store: WeightStore | None = None, prefetch: bool = True) -> TensorMap:
    """The tensors of a pushed model (`name:version`), as a lazy read-only-at-rest Mapping of zero-copy views.

    Without `store`, one is built from the default `StoreConfig` ($EMBER_STORE or ~/.cache/ember/store).
    """
    store = store or _default_store()
    return TensorMap(store, store.manifest(model), prefetch=prefetch)


_default: WeightStore | None = None
_default_lock = threading.Lock()


def _default_store() -> WeightStore:
    global _default
    with _default_lock:
        if _default is None:
            _default = WeightStore()
        return _default

