"""KV-prefix snapshots: the prefix cache's entries as models in the weight store, so that a template or a new
instance starts with them instead of computing them.

A snapshot is one safetensors file pushed under the name `kv-<digest>:1`, where the digest covers the
converted model (its directory's name carries the GGUF's key and the dtype), the snapshot's encoding and the
token ids: the same prefix of the same weights always has the same name, and its chunks are content-addressed
like any weights (deduplicated, verified, tiered, fetched from the origin by a node that lacks them). Tensors:
`tokens` (int64 [n]) and either `kv` ([layers, 2, kv_heads, n, head_dim], the model's dtype; restored as a
view of the mapped chunk, no copy) or `kv_int8` with `kv_scale` (one float32 scale per channel: per layer,
key/value, head and head dimension, over the tokens), dequantised when restored.

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
from typing import TYPE_CHECKING, Literal

from ember.errors import EmberError

if TYPE_CHECKING:
    import torch

    from ember.store.store import WeightStore

Encoding = Literal["float32", "int8"]


def snapshot_name(model_id: str, ids: list[int], encoding: Encoding) -> str:
    digest = hashlib.sha256(f"{model_id}\0{encoding}\0".encode() + json.dumps(ids).encode()).hexdigest()
    return f"kv-{digest[:32]}:1"


def quantise(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 per channel: each (layer, key/value, head, dimension) over the tokens, symmetric, with its scale."""
    import torch

    scale = kv.float().abs().amax(dim=3, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(kv.float() / scale).clamp(-127, 127).to(torch.int8), scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def save(store: WeightStore, name: str, ids: list[int], kv: torch.Tensor, encoding: Encoding) -> int:
    """Push one snapshot; the bytes of its file."""
    import torch
    from safetensors.torch import save_file

    tensors = {"tokens": torch.tensor(ids, dtype=torch.int64)}
    if encoding == "int8":
        tensors["kv_int8"], tensors["kv_scale"] = quantise(kv)
    else:
        tensors["kv"] = kv.contiguous()
    with tempfile.TemporaryDirectory(prefix=".kv-", dir=store.root) as tmp:
        path = Path(tmp) / "kv.safetensors"
        save_file(tensors, str(path))
        store.push(path, name)
        return path.stat().st_size


def restore(store: WeightStore, name: str, dtype: torch.dtype) -> tuple[list[int], torch.Tensor] | None:
    """(token ids, KV) of a stored snapshot; None if the store (and its origin) has none by that name."""
    from ember.store.loader import open_tensors

    try:
        tensors = open_tensors(name, store=store, prefetch=False)
        ids = [int(i) for i in tensors["tokens"].tolist()]
        if "kv" in tensors:
            return ids, tensors["kv"]
        return ids, dequantise(tensors["kv_int8"], tensors["kv_scale"], dtype)
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
