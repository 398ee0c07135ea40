"""WeightStore: push models in, find or fetch their chunks through the tiers, promote, single-flight.

A read looks in memory, then disk, then the peers (other nodes that hold the chunk, when the store has a peer
directory), then the origin. A chunk fetched from a peer or the origin lands on disk and is mapped from there;
it, and any chunk found on disk alone, is then copied up to the memory tier behind the load. A chunk becomes
visible in a tier only after its digest was checked on the way in. Within a process one thread fetches a
given chunk while the others wait for it; across processes a lock file per digest bucket does the same;
across nodes a `FetchGate` lets one node at a time pull it from the origin, the others
then fetch it from that node (ember/store/tiers/peer.py).

This module holds the store itself: manifests, push, the look-up across the local tiers, the single flight of
a chunk, the background memory-tier fills and releases, materialized files and housekeeping. The fetch from the
peers and the origin, and the verified copy into a tier that it and the fills share, are its `Fetcher`
(ember/store/fetcher.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ember.errors import ModelNotFound, StoreError
from ember.store.chunking import plan_file
from ember.store.config import StoreConfig
from ember.store.fetcher import Fetcher, origin_tier, peer_tier
from ember.store.files import atomic_write, file_entry, model_files, rel_name
from ember.store.hashing import digest_bytes, digest_file
from ember.store.manifest import Chunk, FileEntry, Manifest, ModelRef
from ember.store.meters import TransferMeters
from ember.store.page_cache import AlignedWriter
from ember.store.threads import started_pool
from ember.store.tiers import Remote, TierUsage
from ember.store.tiers.disk import DiskTier
from ember.store.tiers.files import FileTier, WallClock, copy_range
from ember.store.tiers.memory import MemoryTier
from ember.store.tiers.peer import FetchGate, LocalGate, PeerDirectory, PeerTier

log = logging.getLogger("ember.store")

Progress = Callable[[int], None]

# How long a background memory-tier fill waits for in-flight origin fetches before it runs anyway.
_YIELD_S = 5.0
_READ_STEP = 8 << 20   # a materialized file is copied through a buffer of this size


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierUsage, ...]
    models: int
    logical_bytes: int  # what the models' files add up to
    unique_bytes: int  # what their distinct chunks add up to

    @property
    def dedupe_ratio(self) -> float:
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0


@dataclass(frozen=True)
class GcReport:
    removed_chunks: int
    removed_bytes: int
    removed_temp: int
    corrupt: int


class WeightStore:
    def __init__(self, config: StoreConfig | None = None, *, clock: WallClock | None = None,
                 origin: Remote | None = None, peers: PeerDirectory | PeerTier | None = None,
                 gate: FetchGate | None = None) -> None:
        """`peers` None: the config's static `peers` list, if any (a `PeerTier` as is: tests give fake sources);
        `gate` None: this node alone (`LocalGate`)."""
        self.config = config or StoreConfig()
        self.root = self.config.root
        # The origin first: a missing optional dependency (boto3) fails before any local tier is opened.
        if origin is None and self.config.origin:
            origin = origin_tier(self.config, self.config.origin)
        remote_peers = peer_tier(self.config, peers)
        self.disk = DiskTier(self.root, self.config.disk_capacity, fsync=self.config.fsync, clock=clock)
        self.memory: FileTier | None = None
        self._made_memory_dir: Path | None = None   # removed on close (RAM), unless the config keeps it
        if self.config.memory_enabled and self.config.memory_dir is not None:
            if not self.config.memory_dir.exists():
                self._made_memory_dir = self.config.memory_dir
            self.memory = MemoryTier(self.config.memory_dir, self.config.memory_capacity, clock=clock)
        # Peers, origin and the verified copies into the tiers (ember/store/fetcher.py).
        self.fetcher = Fetcher(self.config, self.disk, self.memory, origin, remote_peers, gate or LocalGate())
        self._inflight: dict[str, Future[FileTier]] = {}
        self._inflight_lock = threading.Lock()
        self.pool = started_pool(self.config.threads, "ember-store")
        self._behind = started_pool(1, "ember-store-disk")
        self._copies: set[Future[None]] = set()
        self._copying: set[str] = set()  # digests with a copy to the memory tier queued
        self._dropped: set[str] = set()  # of those, released from the tier since: their copy is skipped
        self._fetching = 0  # origin fetches in flight in this process
        self._loads = 0  # loads whose prefetch is in flight in this process (pause_fills)
        self._idle = threading.Condition(self._inflight_lock)

    @property
    def origin(self) -> Remote | None:
        return self.fetcher.origin

    @property
    def peers(self) -> PeerTier | None:
        return self.fetcher.peers

    @property
    def gate(self) -> FetchGate:
        return self.fetcher.gate

    @property
    def meters(self) -> TransferMeters:
        """Measured bandwidths (disk, peer, origin) of the copies in."""
        return self.fetcher.meters

    @meters.setter
    def meters(self, meters: TransferMeters) -> None:   # a test measures small transfers from the first byte
        self.fetcher.meters = meters

    @property
    def locals(self) -> list[FileTier]:
        """Local tiers, fastest first."""
        return [t for t in (self.memory, self.disk) if t is not None]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.flush()
        self._behind.shutdown(wait=True)
        self.fetcher.close()
        for tier in self.locals:
            tier.close()
        made, self._made_memory_dir = self._made_memory_dir, None
        if made is not None and not self.config.keep_memory_tier:
            _remove_memory_dir(made)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- manifests -----------------------------------------------------------------------------------------------
    def manifest(self, model: str | ModelRef) -> Manifest:
        """The model's manifest, from the root, else from the origin (then kept in the root)."""
        ref = model if isinstance(model, ModelRef) else ModelRef.parse(model)
        local = self.root / ref.manifest_path
        with contextlib.suppress(FileNotFoundError):
            return Manifest.from_json(local.read_bytes(), str(local))
        if self.origin is not None:
            data = self.origin.fetch(ref.manifest_path)
            if data is not None:
                manifest = Manifest.from_json(data, f"{ref.key} from the origin")
                self._write_manifest(manifest)
                return manifest
        where = f" or origin {self.config.origin}" if self.origin is not None else ""
        raise ModelNotFound(f"weight store {self.root}{where} has no model {ref.key}")

    def peer_manifest(self, ref: ModelRef) -> Manifest | None:
        """The model's manifest from the first peer that holds it (`GET /v2/store/manifests/...`), then kept in the
        root; None when no peer does. Its chunks are fetched as any model's (each checked against its digest)."""
        if self.peers is None:
            return None
        for url, source in self.peers.sources(ref.key):
            fetch = getattr(source, "fetch", None)
            try:
                data = fetch(f"v2/store/{ref.manifest_path}") if fetch is not None else None
            except Exception as err:   # a peer that fails is skipped, as for chunks
                log.info("peer %s: no manifest of %s (%s)", url, ref.key, err)
                continue
            if data is None:
                continue
            try:
                manifest = Manifest.from_json(data, f"{ref.key} from peer {url}")
                if manifest.ref != ref:
                    raise StoreError(f"peer {url} answered {ref.key} with the manifest of {manifest.key}")
            except StoreError as err:   # a bad answer is skipped too: the next peer may hold a good one
                log.warning("weight store: %s", err.message)
                continue
            self._write_manifest(manifest)
            return manifest
        return None

    def remove_manifest(self, ref: ModelRef) -> None:
        """Forget a model here (its chunks stay until `gc`, unless another manifest references them)."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / ref.manifest_path).unlink()
        with self.disk.lock("manifest-index"):
            atomic_write(self.root / "manifests" / "index.json",
                          json.dumps({"models": self.models()}, indent=1).encode())

    def models(self, remote: bool = False) -> list[str]:
        """Keys of the models in the root (and, with `remote`, those the origin lists)."""
        keys = {f"{p.parent.name}:{p.stem}" for p in (self.root / "manifests").glob("*/*.json")}
        if remote and self.origin is not None:
            data = self.origin.fetch("manifests/index.json")
            if data:
                keys |= set(json.loads(data).get("models", []))
        return sorted(keys)

    def _write_manifest(self, manifest: Manifest) -> None:
        path = self.root / manifest.ref.manifest_path
        atomic_write(path, manifest.to_json())
        with self.disk.lock("manifest-index"):
            atomic_write(self.root / "manifests" / "index.json",
                          json.dumps({"models": self.models()}, indent=1).encode())

    def record_load_order(self, model: str | ModelRef, order: list[str]) -> bool:
        """Keep the order a model first read its tensors, for later prefetches; False if one is kept already."""
        manifest = self.manifest(model)
        if manifest.load_order or not order:
            return False
        self._write_manifest(manifest.model_copy(update={"load_order": tuple(order)}))
        return True

    # -- push ----------------------------------------------------------------------------------------------------
    def push(self, path: str | Path, name: str, progress: Progress | None = None) -> Manifest:
        """Cut a file or a directory into chunks, store the new ones (pinned) in the disk tier, write a manifest."""
        ref = ModelRef.parse(name)
        src = Path(path)
        files = model_files(src)
        entries = [self._push_file(f, f.relative_to(src).as_posix() if src.is_dir() else f.name, progress)
                   for f in files]
        order: tuple[str, ...] = ()
        with contextlib.suppress(StoreError, ModelNotFound):  # a re-push of the same tensors keeps the load order
            old = self.manifest(ref)
            if set(old.tensor_entries()) == {t for e in entries for t in e.tensors}:
                order = old.load_order
        manifest = Manifest(name=ref.name, version=ref.version, files=tuple(entries), load_order=order)
        self._write_manifest(manifest)
        return manifest

    def _push_file(self, path: Path, rel: str, progress: Progress | None) -> FileEntry:
        plan = plan_file(path, self.config.file_chunk_size)
        if plan.size == 0:
            return file_entry(rel, plan, [])
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                chunks = list(self.pool.map(
                    lambda span: self._push_span(f.fileno(), view[span.start : span.end], span.start, progress),
                    plan.spans))
            finally:
                view.release()
        return file_entry(rel, plan, chunks)

    def _push_span(self, fd: int, data: memoryview, start: int, progress: Progress | None) -> Chunk:
        size = len(data)
        chunk = Chunk(digest=digest_bytes(data), size=size)
        data.release()
        if not self.disk.present([chunk]):
            if not self.disk.reserve(size, set()):
                raise StoreError(f"disk tier {self.root} is full (capacity {self.disk.capacity} bytes)")
            pending = self.disk.begin(chunk)
            try:
                copy_range(fd, pending.fd, size, src_offset=start)
                if digest_file(pending.tmp) != chunk.digest:
                    raise StoreError(f"{rel_name(fd)} changed while it was pushed")
            except BaseException:
                self.disk.abort(pending)
                raise
            self.disk.commit(pending, pinned=True)
        else:
            self.disk.pin([chunk])
        if progress is not None:
            progress(size)
        return chunk

    # -- reading -------------------------------------------------------------------------------------------------
    def locate(self, chunks: Iterable[Chunk], model: str = "", protect: set[str] | None = None) -> dict[str, FileTier]:
        """The fastest local tier holding each chunk intact (chunks held by none are left out).

        A chunk found on disk but not in memory is copied up to the memory tier behind the caller, who maps the
        disk copy meanwhile; making room for it there evicts none of `protect` (the chunks of the loads in flight).
        """
        wanted = {c.digest: c for c in chunks}
        remaining = dict(wanted)
        found: dict[str, FileTier] = {}
        for tier in self.locals:
            if not remaining:
                break
            for digest in tier.present(remaining.values()):
                found[digest] = tier
                del remaining[digest]
        if self.memory is not None and self.config.promote_from_disk:
            on_disk = [wanted[d] for d, tier in found.items() if tier is self.disk]
            if on_disk:
                self._copy_up_later(on_disk, model, protect or set())
        return found

    def ensure(self, chunk: Chunk, model: str, protect: set[str] | None = None) -> FileTier:
        """Bring a chunk into a local tier (one thread per chunk, the others wait); return the tier to map it from."""
        with self._inflight_lock:
            fut = self._inflight.get(chunk.digest)
            owner = fut is None
            if fut is None:
                fut = self._inflight[chunk.digest] = Future()
        if not owner:
            return fut.result()
        try:
            tier = self._bring(chunk, model, protect or set())
            fut.set_result(tier)
            return tier
        except BaseException as err:
            fut.set_exception(err)
            raise
        finally:
            with self._inflight_lock:
                del self._inflight[chunk.digest]

    def _bring(self, chunk: Chunk, model: str, protect: set[str]) -> FileTier:
        found = self.locate([chunk], model, protect)
        if chunk.digest in found:
            return found[chunk.digest]
        with self.disk.lock(chunk.digest):  # another process may be fetching it: wait, then look again
            found = self.locate([chunk], model, protect)
            if chunk.digest in found:
                return found[chunk.digest]
            return self._fetch(chunk, model, protect)

    def _fetch(self, chunk: Chunk, model: str, protect: set[str]) -> FileTier:
        """From a peer or the origin into the disk tier, then up to the memory tier behind the load.

        While the load runs both tiers are RAM (page cache, tmpfs). On the 2-core VM of docs/store.md, writing
        each byte into both in line halved the fetch rate, and tmpfs took writes slower than ext4's page cache;
        so the load maps the disk copy and the memory tier fills behind it.
        """
        with self._idle:
            self._fetching += 1
        try:
            moved = self.fetcher.remote(chunk, model, protect)
        finally:
            with self._idle:
                self._fetching -= 1
                self._idle.notify_all()
        if moved is self.disk and self.memory is not None and self.config.promote_from_disk:
            self._copy_up_later([chunk], model, protect)
        return moved

    def fetched_bytes(self) -> dict[str, int]:
        """Chunk bytes this store landed from each source (`ember.store.fetcher.SOURCES`) since it was built."""
        return self.fetcher.fetched_bytes()

    def _copy_up_later(self, chunks: list[Chunk], model: str, protect: set[str]) -> None:
        """Copy chunks from disk up to the memory tier in the background, one task for the lot (one submit on
        the caller's path, not one per chunk)."""
        with self._inflight_lock:
            self._dropped.difference_update(c.digest for c in chunks)   # wanted again: a queued copy goes ahead
            todo = [c for c in chunks if c.digest not in self._copying]
            if not todo:
                return
            self._copying.update(c.digest for c in todo)
            self._copies.add(self._behind.submit(self._copy_up, todo, model, protect))

    def _copy_up(self, chunks: list[Chunk], model: str, protect: set[str]) -> None:
        memory = self.memory
        for chunk in chunks:
            # A cache fill yields to the fetches and page-ins of the loads in flight, which it would slow down
            # (a kernel copy and a hash per chunk); bounded, so it cannot starve.
            with self._idle:
                self._idle.wait_for(lambda: self._fetching == 0 and self._loads == 0, timeout=_YIELD_S)
            try:
                if memory is not None:
                    with memory.lock(chunk.digest):
                        if not self._was_dropped(chunk.digest) and not memory.present([chunk]) \
                                and self.disk.present([chunk]):
                            self.fetcher.move(chunk, model, self.disk, [memory], protect)
            except Exception as err:  # a cache fill that failed costs a copy later, nothing more
                log.warning("model %s: chunk %s not copied to memory: %s", model, chunk.digest, err)
            finally:
                with self._inflight_lock:
                    self._copying.discard(chunk.digest)
                    self._dropped.discard(chunk.digest)

    def _was_dropped(self, digest: str) -> bool:
        with self._inflight_lock:
            return digest in self._dropped

    def pause_fills(self) -> None:
        """A load's prefetch starts: memory-tier fills wait until every pause is resumed (see _copy_up)."""
        with self._idle:
            self._loads += 1

    def resume_fills(self) -> None:
        with self._idle:
            self._loads -= 1
            self._idle.notify_all()

    def flush(self) -> None:
        """Wait until every chunk fetched so far has also reached the memory tier."""
        while True:
            with self._inflight_lock:
                self._copies = {f for f in self._copies if not f.done()}
                pending = list(self._copies)
            if not pending:
                return
            for fut in pending:
                fut.result()

    def pull(self, model: str, progress: Progress | None = None) -> Manifest:
        """Fetch every chunk of a model into the local tiers; return once each is verified in one. Fetched
        chunks land on disk and are copied up to the memory tier behind the caller (`flush` waits for that)."""
        manifest = self.manifest(model)
        # Largest first: a large chunk started last would run alone on one connection after all the others.
        chunks = sorted(manifest.unique_chunks().values(), key=lambda c: -c.size)
        protect = {c.digest for c in chunks}

        def one(chunk: Chunk) -> None:
            self.ensure(chunk, manifest.key, protect)
            if progress is not None:
                progress(chunk.size)

        self.pause_fills()   # not between two fetches either: the fill would take the cores they need
        try:
            list(self.pool.map(one, chunks))
        finally:
            self.resume_fills()
        return manifest

    def fill(self, model: str) -> None:
        """Copy the model's chunks held on disk alone up to the memory tier, behind the caller (`flush` waits),
        whatever `promote_from_disk` says: a node fills the tier for the instances it starts."""
        if self.memory is None:
            return
        manifest = self.manifest(model)
        chunks = list(manifest.unique_chunks().values())
        held = self.memory.indexed(chunks)   # each copy checks again under the chunk's lock
        self._copy_up_later([c for c in chunks if c.digest not in held], manifest.key, {c.digest for c in chunks})

    def release_memory(self, model: str, keep: Collection[str] = ()) -> int:
        """Remove the model's chunks from the memory tier, except those in `keep` (digests other models still
        want there), and return the bytes removed: its keep-alive plan keeps nothing of it. Only chunks the disk
        tier holds too go (the next load reads them from there, and fills the tier again behind it); a copy up
        queued for one is skipped. Each chunk goes under its lock, as a copy up takes it. A process that mapped
        a chunk keeps its pages (tmpfs frees an unlinked file's pages once the last mapping goes)."""
        memory = self.memory
        if memory is None:
            return 0
        chunks = [c for d, c in self.manifest(model).unique_chunks().items() if d not in keep]
        with self._inflight_lock:
            queued = {c.digest for c in chunks if c.digest in self._copying}
            self._dropped |= queued
        held = memory.indexed(chunks) | queued   # a copy under way is done once its lock is ours
        on_disk = self.disk.indexed(chunks)       # one query, not one per chunk
        freed = 0
        for chunk in chunks:
            if chunk.digest in held and chunk.digest in on_disk:
                with memory.lock(chunk.digest):
                    if memory.indexed([chunk]):
                        freed += memory.drop([chunk.digest])
        return freed

    # -- files ---------------------------------------------------------------------------------------------------
    def materialize(self, model: str, *, tensors: bool = False) -> Path:
        """A directory holding the model's files: its non-tensor files, and its safetensors files with `tensors`."""
        manifest = self.manifest(model)
        kind = "all" if tensors else "files"
        target = self.root / "models" / manifest.name / manifest.version / kind
        stamp = digest_bytes(manifest.model_copy(update={"load_order": ()}).to_json())
        marker = target / ".ember-manifest"
        with contextlib.suppress(FileNotFoundError):
            if marker.read_text() == stamp:
                return target
        with self.disk.lock(f"materialize-{manifest.key}"):
            with contextlib.suppress(FileNotFoundError):
                if marker.read_text() == stamp:
                    return target
            build = target.with_name(f".{kind}.{os.getpid()}.{os.urandom(4).hex()}")
            try:
                for entry in manifest.files:
                    if entry.kind != "safetensors" or tensors:
                        self._write_file(manifest, entry, build / entry.path)
                (build / ".ember-manifest").write_text(stamp)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(build, target)
            except OSError as err:
                raise StoreError(f"model {manifest.key}: cannot materialize into {target}: {err}") from None
            finally:
                shutil.rmtree(build, ignore_errors=True)
        return target

    def _write_file(self, manifest: Manifest, entry: FileEntry, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        protect = {c.digest for c in entry.chunks}
        # Written in aligned 2 MiB pieces (not copy_file_range): the page cache then holds the file in 2 MiB folios,
        # which processes that map it (llama.cpp's GGUF) map with a 512th of the faults (ember/store/page_cache.py).
        with open(path, "wb") as out:
            writer = AlignedWriter(out.fileno())
            for chunk in entry.chunks:
                tier = self.ensure(chunk, manifest.key, protect)
                src = os.open(tier.path(chunk.digest), os.O_RDONLY)
                try:
                    for start in range(0, chunk.size, _READ_STEP):
                        data = os.pread(src, min(_READ_STEP, chunk.size - start), start)
                        if len(data) != min(_READ_STEP, chunk.size - start):
                            raise StoreError(f"model {manifest.key}: chunk {chunk.digest} is shorter than "
                                             f"{chunk.size} B in the {tier.name} tier")
                        writer.write(data)
                finally:
                    os.close(src)
            writer.close()

    # -- housekeeping --------------------------------------------------------------------------------------------
    def _local_manifests(self) -> Iterator[Manifest]:
        for key in self.models():
            with contextlib.suppress(StoreError, ModelNotFound):
                yield self.manifest(key)

    def gc(self, verify: bool = False) -> GcReport:
        """Drop chunks no local manifest references and temp files of dead processes; with `verify`, re-hash all."""
        self.flush()
        referenced = {d for m in self._local_manifests() for d in m.unique_chunks()}
        chunks = bytes_ = temp = corrupt = 0
        for tier in self.locals:
            temp += tier.clean()
            if verify:
                corrupt += len(tier.scrub())
            stale = tier.digests() - referenced
            for digest in stale:
                with contextlib.suppress(OSError):
                    bytes_ += os.stat(tier.path(digest)).st_size
            chunks += tier.remove(stale)
        return GcReport(chunks, bytes_, temp, corrupt)

    def stats(self) -> StoreStats:
        manifests = list(self._local_manifests())
        unique: dict[str, int] = {}
        for m in manifests:
            unique.update({d: c.size for d, c in m.unique_chunks().items()})
        tiers = tuple(t.usage() for t in self.locals)
        return StoreStats(tiers, len(manifests), sum(m.logical_bytes for m in manifests), sum(unique.values()))


def _remove_memory_dir(path: Path) -> None:
    """The memory tier is RAM that outlives the process (tmpfs): leaving it behind after every run leaks it."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("memory tier %s not removed: %s", path, err.strerror or err)

