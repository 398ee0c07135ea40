"""First load of a model's weights on a node with an empty store: from a peer vs from a throttled origin.

Issue 14's row: the origin is nginx throttled to 100 MB/s (`limit_rate`), as a remote object store would be;
the peer is another node's ember gateway (`GET /v2/store/chunks/{digest}`, the real route and auth) holding
the model, on loopback, in a process of its own. Each run builds a fresh node store in an empty directory
(no memory tier: the chunks land on disk, as a fetch does) and times `WeightStore.pull` of the whole model:
manifest, every chunk fetched, hashed and landed. The manifest comes from the origin in both cases (a few KB).

nginx's `limit_rate` is bytes per second per connection (nginx's `m` is MiB), and the store fetches over
`threads` connections at once; so that the origin's total stays at 100 MiB/s, each configuration sets the
per-connection rate to 100m / threads: one connection at 100m, or four at 25m each.

Target (issue 14): peer fetch ≥ 3x faster than the throttled origin (p50 over p50). The headline compares what a
node does by default (the store's default `threads`, from a peer) with the origin at its best: the fastest origin
configuration measured, which is never faster than the bytes at 100 MiB/s (the floor, also reported). Each row's
own ratio (same connections both ways) is reported beside it; per-connection throttling flatters the peer where
one large chunk is held to 100m / threads.
Usage: python bench/peer_fetch.py [--model DIR] [--runs 5] [--threads 1,4]
Prints a table and writes bench/results/peer_fetch.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ember.ports import free_port
from ember.store import StoreConfig, WeightStore
from ember.testing.models import minilm_dir
from ember.testing.nginx import NginxOrigin
from ember.testing.peers import ChunkServer

TARGET = 3.0
TOKEN = "bench-peer-token-0123456789"
KEY = "minilm:1"
ORIGIN_MIB_S = 100


def one_pull(work: Path, origin: str, threads: int, peers: tuple[str, ...]) -> tuple[float, dict[str, int]]:
    root = Path(tempfile.mkdtemp(prefix="node-", dir=work))
    config = StoreConfig(root=root, memory_dir=None, origin=origin, threads=threads, peers=peers,
                         peer_token=TOKEN, fsync=False)
    try:
        with WeightStore(config) as store:
            t0 = time.perf_counter()
            store.pull(KEY)
            seconds = time.perf_counter() - t0
            return seconds, store.fetched_bytes()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def peer_process(holder_root: Path) -> Iterator[str]:
    """The holder's gateway in a process of its own (a peer is another machine: it must not share our GIL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-chunks", str(holder_root), "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the peer's chunk server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(10)


def serve_chunks(root: Path, port: int) -> None:
    server = ChunkServer(StoreConfig(root=root, memory_dir=None), cluster_token=TOKEN, port=port).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop()


def measure(work: Path, origin_root: Path, holder_root: Path, threads: int, runs: int) -> dict[str, Any]:
    per_conn = ORIGIN_MIB_S // threads
    with NginxOrigin(origin_root, slow_rate=f"{per_conn}m") as nginx, peer_process(holder_root) as peer_url:
        out: dict[str, Any] = {"threads": threads, "limit_rate_per_connection": f"{per_conn}m"}
        for source, peers in (("origin", ()), ("peer", (peer_url,))):
            times, fetched = [], {}
            for _ in range(runs):
                seconds, fetched = one_pull(work, nginx.slow_url, threads, peers)
                times.append(seconds)
            out[source] = {"runs_s": times, "p50_s": statistics.median(times), "fetched_bytes": fetched}
        chunk_gets = [p for p in nginx.requests() if "/chunks/" in p]
        out["origin_chunk_requests"] = len(chunk_gets)
    out["ratio"] = out["origin"]["p50_s"] / out["peer"]["p50_s"]
    return out


def headline(rows: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """The default node from a peer against the origin's best configuration (see the module docstring)."""
    default = StoreConfig.model_fields["threads"].default
    peer = [r["peer"]["p50_s"] for r in rows if r["threads"] == default] or [min(r["peer"]["p50_s"] for r in rows)]
    best_origin = min(r["origin"]["p50_s"] for r in rows)
    ratio = best_origin / peer[0]
    return {"default_threads": default, "peer_default_s": peer[0], "origin_best_s": best_origin,
            "origin_floor_s": size / (ORIGIN_MIB_S * 2**20), "ratio": ratio, "met": ratio >= TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: MiniLM, ~90 MB)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", default="1,4", help="store threads (= origin connections) per configuration")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peer_fetch.json")
    parser.add_argument("--serve-chunks", type=Path, help=argparse.SUPPRESS)   # the peer process
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_chunks is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        serve_chunks(args.serve_chunks, args.port)
        return
    model = args.model or minilm_dir()
    work = Path(tempfile.mkdtemp(prefix="ember-peer-bench-"))
    try:
        origin_root, holder_root = work / "origin", work / "holder"
        with WeightStore(StoreConfig(root=origin_root, memory_dir=None, fsync=False)) as publisher:
            manifest = publisher.push(model, KEY)
        with WeightStore(StoreConfig(root=holder_root, memory_dir=None, fsync=False)) as store:
            store.push(model, KEY)
        size = sum(c.size for c in manifest.unique_chunks().values())
        rows = [measure(work, origin_root, holder_root, int(t), args.runs) for t in args.threads.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"model": str(model), "bytes": size, "chunks": len(manifest.unique_chunks()), "runs": args.runs,
              "origin_limit_mib_s": ORIGIN_MIB_S, "target_ratio": TARGET, "rows": rows,
              **headline(rows, size),
              "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
                          "cpu": platform.processor()}}
    table = Table(title=f"first load of {KEY} ({size / 1e6:.1f} MB, {result['chunks']} chunks) on an empty "
                        f"store, p50 of {args.runs} (origin: nginx, {ORIGIN_MIB_S} MiB/s in all)")
    for col in ("connections", "limit_rate", "origin p50 s", "origin MB/s", "peer p50 s", "peer MB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        o, p = r["origin"]["p50_s"], r["peer"]["p50_s"]
        table.add_row(str(r["threads"]), r["limit_rate_per_connection"], f"{o:.3f}", f"{size / o / 1e6:.0f}",
                      f"{p:.3f}", f"{size / p / 1e6:.0f}", f"{r['ratio']:.1f}x")
    Console().print(table)
    print(f"default store ({result['default_threads']} connections) from a peer: {result['peer_default_s']:.3f} s; "
          f"origin at its best: {result['origin_best_s']:.3f} s (floor at {ORIGIN_MIB_S} MiB/s: "
          f"{result['origin_floor_s']:.3f} s) -> {result['ratio']:.2f}x")
    print(f"target: peer ≥ {TARGET:.0f}x faster than the throttled origin: {'met' if result['met'] else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
