"""Concurrent loads fetch each chunk once; a fetch killed halfway leaves nothing visible; lazy and ordered loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

from ember.store import WeightStore, open_tensors
from ember.testing.checkpoints import TensorSpec, mismatches, write_checkpoint
from ember.testing.nginx import NginxOrigin


def _chunk_fetches(nginx: NginxOrigin) -> Counter[str]:
    return Counter(p.rsplit("/", 1)[-1] for p in nginx.requests() if "/chunks/" in p)


def _publish(make_store: Callable[..., WeightStore], nginx: NginxOrigin, src: Path, key: str) -> WeightStore:
    publisher = make_store("pub", root=nginx.root, memory_dir=None)
    publisher.push(src, key)
    return publisher


def test_threads_loading_one_model_fetch_each_chunk_once(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    _publish(make_store, nginx, checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url, part_size=8 << 20)
    expected = load_file(checkpoint_dir / "model.safetensors")
    results: list[list[str]] = []

    def load() -> None:
        results.append(mismatches(expected, dict(open_tensors("m:1", store=node).items())))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[]] * 6
    fetches = _chunk_fetches(nginx)
    assert set(fetches) == _tensor_chunks(node, "m:1")
    assert max(fetches.values()) == 1


def _tensor_chunks(store: WeightStore, key: str) -> set[str]:
    return {c.digest for c in store.manifest(key).tensor_chunks().values() if c is not None}


_LOADER = """
import sys
from ember.store import StoreConfig, WeightStore, open_tensors
store = WeightStore(StoreConfig(root=sys.argv[1], memory_dir=sys.argv[2], origin=sys.argv[3],
                                part_size=int(sys.argv[4])))
tensors = open_tensors("m:1", store=store)
total = sum(t.numel() for t in tensors.values())
tensors.wait()
print("loaded", total, flush=True)
"""


def test_processes_loading_one_model_fetch_each_chunk_once(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin, tmp_path: Path
) -> None:
    _publish(make_store, nginx, checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url)
    node.manifest("m:1")
    args = [str(node.root), str(node.config.memory_dir), nginx.url, str(1 << 20)]
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, *args], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o.strip() for o in outs}) == 1
    fetches = _chunk_fetches(nginx)
    assert max(fetches.values()) == 1
    expected = load_file(checkpoint_dir / "model.safetensors")
    assert mismatches(expected, dict(open_tensors("m:1", store=node).items())) == []


def test_crash_mid_fetch_leaves_no_partial_chunk(
    make_store: Callable[..., WeightStore], tmp_path: Path, nginx: NginxOrigin
) -> None:
    big = write_checkpoint(tmp_path / "big" / "model.safetensors",
                           [TensorSpec("w", (4096, 1024), "F16", 7), TensorSpec("b", (1024,), "F16", 8)])
    _publish(make_store, nginx, big.parent, "m:1")
    node = make_store("node", origin=nginx.slow_url)  # 2 MB/s: the 8 MiB chunk takes about 4 s
    node.manifest("m:1")
    args = [str(node.root), str(node.config.memory_dir), nginx.slow_url, str(64 << 20)]  # one slow connection
    proc = subprocess.Popen([sys.executable, "-c", _LOADER, *args], stdout=subprocess.PIPE, text=True)
    tmp_dirs = [node.root / "tmp", Path(str(node.config.memory_dir)) / "tmp"]
    deadline = time.monotonic() + 60
    while not any(d.exists() and any(d.iterdir()) for d in tmp_dirs):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [f for d in tmp_dirs for f in d.iterdir()]
    assert leftovers  # the half-written temp file is there, but not under chunks/
    w = node.manifest("m:1").tensor_chunks()["w"]
    assert w is not None
    assert not os.path.exists(node.disk.path(w.digest))
    # the next open (fast origin this time) is correct, and gc removes what the dead process left
    again = make_store("node", origin=nginx.url)
    assert mismatches(load_file(big), dict(open_tensors("m:1", store=again).items())) == []
    assert again.gc().removed_temp == len(leftovers)
    assert not [f for d in tmp_dirs for f in d.iterdir()]


def test_open_is_lazy(make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin) -> None:
    _publish(make_store, nginx, checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url)
    tensors = open_tensors("m:1", store=node, prefetch=False)
    assert _chunk_fetches(nginx) == Counter()  # only the manifest so far
    name = list(tensors)[3]
    assert tensors[name].numel() > 0
    chunk = node.manifest("m:1").tensor_chunks()[name]
    assert chunk is not None and list(_chunk_fetches(nginx)) == [chunk.digest]


def test_first_load_order_is_recorded_and_drives_prefetch(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    publisher = _publish(make_store, nginx, checkpoint_dir, "m:1")
    tensors = open_tensors("m:1", store=publisher, prefetch=False)
    order = list(reversed(list(tensors)))
    order[0], order[5] = order[5], order[0]
    for name in order:
        tensors[name]
    assert publisher.manifest("m:1").load_order == tuple(order)  # kept in the (published) manifest
    node = make_store("node", origin=nginx.url, threads=1)
    open_tensors("m:1", store=node).wait()
    chunks = node.manifest("m:1").tensor_chunks()
    expected = [c.digest for c in (chunks[n] for n in order) if c is not None]
    assert list(_chunk_fetches(nginx)) == list(dict.fromkeys(expected))


def test_closing_after_a_partial_load_keeps_the_order_seen(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path
) -> None:
    store = make_store()
    store.push(checkpoint_dir, "m:1")
    tensors = open_tensors("m:1", store=store, prefetch=False)
    names = list(tensors)
    for name in (names[4], names[1]):
        tensors[name]
    tensors.close()
    manifest = store.manifest("m:1")
    assert manifest.load_order == (names[4], names[1])
    assert manifest.ordered_tensors()[:3] == [names[4], names[1], names[0]]
