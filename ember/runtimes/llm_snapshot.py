"""KV-prefix snapshots: the prefix cache's entries as models in the weight store, so that a template or a new
instance starts with them instead of computing them.

A snapshot is one safetensors file pushed under the name `kv-<digest>:1`, where the digest covers the model
file's identity, the engine and its KV type and the token ids: the same prefix of the same weights always has
the same name, and its chunks are content-addressed like any weights (deduplicated, verified, tiered, fetched
from the origin by a node that lacks them). Tensors: `tokens` (int64 [n]) and `state` (uint8: the engine's own
bytes of the sequence's KV, `Context.save`), restored exactly as saved: a restored prefix gives what
recomputing it gives (tests/integration/runtimes/test_llm_snapshots.py measures it).

Which prefixes: those the contract declares (its warmup requests' prompts) and the hottest ones an instance
learned, listed in `<root>/prefixes/<model>.json` when it retires; a later load restores them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ember.errors import EmberError

if TYPE_CHECKING:
    from ember.store.store import WeightStore


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
