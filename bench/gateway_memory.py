"""Gateway memory under large bodies: the RSS of a real `ember serve` (the gateway process, not its instances)
before, at its peak during, and after N concurrent large JSON bodies, for each body budget (--max-inflight-mb).

Each client sends one `/v1/embeddings` body of --mb megabytes naming an unknown model: the gateway reads and parses
the whole body, then answers 404 (429 when the budget has no room for it). Prints a table and writes
bench/results/gateway_memory.json. Memory is measured here, never asserted in tests.

    python bench/gateway_memory.py [--clients 6] [--mb 60] [--budgets 256,4096]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from ember.testing.server import EmberServer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
MB = 2**20


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MB


def run(clients: int, mb: int, budget_mb: int) -> dict[str, Any]:
    body = b'{"model": "nope", "input": "' + b"x" * (mb * MB) + b'"}'
    with tempfile.TemporaryDirectory() as state, \
            EmberServer(Path(state), "--models", str(FIXTURES / "sleeper.yaml"), "--max-body-mb", str(mb + 1),
                        "--max-inflight-mb", str(max(budget_mb, mb + 1))) as server:
        assert server.proc is not None
        pid = server.proc.pid
        time.sleep(1.0)
        before, peak, done = _rss_mb(pid), 0.0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_mb(pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            codes = list(pool.map(lambda _: httpx.post(server.url + "/v1/embeddings", content=body,
                                                       timeout=120).status_code, range(clients)))
        done.set()
        sampler.join()
        time.sleep(2.0)   # let the allocator settle
        after = _rss_mb(pid)
    return {"clients": clients, "body_mb": mb, "budget_mb": budget_mb, "rss_before_mb": round(before, 1),
            "rss_peak_mb": round(peak, 1), "rss_after_mb": round(after, 1), "statuses": dict(Counter(codes))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--mb", type=int, default=60)
    parser.add_argument("--budgets", default="256,4096", help="comma-separated --max-inflight-mb values")
    args = parser.parse_args()
    rows = [run(args.clients, args.mb, int(b)) for b in args.budgets.split(",")]
    print(f"{'clients':>8}{'body MB':>9}{'budget MB':>11}{'RSS before':>12}{'peak':>8}{'after':>8}  statuses")
    for r in rows:
        print(f"{r['clients']:>8}{r['body_mb']:>9}{r['budget_mb']:>11}{r['rss_before_mb']:>12.0f}"
              f"{r['rss_peak_mb']:>8.0f}{r['rss_after_mb']:>8.0f}  {r['statuses']}")
    out = Path(__file__).resolve().parent / "results" / "gateway_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
