"""How fast a backlog of durable jobs drains: N jobs queued at once with `Prefer: respond-async`, then run.

The issue that made jobs run as soon as an instance has room measured 5,154 queued MiniLM jobs draining
at 8.4 jobs/s (claimed once per 0.25 s tick, one at a time). This queues `--jobs` one-sentence MiniLM jobs
through V2 on a fresh `ember serve` (bundled models, default settings), as fast as 16 connections can
submit them, then polls `ember_jobs_queued` and the jobs until every one has succeeded.

Prints a table and writes bench/results/jobs_drain.json.
Usage: python bench/jobs_drain.py [--jobs 2000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

SENTENCE = "A backlog of jobs drains as fast as the instances can batch them."


def submit(url: str, n: int, connections: int = 16) -> tuple[list[str], float]:
    """Queue n jobs; their ids and how long queueing them took."""
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}]}

    def one_batch(count: int) -> list[str]:
        with httpx.Client(base_url=url, timeout=60) as client:
            out = []
            for _ in range(count):
                r = client.post("/v2/models/minilm/infer", json=body, headers={"Prefer": "respond-async"})
                assert r.status_code == 202, r.text
                out.append(r.headers["location"])
            return out

    t0 = time.perf_counter()
    shares = [n // connections + (1 if i < n % connections else 0) for i in range(connections)]
    with concurrent.futures.ThreadPoolExecutor(connections) as pool:
        locations = [loc for part in pool.map(one_batch, shares) for loc in part]
    return locations, time.perf_counter() - t0


def wait_done(url: str, locations: list[str], limit_s: float) -> float:
    """Seconds until the last job succeeded (checked oldest first: a job is done once every older one is)."""
    t0 = time.perf_counter()
    pending = list(locations)
    with httpx.Client(base_url=url, timeout=60) as client:
        while pending and time.perf_counter() - t0 < limit_s:
            state = client.get(pending[-1]).json()["status"]
            if state == "failed":
                raise RuntimeError(f"job {pending[-1]} failed")
            if state == "succeeded":
                pending = [loc for loc in pending if client.get(loc).json()["status"] != "succeeded"]
            else:
                time.sleep(0.2)
    if pending:
        raise RuntimeError(f"{len(pending)} jobs still not done after {limit_s:.0f} s")
    return time.perf_counter() - t0


def run(n: int) -> dict[str, Any]:
    from ember.testing.server import EmberServer

    with tempfile.TemporaryDirectory(prefix="ember-jobs-", dir="/tmp") as tmp, \
            EmberServer(Path(tmp) / "state", "--log-level", "warning") as server:
        httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": "warm"}, timeout=120)
        t0 = time.perf_counter()
        locations, submit_s = submit(server.url, n)
        after_submit = time.perf_counter()
        rest_s = wait_done(server.url, locations, limit_s=max(600.0, n / 2))
        total_s = after_submit - t0 + rest_s
    return {"jobs": n, "submit_s": submit_s, "total_s": total_s, "drain_jobs_per_s": n / total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "jobs_drain.json")
    args = parser.parse_args()
    result = run(args.jobs)
    table = Table(title="durable jobs: queue N at once, run them all (MiniLM, one sentence each)")
    for column in ("jobs", "queued in s", "all done in s", "jobs/s"):
        table.add_column(column, justify="right")
    table.add_row(str(result["jobs"]), f"{result['submit_s']:.1f}", f"{result['total_s']:.1f}",
                  f"{result['drain_jobs_per_s']:.1f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
