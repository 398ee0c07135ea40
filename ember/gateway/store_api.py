"""`GET /v2/store/chunks/{digest}`: a node serves the weight-store chunks it holds to its peers (read only).

The peer tier (ember/store/tiers/peer.py) reads it as it reads the HTTP origin: whole chunks or Range parts,
streamed from the chunk file (memory tier first, then disk) in 1 MiB reads; the receiver checks the digest.
Access: admin keys or the cluster token (`Access.PEER`, ember/gateway/auth.py).
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from ember.errors import ChunkNotFound, InvalidInput
from ember.gateway.context import gateway_of
from ember.store.shared import DIGEST, ChunkFile


class ChunkFiles(Protocol):
    def find(self, digest: str) -> ChunkFile | None:
        """The file of a chunk this node holds, or None."""
        ...


class _ChunkResponse(FileResponse):
    chunk_size = 1 << 20   # Starlette's 64 KiB reads cost a thread hop each: ~16x fewer here


async def chunk(request: Request) -> Response:
    digest = request.path_params["digest"]
    if not DIGEST.fullmatch(digest):
        raise InvalidInput(f"digest: must be 64 lowercase hex characters (a blake3 chunk digest), got "
                           f"{digest[:80]!r}")
    files = gateway_of(request).chunks
    found = files.find(digest) if files is not None else None
    if found is None:
        raise ChunkNotFound(f"chunk {digest}: not held by this node")
    return _ChunkResponse(found.path, media_type="application/octet-stream",
                          headers={"Cache-Control": "no-store"})
