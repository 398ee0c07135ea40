"""Cluster-wide API keys (issue 32, "Keys"): created on one node, accepted on the other; revoked, refused on both.

Two real `ember serve --auth on --jobs-url ...` processes (their own state dirs and ports) on one real PostgreSQL
server (Debian's, on loopback: `make system`), and `ember keys --jobs-url ... create|revoke` run as an operator
runs it, as a process of its own. For each round: the time from the `create` command's exit (the row
committed) until node B answers 200 for the key, and A; then from `revoke`'s exit until both answer 401.
Each node polls GET /ember/status (an admin route) every 10 ms. Target: each within 5 s.

    python bench/cluster_keys.py [--rounds 10]

Prints a table and writes bench/results/cluster_keys.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ember.testing.postgres import PostgresServer
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir

TARGET_S = 5.0


def _keys(url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ember", "keys", "--jobs-url", url, *args], check=True,
                         capture_output=True, text=True)
    return out.stdout


def _until(node: EmberServer, key: str, status: int, since: float, client: httpx.Client) -> float:
    while True:
        got = client.get(node.url + "/ember/status", headers={"authorization": f"Bearer {key}"}).status_code
        if got == status:
            return time.monotonic() - since
        if time.monotonic() - since > 30:
            raise TimeoutError(f"{node.url} still answers {got}, not {status}, after 30 s")
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, PostgresServer() as pg:
        url = pg.create_database("keys")
        common = ("--auth", "on", "--jobs-url", url, "--models", str(example_contracts_dir() / "iris.yaml"),
                  "--cpu-slots", "1", "--sandbox", "off")
        with EmberServer(Path(tmp) / "a", *common) as a, EmberServer(Path(tmp) / "b", *common) as b, \
                httpx.Client(timeout=5) as client:
            for _ in range(args.rounds):
                made = json.loads(_keys(url, "create", "--tenant", "bench", "--role", "admin", "--json"))
                t0 = time.monotonic()
                row = {"accepted_b_s": _until(b, made["key"], 200, t0, client),
                       "accepted_a_s": _until(a, made["key"], 200, t0, client)}
                _keys(url, "revoke", made["id"])
                t1 = time.monotonic()
                row["refused_b_s"] = _until(b, made["key"], 401, t1, client)
                row["refused_a_s"] = _until(a, made["key"], 401, t1, client)
                rows.append(row)
    summary = {k: {"p50": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows)} for k in rows[0]}
    print(f"{'what':<28}{'p50 s':>8}{'max s':>8}   target ≤ {TARGET_S:g} s, {len(rows)} rounds")
    for k, v in summary.items():
        print(f"{k:<28}{v['p50']:>8.3f}{v['max']:>8.3f}   {'met' if v['max'] <= TARGET_S else 'MISSED'}")
    out = Path(__file__).parent / "results" / "cluster_keys.json"
    out.write_text(json.dumps({"rounds": rows, "summary": summary, "target_s": TARGET_S}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
