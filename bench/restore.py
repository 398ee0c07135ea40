"""Restore from a process snapshot (CRIU) against a naive cold start: MiniLM, time to first response.

One run, on the node's side of the rung (ember.node.snapshots, no gateway):
- `restore, image in page cache`: `criu restore` of a MiniLM process imaged after its warm-up, then one sentence
  embedded over its socket: seconds from the restore's start to the embedding (n times, each a new copy);
- `restore, image evicted`: the same after the image's files are dropped from the page cache
  (posix_fadvise DONTNEED; the model's own files and libraries stay cached, as on a node that served it before);
- `naive cold start`: bench/cold_start.py's baseline, a new `python` that imports sentence_transformers, loads the
  model and embeds one sentence (warm page cache);
- the image's size and the dump's time.
Prints a table and writes bench/results/restore.json.

Usage: python bench/restore.py [-n 20] [--naive-n 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cold_start import NAIVE, SENTENCE, time_to_marker
from rich.console import Console
from rich.table import Table

from ember.node import criu, snapshots
from ember.node.framing import recv_frame, send_frame
from ember.wire.contract import example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
MINILM = example_contracts_dir() / "minilm.yaml"


def first_response(images: Path) -> float:
    started = time.perf_counter()
    copy = snapshots.restore(images)
    arr = np.empty(1, dtype=object)
    arr[0] = SENTENCE.encode()
    send_frame(copy.conn, {"op": "infer"}, {"text": arr})
    frame = recv_frame(copy.conn)
    took = time.perf_counter() - started
    copy.close()
    if frame is None or frame.op != "reply":
        raise RuntimeError(f"restored copy answered {frame.header if frame else 'nothing'}")
    return took


def evict(images: Path) -> None:
    for path in images.iterdir():
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50": statistics.median(xs), "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))],
            "min": xs[0], "max": xs[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--naive-n", type=int, default=5)
    args = parser.parse_args()
    found = criu.find()
    if not found.ok:
        sys.exit(f"snapshots cannot run here: {found.reason}")
    with tempfile.TemporaryDirectory(prefix="ember-restore-") as root:
        image = snapshots.make_image(load_contract(MINILM), Path(root) / "minilm")
        first_response(image.path)   # the image's first read fills the page cache
        warm = pct([first_response(image.path) for _ in range(args.n)])
        evicted = []
        for _ in range(max(3, args.n // 4)):
            evict(image.path)
            evicted.append(first_response(image.path))
    weights = str(load_contract(MINILM).weights_path())
    naive_times = [time_to_marker(NAIVE, [weights, SENTENCE], b"EMBEDDED") for _ in range(args.naive_n)]
    naive = pct([t for t in naive_times if t is not None])
    rows = {"restore, image in page cache": warm, "restore, image evicted": pct(evicted), "naive cold start": naive}
    table = Table(title=f"MiniLM, time to first response (s); image {image.bytes / 2**20:.0f} MiB, dump "
                        f"{image.dump_s:.2f} s, CRIU {found.version}")
    for col in ("path", "n", "p50", "p95", "min", "max", "naive p50 / p50"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(name, str(r["n"]), *(f"{r[k]:.3f}" for k in ("p50", "p95", "min", "max")),
                      f"{naive['p50'] / r['p50']:.1f}x")
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    out = {"image_bytes": image.bytes, "dump_s": image.dump_s, "image_load_s": image.load_s, "criu": found.version,
           **{k.replace(", ", "_").replace(" ", "_"): v for k, v in rows.items()}}
    (RESULTS / "restore.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
