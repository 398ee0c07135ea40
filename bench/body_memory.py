"""Gateway memory under large bodies on every route: the RSS of a real `ember serve` (the gateway process, not its
instances) before, at its peak during, and after a burst of large bodies, against the target peak of twice the body
budget (`--max-inflight-mb`).

String bodies: N concurrent JSON bodies of --mb megabytes, each one string, to each route, served by real models
(minilm: /v1/embeddings and V2 infer with a BYTES input; smollm2: /v1/chat/completions, /v1/completions, V2 generate
and generate_stream). `ascii` strings are plain letters; `wide` ones end in one character outside the BMP (Python
then holds every character of the string in 4 bytes). Link bodies: N concurrent gateway links (`ember.wire.link_frames`)
each sending one request with a body of --mb megabytes to /cluster/infer, with API keys on and no key (each refused
on its head) and with keys off (each held within the budget). Each route is warmed with a small request first, so
what loading it costs (an LLM's vocabulary in the gateway) is not counted as the burst's.

Prints a table and writes bench/results/body_memory.json. Memory is measured here, never asserted in tests.

    python bench/body_memory.py [--mb 60] [--strings 6] [--links 20] [--budget-mb 256] [--only embeddings,links-no-key]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from ember.testing.server import EmberServer
from ember.wire import link_frames as lf

EXAMPLES = Path(__file__).resolve().parents[1] / "ember" / "examples"
MB = 2**20
WIDE = "\U0001f600"

# route: (model file, path, body of one string)
STRING_ROUTES: dict[str, tuple[str, str, Callable[[str], dict[str, Any]]]] = {
    "embeddings": ("minilm", "/v1/embeddings", lambda s: {"model": "minilm", "input": s}),
    "v2-infer": ("minilm", "/v2/models/minilm/infer",
                 lambda s: {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [s]}]}),
    "chat": ("smollm2", "/v1/chat/completions",
             lambda s: {"model": "smollm2", "messages": [{"role": "user", "content": s}], "max_tokens": 1}),
    "completions": ("smollm2", "/v1/completions", lambda s: {"model": "smollm2", "prompt": s, "max_tokens": 1}),
    "generate": ("smollm2", "/v2/models/smollm2/generate",
                 lambda s: {"text_input": s, "parameters": {"max_tokens": 1}}),
    "generate-stream": ("smollm2", "/v2/models/smollm2/generate_stream",
                        lambda s: {"text_input": s, "parameters": {"max_tokens": 1}}),
}


class Peak:
    """The process's RSS sampled every 10 ms on a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._done = psutil.Process(pid), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def rss(self) -> float:
        return float(self.proc.memory_info().rss) / MB

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.NoSuchProcess:
                return
            time.sleep(0.01)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def post(url: str, body: bytes) -> int:
    """The answer's status; 0 when none came (the connection dropped, the server died)."""
    try:
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=600).status_code
    except httpx.HTTPError:
        return 0


def measure(server: EmberServer, burst: Callable[[], list[int]], settle_s: float) -> dict[str, Any]:
    assert server.proc is not None
    with Peak(server.proc.pid) as peak:
        before = peak.rss()
        started = time.monotonic()
        statuses = burst()
        took = time.monotonic() - started
    time.sleep(settle_s)   # what is still held once the burst is answered
    after = peak.rss() if server.proc.poll() is None else float("nan")   # nan: the server died
    return {"rss_before_mb": round(before, 1), "rss_peak_mb": round(peak.peak, 1), "rss_after_mb": round(after, 1),
            "burst_s": round(took, 1), "statuses": dict(Counter(statuses))}


def string_scenario(route: str, text: str, args: argparse.Namespace, state: Path) -> dict[str, Any]:
    model, path, shape = STRING_ROUTES[route]
    tail = WIDE if text == "wide" else "x"
    big = json.dumps(shape("x" * (args.mb * MB - 1) + tail), ensure_ascii=False).encode()
    small = json.dumps(shape("hello")).encode()
    with EmberServer(state, "--models", str(EXAMPLES / f"{model}.yaml"), "--max-body-mb", str(args.mb + 1),
                     "--max-inflight-mb", str(args.budget_mb)) as server:
        post(server.url + path, small)   # warm the route

        def burst() -> list[int]:
            with concurrent.futures.ThreadPoolExecutor(args.strings) as pool:
                return list(pool.map(lambda _: post(server.url + path, big), range(args.strings)))

        row = measure(server, burst, args.settle_s)
    return {"scenario": f"{route} ({text})", "bodies": args.strings, **row}


