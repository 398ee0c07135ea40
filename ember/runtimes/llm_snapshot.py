"""KV-prefix snapshots: the prefix cache's entries as models in the weight store, so that a template or a new
instance starts with them instead of computing them.

A snapshot is one safetensors file pushed under the name `kv-<digest>:1`, where the digest covers the model
file's identity, the engine and its KV type and the token ids: the same prefix of the same weights always has
the same name, and its chunks are content-addressed like any weights (deduplicated, verified, tiered, fetched
from the origin by a node that lacks them). Tensors: `tokens` (int64 [n]) and `state` (uint8: the engine's own
bytes of the sequence's KV, `Context.save`), restored exactly as saved: a restored prefix gives what
recomputing it gives (tests/integration/runtimes/test_llm_snapshots.py measures it).

Which prefixes: those the contract declares (its warmup requests' prompts: named by the GGUF's identity, so every
model on that file shares them) and the hottest ones an instance learned from its own tenant's requests, named and
listed (`<root>/prefixes/<learned id>.json`) under the model's `learned_id`: the GGUF's identity scoped by the
tenant that owns the model and the model's name and version. A later load restores the declared ones and its own
model's learned ones: another tenant's model on the same file, or another server's on a shared store, never
restores what this one learned.

Who writes them: an instance computes the declared ones at load, before its sandbox closes, and pushes them itself.
The learned ones it only knows when it retires, behind a read-only filesystem: it hands them to its node in its
`drained` frame (`Learned.frame`), and the node, which owns the store, keeps them (`keep`, called by
`ember.node.keeping`). An instance outside a node (a test, a script) calls `keep` itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import EmberError, InvalidInput

if TYPE_CHECKING:
    from ember.store.store import WeightStore
    from ember.wire.contract import ModelContract


KIND = "llm-prefixes"   # a `drained` frame's `keep.kind` for learned prefixes
_MODEL_ID = re.compile(r"[^/\x00]{1,80}")   # a file name (learned_id's own shape: the GGUF's stem and digests)
KV_TYPES = ("f16", "q8_0")
MAX_PREFIX_TOKENS = 1 << 20        # a learned prefix handed over: at most this many tokens...
MAX_PREFIX_STATE = 8 << 30         # ...and this many bytes of KV state (an 8B model's 32k-token prefix is ~4 GiB)


@contextlib.contextmanager
def opened(root: Path) -> Iterator[WeightStore]:
    """The weight store at `root`, closed after use: closing joins its threads, so a template may fork."""
    from ember.store.config import StoreConfig
    from ember.store.hashing import one_thread
    from ember.store.store import WeightStore

    with one_thread():   # blake3's pool would outlive the store: a template must fork with one thread
        # keep_memory_tier: a template and its replicas share this root's memory tier; none of them owns it.
        store = WeightStore(StoreConfig.build(root=root, keep_memory_tier=True))
        try:
            yield store
        finally:
            store.close()


def model_id(gguf: Path) -> str:
    """The file's identity (its size and the sha256 of its first MiB): names its snapshots wherever it lives."""
    digest = hashlib.sha256(str(gguf.stat().st_size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(1 << 20))
    return f"{gguf.stem[:40]}-{digest.hexdigest()[:20]}"


def learned_id(model_id: str, contract: ModelContract) -> str:
    """The id `contract`'s learned prefixes go under: the GGUF's `model_id` scoped by the model's tenant (None:
    public), name and version (a digest of them: the id stays a short file name)."""
    scope = "\0".join((contract.tenant or "", contract.name, contract.version))
    return f"{model_id}-{hashlib.sha256(scope.encode()).hexdigest()[:12]}"


def snapshot_name(model_id: str, ids: list[int], kv_type: str) -> str:
    digest = hashlib.sha256(f"{model_id}\0{kv_type}\0".encode() + json.dumps(ids).encode()).hexdigest()
    return f"kv-{digest[:32]}:1"


def save(store: WeightStore, name: str, ids: list[int], state: bytes) -> int:
    """Push one snapshot; the bytes of its file."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {"tokens": np.asarray(ids, dtype=np.int64),
                                      "state": np.frombuffer(state, dtype=np.uint8)}
    with tempfile.TemporaryDirectory(prefix=".kv-", dir=store.root) as tmp:
        path = Path(tmp) / "kv.safetensors"
        save_file(tensors, str(path))
        store.push(path, name)
        return path.stat().st_size


def restore(store: WeightStore, name: str) -> tuple[list[int], bytes] | None:
    """(token ids, KV state) of a stored snapshot; None if the store (and its origin) has none by that name."""
    from safetensors.numpy import load_file

    try:
        root = store.materialize(name, tensors=True)
        tensors = load_file(str(root / "kv.safetensors"))
        return [int(i) for i in tensors["tokens"].tolist()], tensors["state"].tobytes()
    except (EmberError, KeyError, OSError):
        return None


def learned_index(root: Path, model_id: str) -> Path:
    return root / "prefixes" / f"{model_id}.json"


def read_learned(root: Path, model_id: str) -> list[str]:
    """Snapshot names that instances of this model learned and kept, hottest first."""
    try:
        data = json.loads(learned_index(root, model_id).read_text())
    except (OSError, ValueError):
        return []
    names = data.get("snapshots") if isinstance(data, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def write_learned(root: Path, model_id: str, names: list[str]) -> None:
    """Replace the list (atomically: concurrent instances retire; the last one's hottest win)."""
    path = learned_index(root, model_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".prefixes-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"snapshots": names}, f)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class Learned:
    """The hottest prefixes a retiring instance learned, hottest first, for its node to keep in the store at `root`
    (the one the model's loads restore from) under the model's list, which holds at most `limit` names.
    `model_id`: the model's `learned_id` (the frame's `keep.model_id`)."""

    model_id: str
    kv_type: str
    limit: int
    root: Path
    prefixes: tuple[tuple[tuple[int, ...], bytes], ...]

    def frame(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The `keep` field of a `drained` frame, and its tensors (`tokens.I`, `state.I`)."""
        header = {"kind": KIND, "model_id": self.model_id, "kv_type": self.kv_type, "limit": self.limit,
                  "root": str(self.root), "count": len(self.prefixes)}
        tensors: dict[str, np.ndarray] = {}
        for i, (ids, state) in enumerate(self.prefixes):
            tensors[f"tokens.{i}"] = np.asarray(ids, dtype=np.int64)
            tensors[f"state.{i}"] = np.frombuffer(state, dtype=np.uint8)
        return header, tensors

    @classmethod
    def from_frame(cls, keep: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Learned:
        """The inverse of `frame`, checked: InvalidInput naming the field that is wrong."""
        model_id, kv_type, limit, count = (keep.get(k) for k in ("model_id", "kv_type", "limit", "count"))
        if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id) or model_id in (".", ".."):
            raise InvalidInput(f"keep.model_id: {str(model_id)[:100]!r} is not a model id")
        if kv_type not in KV_TYPES:
            raise InvalidInput(f"keep.kv_type: {str(kv_type)[:20]!r} is not one of {', '.join(KV_TYPES)}")
        if not isinstance(limit, int) or not 0 <= limit <= 64:
            raise InvalidInput("keep.limit: an integer 0-64")
        if not isinstance(count, int) or not 0 <= count <= limit or len(tensors) != 2 * count:
            raise InvalidInput("keep.count: 0 to keep.limit, with tokens.I and state.I for each")
        prefixes = []
        for i in range(count):
            ids, state = tensors.get(f"tokens.{i}"), tensors.get(f"state.{i}")
            if ids is None or state is None or ids.dtype != np.int64 or ids.ndim != 1 or state.dtype != np.uint8:
                raise InvalidInput(f"keep: tokens.{i} (int64 [n]) and state.{i} (uint8) are needed")
            if ids.size > MAX_PREFIX_TOKENS or state.nbytes > MAX_PREFIX_STATE:
                raise InvalidInput(f"keep: tokens.{i} at most {MAX_PREFIX_TOKENS} and state.{i} at most "
                                   f"{MAX_PREFIX_STATE >> 30} GiB")
            prefixes.append((tuple(int(t) for t in ids.tolist()), state.tobytes()))
        return cls(model_id, str(kv_type), limit, Path(str(keep.get("root"))), tuple(prefixes))


def keep(learned: Learned) -> int:
    """Push each learned prefix as a snapshot into the store at `learned.root` and put them first in the model's
    list (then those listed before, up to `limit`). The number pushed."""
    if not learned.prefixes:
        return 0
    names = []
    with opened(learned.root) as store:
        for ids, state in learned.prefixes:
            names.append(snapshot_name(learned.model_id, list(ids), learned.kv_type))
            save(store, names[-1], list(ids), state)
    with _list_locked(learned.root, learned.model_id):   # two replicas retiring at once: neither update lost
        kept = [*names, *(n for n in read_learned(learned.root, learned.model_id) if n not in names)]
        write_learned(learned.root, learned.model_id, kept[: learned.limit])
    return len(names)


@contextlib.contextmanager
def _list_locked(root: Path, model_id: str) -> Iterator[None]:
    """An exclusive lock on the model's learned list (flock: across the node's threads and processes)."""
    import fcntl

    path = learned_index(root, model_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
