"""Files around the store: a pushed model's files and their manifest entries, atomic writes (manifests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ember.errors import InvalidInput, StoreError
from ember.store.chunking import FilePlan
from ember.store.manifest import Chunk, FileEntry, TensorEntry


def model_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise InvalidInput(f"push: {src} is neither a file nor a directory")
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()
                   and not any(part.startswith(".") for part in p.relative_to(src).parts))
    if not files:
        raise InvalidInput(f"push: {src} holds no files")
    return files


def file_entry(rel: str, plan: FilePlan, chunks: list[Chunk]) -> FileEntry:
    index = {span.tensor: i for i, span in enumerate(plan.spans) if span.tensor is not None}
    tensors = {name: TensorEntry(dtype=t.dtype, shape=t.shape, chunk=index.get(name))
               for name, t in plan.tensors.items()}
    return FileEntry(path=rel, size=plan.size, kind=plan.kind, chunks=tuple(chunks), tensors=tensors,
                     metadata=plan.metadata)


def rel_name(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}")
    return f"fd {fd}"


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise StoreError(f"cannot write {path}: {err.strerror}") from None