def link_exchange(port: int, body_mb: int, key: str | None) -> int:
    """One link request with a body of `body_mb` MB; the answer's status (0: the link was dropped)."""
    headers = [("content-type", "application/octet-stream"), *([("authorization", f"Bearer {key}")] if key else [])]
    meta = json.dumps({"method": "POST", "path": "/cluster/infer/minilm/1", "headers": headers}).encode()
    body = bytes(body_mb * MB)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        try:
            sock.sendall(lf.PREFACE + lf.REQUEST_HEAD.pack(len(meta), len(body)) + meta)
            sock.sendall(body)
            head = _read(sock, lf.RESPONSE_HEAD.size)
        except OSError:
            return 0
        return int(lf.RESPONSE_HEAD.unpack(head)[0]) if head else 0


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n and (part := sock.recv(n - len(out))):
        out += part
    return out


def link_scenario(auth: str, args: argparse.Namespace, state: Path) -> dict[str, Any]:
    with EmberServer(state, "--models", str(EXAMPLES / "minilm.yaml"), "--auth", auth, "--max-body-mb",
                     str(args.mb + 1), "--max-inflight-mb", str(args.budget_mb)) as server:
        def burst() -> list[int]:
            with concurrent.futures.ThreadPoolExecutor(args.links) as pool:
                return list(pool.map(lambda _: link_exchange(server.port, args.mb, None), range(args.links)))

        row = measure(server, burst, args.settle_s)
    name = "links, keys on, no key" if auth == "on" else "links, keys off"
    return {"scenario": name, "bodies": args.links, **row}


def scenarios(args: argparse.Namespace) -> list[tuple[str, Callable[[Path], dict[str, Any]]]]:
    out: list[tuple[str, Callable[[Path], dict[str, Any]]]] = []
    for route in STRING_ROUTES:
        for text in ("ascii", "wide"):
            out.append((f"{route}-{text}", lambda state, r=route, t=text: string_scenario(r, t, args, state)))
    out.append(("links-no-key", lambda state: link_scenario("on", args, state)))
    out.append(("links-keys-off", lambda state: link_scenario("off", args, state)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=60, help="megabytes per body")
    parser.add_argument("--strings", type=int, default=6, help="concurrent string bodies per route")
    parser.add_argument("--links", type=int, default=20, help="concurrent link bodies")
    parser.add_argument("--budget-mb", type=int, default=256, help="the server's --max-inflight-mb")
    parser.add_argument("--settle-s", type=float, default=5.0, help="seconds after the burst before 'after'")
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = parser.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    rows = []
    for name, run in scenarios(args):
        if wanted and name not in wanted:
            continue
        with tempfile.TemporaryDirectory(prefix="ember-bm-", dir="/tmp") as state:
            rows.append({**run(Path(state)), "budget_mb": args.budget_mb, "body_mb": args.mb})
        print(json.dumps(rows[-1]), flush=True)
    target = 2 * args.budget_mb
    print(f"\n{'scenario':<30}{'bodies':>7}{'before':>8}{'peak':>7}{'after':>7}{'s':>6}  met (peak <= {target} MB)"
          "  statuses")
    for r in rows:
        met = "yes" if r["rss_peak_mb"] <= target else "NO"
        print(f"{r['scenario']:<30}{r['bodies']:>7}{r['rss_before_mb']:>8.0f}{r['rss_peak_mb']:>7.0f}"
              f"{r['rss_after_mb']:>7.0f}{r['burst_s']:>6.1f}  {met:<26}{r['statuses']}")
    out = Path(__file__).resolve().parent / "results" / "body_memory.json"
    out.write_text(json.dumps({"target_peak_mb": target, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
