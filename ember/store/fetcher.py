"""Fetcher: brings a chunk's bytes into the local tiers, verified on the way in.

Two paths, one copy: a chunk missing locally comes from the peers (other nodes that hold it) or the origin,
one node at a time under the cluster's `FetchGate` (the others then fetch it from that node,
ember/store/tiers/peer.py), and lands on disk (in memory when the disk has no room); a chunk already on disk is
copied up to the memory tier by the same verified copy (`move`). Bytes whose digest does not match are never
made visible: a bad local copy is removed and fetched again from the origin, a bad peer copy is skipped for the
next holder, a bad origin copy is an error.

`WeightStore` (ember/store/store.py) owns one and delegates to it; the in-process single flight of a chunk, the
look-up across tiers and the background memory-tier fills stay there. This module imports nothing of the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from ember.errors import ChunkCorrupt, StoreError
from ember.store.config import StoreConfig
from ember.store.hashing import digest_file
from ember.store.manifest import Chunk
from ember.store.meters import TransferMeters
from ember.store.tiers import Remote, Source
from ember.store.tiers.disk import DiskTier
from ember.store.tiers.files import FileTier
from ember.store.tiers.http import HttpTier
from ember.store.tiers.peer import FetchGate, LocalGate, PeerDirectory, PeerTier, StaticPeers
from ember.tls import NodeTls

log = logging.getLogger("ember.store")

# Peers, then the gate, then a wait for the lease holder: at most this many times before the origin regardless.
_GATE_ROUNDS = 3
_CORRUPT: Literal["corrupt"] = "corrupt"
SOURCES = ("peer", "origin")   # where fetched bytes came from (the `source` label of the fetched-bytes metric)


class Fetcher:
    """Verified copies into the local tiers, from the peers, the origin, or another local tier."""

    def __init__(self, config: StoreConfig, disk: DiskTier, memory: FileTier | None, origin: Remote | None,
                 peers: PeerTier | None, gate: FetchGate) -> None:
        self.config = config
        self.disk = disk
        self.memory = memory
        self.origin = origin
        self.peers = peers
        self.gate = gate
        self.meters = TransferMeters()   # measured bandwidths (disk, peer, origin) of the copies in
        self._fetched = dict.fromkeys(SOURCES, 0)   # bytes landed from each source by this store
        self._lock = threading.Lock()

    @property
    def locals(self) -> list[FileTier]:
        """Local tiers, fastest first."""
        return [t for t in (self.memory, self.disk) if t is not None]

    def close(self) -> None:
        closer = getattr(self.origin, "close", None)
        if closer is not None:
            closer()
        if self.peers is not None:
            self.peers.close()

    def fetched_bytes(self) -> dict[str, int]:
        """Chunk bytes landed from each source (`SOURCES`) since this fetcher was built."""
        with self._lock:
            return dict(self._fetched)

    def remote(self, chunk: Chunk, model: str, protect: set[str]) -> FileTier:
        """Peers first; the origin under the cluster's lease; while another node holds it, wait and ask again."""
        if self.peers is None:
            return self._from_origin(chunk, model, protect)
        for _ in range(_GATE_ROUNDS):
            moved = self._from_peers(self.peers, chunk, model, protect)
            if moved is not None:
                return moved
            lease = self.gate.acquire(chunk.digest)
            if lease is not None:
                landed = False
                try:
                    # Asked once more (a cluster gate): a holder may have landed it and let go of its lease
                    # between our first question and our acquire.
                    again = None if isinstance(self.gate, LocalGate) else self._from_peers(
                        self.peers, chunk, model, protect)
                    moved = again or self._from_origin(chunk, model, protect)
                    landed = True
                    return moved
                finally:
                    self.gate.release(lease, landed)
            self.gate.wait(chunk.digest, self.config.peer_wait_s)
        log.warning("model %s: chunk %s: another node's origin fetch did not land it; fetching it too",
                    model, chunk.digest)
        return self._from_origin(chunk, model, protect)

    def _from_peers(self, peers: PeerTier, chunk: Chunk, model: str, protect: set[str]) -> FileTier | None:
        """The chunk from the first holder that has it intact; None when none does."""
        for url, source in peers.sources(chunk.digest):
            try:
                got = self._land(chunk, source, protect)
            except StoreError as err:   # not there (evicted, never had it), unreachable, dropped: the next one
                log.info("model %s: chunk %s not fetched from peer %s: %s", model, chunk.digest, url, err)
                peers.note_failed()
                continue
            if got == _CORRUPT:
                log.warning("model %s: chunk %s from peer %s fails its hash check", model, chunk.digest, url)
                peers.note_rejected()
                continue
            return self._landed(chunk, model, got, "peer")
        return None

    def _from_origin(self, chunk: Chunk, model: str, protect: set[str]) -> FileTier:
        if self.origin is None:
            raise StoreError(f"model {model}: chunk {chunk.digest} is in no tier (root {self.config.root}, no origin)")
        got = self._land(chunk, self.origin, protect)
        if got == _CORRUPT:
            self._corrupt_in(chunk, model, self.origin, [], protect)   # raises: the origin is the last resort
        return self._landed(chunk, model, got, "origin")

    def _land(self, chunk: Chunk, source: Source, protect: set[str]) -> FileTier | Literal["corrupt"] | None:
        """Into the disk tier, or straight to memory when the disk has no room."""
        got = self._copy_in(chunk, source, [self.disk], protect)
        if got is None and self.memory is not None:
            got = self._copy_in(chunk, source, [self.memory], protect)
        return got

    def _landed(self, chunk: Chunk, model: str, got: FileTier | Literal["corrupt"] | None, source: str) -> FileTier:
        if got is None or got == _CORRUPT:
            raise StoreError(f"model {model}: no local tier has room for chunk {chunk.digest} ({chunk.size} B)")
        with self._lock:
            self._fetched[source] += chunk.size
        return got

    def move(self, chunk: Chunk, model: str, source: Source, dests: list[FileTier],
             protect: set[str]) -> FileTier | None:
        """Copy a chunk from `source` into every dest with room, verify it, then make it visible; None: no room."""
        got = self._copy_in(chunk, source, dests, protect)
        if got == _CORRUPT:
            return self._corrupt_in(chunk, model, source, dests, protect)
        return got

    def _copy_in(self, chunk: Chunk, source: Source, dests: list[FileTier],
                 protect: set[str]) -> FileTier | Literal["corrupt"] | None:
        """As `move`, but bad bytes are "corrupt" (nothing was made visible) for the caller to decide."""
        dests = [d for d in dests if d.reserve(chunk.size, protect | {chunk.digest})]
        if not dests:
            return None
        pendings = [d.begin(chunk) for d in dests]
        good = False
        self.meters.begin(source.name)
        try:
            got = source.copy_to(chunk, [p.fd for p in pendings])
            good = (got or digest_file(pendings[0].tmp)) == chunk.digest
        except BaseException:
            for d, p in zip(dests, pendings, strict=True):
                d.abort(p)
            raise
        finally:
            self.meters.end(source.name, chunk.size if good else 0)
        if not good:
            for d, p in zip(dests, pendings, strict=True):
                d.abort(p)
            return _CORRUPT
        for d, p in zip(dests, pendings, strict=True):
            d.commit(p)
        return dests[0]

    def _corrupt_in(self, chunk: Chunk, model: str, source: Source, dests: list[FileTier],
                    protect: set[str]) -> FileTier | None:
        log.warning("model %s: chunk %s from the %s tier fails its hash check", model, chunk.digest, source.name)
        if isinstance(source, FileTier):
            source.remove([chunk.digest])
            source.note_corrupt()
            if self.origin is not None:
                return self.move(chunk, model, self.origin, self.locals, protect)
        raise ChunkCorrupt(f"model {model}: chunk {chunk.digest} is corrupt in the {source.name} tier "
                           "and no other tier holds a good copy")


def origin_tier(config: StoreConfig, url: str) -> Remote:
    """The remote tier for the origin URL's scheme (validated by StoreConfig: http, https or s3)."""
    make: Callable[..., Remote] = HttpTier
    if url.startswith("s3://"):
        from ember.store.tiers.s3 import S3Tier  # boto3 is optional: imported only for an s3 origin

        make = S3Tier
    return make(url, timeout_s=config.origin_timeout_s, part_size=config.part_size, threads=config.threads)


def peer_tier(config: StoreConfig, peers: PeerDirectory | PeerTier | None) -> PeerTier | None:
    """`peers` None: the config's static `peers` list, if any; a `PeerTier` as is (tests give fake sources)."""
    if peers is None and config.peers:
        peers = StaticPeers(config.peers)
    if isinstance(peers, PeerTier) or peers is None:
        return peers
    tls = NodeTls.of(config.peer_tls_dir).client_context() if config.peer_tls_dir is not None else None
    return PeerTier(peers, token=config.peer_token, timeout_s=config.peer_timeout_s, part_size=config.part_size,
                    threads=config.threads, tls=tls)
