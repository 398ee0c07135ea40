"""The fetch rung of `bench/llm.py`: the first request for a model whose bytes this node does not hold.

The GGUF is pushed into an origin weight store that nginx serves on loopback at ORIGIN_MIB_S in all (the store's
STORE_THREADS connections, each held to its share: the rate `bench/cluster.py` gives its origin). Each sample is a
fresh `ember serve` with an empty store root and that origin (`--store-origin`), the model store-backed
(`weights: store:NAME:1`, no template, as a model first seen by a node is): once the node's llm zygote is up, one
streamed chat, whose `: ember-rung` must say fetch. Its TTFT counts the fetch of every chunk, the zygote child's
load, the declared prefix computed (no snapshot is in an empty store) and the prompt.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ember.store import StoreConfig, WeightStore
from ember.testing.nginx import NginxOrigin
from ember.testing.server import EmberServer

ORIGIN_MIB_S, STORE_THREADS = 100, 4
Chat = Callable[[httpx.Client, str, str, int], dict[str, Any]]


def fetch_samples(name: str, gguf: Path, contract: dict[str, Any], n: int, tmp: Path, flags: list[str],
                  chat: Chat, prompt: Callable[[int], str]) -> dict[str, Any]:
    """`n` first requests of `contract` (store-backed from a fresh origin), each on a fresh node."""
    origin_root, models = tmp / f"origin-{name}", tmp / f"fetch-{name}"
    with WeightStore(StoreConfig(root=origin_root, memory_dir=None, fsync=False)) as publisher:
        manifest = publisher.push(gguf, f"{name}-fetch:1")
    size = sum(c.size for c in manifest.unique_chunks().values())
    models.mkdir()
    model = f"{name}-fetch"
    (models / f"{model}.yaml").write_text(json.dumps({**contract, "name": model, "weights": f"store:{model}:1"}))
    samples: list[dict[str, Any]] = []
    with NginxOrigin(origin_root, slow_rate=f"{ORIGIN_MIB_S // STORE_THREADS}m") as origin:
        for i in range(n):
            store = tmp / f"store-{name}-{i}"
            with EmberServer(tmp / f"state-{name}-fetch-{i}", "--models", str(models), *flags,
                             "--store-root", str(store), "--store-origin", origin.slow_url) as server, \
                    httpx.Client(base_url=server.url, timeout=900) as client:
                _wait_for_zygote(server, "llm")
                one = chat(client, model, prompt(i), 2)
                samples.append({"ttft_s": one["ttft_s"], "rung": one["rung"]})
            shutil.rmtree(store, ignore_errors=True)
    return {"bytes": size, "origin_mib_s": ORIGIN_MIB_S, "connections": STORE_THREADS,
            "origin_floor_s": size / (ORIGIN_MIB_S * 2**20), "samples": samples}


def _wait_for_zygote(server: EmberServer, runtime: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(z["runtime"] == runtime for z in server.status()["node"]["zygotes"]):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {runtime} zygote came up within {timeout_s:g} s")
        time.sleep(0.2)
