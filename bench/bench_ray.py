"""Ray Serve peer for the cold-start benchmark: the same MiniLM model behind Serve with min_replicas=0.

Measures, through Serve's HTTP proxy on a loopback port of a local 2-CPU Ray:
- first request at zero replicas: wait until the deployment has no replica at all, then time one
  POST from send to full response (N_first samples; each reply names the replica that served it,
  and a sample served by a replica that already existed is counted as misplaced, not timed);
- warm requests: N requests back to back on the replica the last cold sample started;
- how long Serve took to get back to zero replicas after a response, and the proxy's share of a warm
  request (client latency minus the time spent inside the replica's handler).

Needs the optional `bench` extra (`ray[serve]`); cold_start.py calls `measure_ray` when it is installed.
Usage: python bench/bench_ray.py [-n 20] [--first-n 3]   (prints JSON; also bench/results/ray_serve.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import warnings
from typing import Any

import httpx
from cold_start import RESULTS, SENTENCE, pct  # bench/ is on sys.path: this script's folder, or cold_start put it there

from ember.testing.models import minilm_dir

APP = "ember-peer-minilm"
DEPLOYMENT = "MiniLM"
REQUEST_TIMEOUT_S = 120.0  # a cold replica loads torch and the model: ~15-20 s on this machine
ZERO_TIMEOUT_S = 90.0  # bound on waiting for Serve to stop the replica
# Serve's metric push intervals default to 10 s; the replica's "no ongoing requests" reaches the
# autoscaler only that often, which would dominate the wait for zero replicas between samples.
SERVE_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report over the network
}
AUTOSCALING = {
    "min_replicas": 0, "initial_replicas": 0, "max_replicas": 1,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
    "look_back_period_s": 1.0,
}
# A stopping replica waits for in-flight requests; there are none, so keep its drain loop short.
GRACEFUL_WAIT_S, GRACEFUL_TIMEOUT_S = 0.1, 2.0


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def build_app(model_dir: str) -> Any:
    """The Serve application. The class is made inside a function so Ray pickles it by value:
    workers cannot import `bench_ray` (bench/ is not a package on their path)."""
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(name=DEPLOYMENT, autoscaling_config=AUTOSCALING, ray_actor_options={"num_cpus": 1},
                      max_ongoing_requests=4, graceful_shutdown_wait_loop_s=GRACEFUL_WAIT_S,
                      graceful_shutdown_timeout_s=GRACEFUL_TIMEOUT_S)
    class MiniLM:
        def __init__(self) -> None:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(model_dir, device="cpu")
            self.replica = f"{os.getpid()}:{time.time_ns()}"

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            t0 = time.perf_counter()
            vector = self.model.encode([body["text"]])[0]
            return {"embedding": vector.tolist(), "replica": self.replica, "handler_s": time.perf_counter() - t0}

    return MiniLM.bind()  # type: ignore[attr-defined]


def replica_count() -> int:
    """Replicas of the deployment in any state (a stopping one still holds its CPU and memory)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return -1
    return sum(app.deployments[DEPLOYMENT].replica_states.values())


def wait_for_zero(timeout_s: float) -> float:
    t0 = time.perf_counter()
    while (count := replica_count()) != 0:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"Ray Serve still has {count} replica(s) after {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.perf_counter() - t0


def post(client: httpx.Client, sentence: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = client.post("/", json={"text": sentence})
    r.content  # noqa: B018 - the timing covers the whole body
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    reply: dict[str, Any] = r.json()
    return elapsed, reply


def sample_first(client: httpx.Client, sentence: str, n_first: int) -> tuple[list[float], list[float], int, str]:
    """Cold samples: each waits for zero replicas, then times one request. Returns the times, the waits for
    zero, the samples served by an already running replica, and the replica the last sample started."""
    times: list[float] = []
    to_zero: list[float] = []
    misplaced, seen = 0, set()
    replica = ""
    while len(times) < n_first and misplaced < n_first:
        waited = wait_for_zero(ZERO_TIMEOUT_S)
        if times or misplaced:  # the first wait follows the deploy, not a response
            to_zero.append(waited)
        elapsed, reply = post(client, sentence)
        replica = reply["replica"]
        if replica in seen:
            misplaced += 1
        else:
            seen.add(replica)
            times.append(elapsed)
    return times, to_zero, misplaced, replica


def sample_warm(client: httpx.Client, sentence: str, n: int, replica: str) -> tuple[list[float], list[float], int]:
    """Back-to-back requests; ones that did not land on `replica` (Serve scaled it away) are not warm."""
    times: list[float] = []
    proxy: list[float] = []
    other = 0
    for _ in range(n):
        elapsed, reply = post(client, sentence)
        if reply["replica"] == replica:
            times.append(elapsed)
            proxy.append(elapsed - reply["handler_s"])
        else:
            other += 1
            replica = reply["replica"]
    return times, proxy, other


def measure_ray(n: int, sentence: str = SENTENCE, n_first: int | None = None) -> dict[str, Any]:
    """Ray Serve at min_replicas=0 serving MiniLM: first request at zero replicas and warm latency (seconds)."""
    import ray
    from ray import serve

    n_first = min(n, 3) if n_first is None else n_first
    os.environ.update(SERVE_ENV)  # before ray.init: the raylet and every worker inherit it
    port = free_loopback_port()
    model_dir = str(minilm_dir())
    t_start = time.perf_counter()
    # Ray binds its GCS, raylet and workers to this host's own address (it turns 127.0.0.1 into that
    # address itself); traffic to it stays on the host. Serve's HTTP proxy listens on loopback only.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
    try:
        with warnings.catch_warnings():
            # look_back_period_s below the deprecated metrics_interval_s default only warns (on each validation
            # of the config); the push intervals that matter are set through SERVE_ENV.
            warnings.filterwarnings("ignore", message=".*look_back_period_s", category=FutureWarning)
            serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": REQUEST_TIMEOUT_S},
                        logging_config={"log_level": "WARNING"})
            serve.run(build_app(model_dir), name=APP, route_prefix="/")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S,
                              trust_env=False) as client:
                first, to_zero, misplaced, replica = sample_first(client, sentence, n_first)
                warm, proxy, other = sample_warm(client, sentence, n, replica)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    if not first or not warm:
        raise RuntimeError(f"Ray Serve: {misplaced} cold samples hit a running replica, "
                           f"{other} warm requests missed the warm one; nothing left to time")
    return {
        "first_request": {**pct(first), "misplaced": misplaced},
        "warm_request": {**pct(warm), "not_on_warm_replica": other},
        "proxy_overhead": pct(proxy),
        "wait_for_zero_replicas": pct(to_zero) if to_zero else {"n": 0},
        "settings": {
            "ray": ray.__version__, "num_cpus": 2, "replica_num_cpus": 1, "autoscaling": AUTOSCALING,
            "graceful_shutdown_wait_loop_s": GRACEFUL_WAIT_S, "graceful_shutdown_timeout_s": GRACEFUL_TIMEOUT_S,
            "env": SERVE_ENV, "http": "127.0.0.1 (Serve HTTP proxy)", "n_first": n_first, "n_warm": n,
            "total_s": time.perf_counter() - t_start,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20, help="warm requests (default 20)")
    ap.add_argument("--first-n", type=int, default=None, help="requests at zero replicas (default min(n, 3))")
    args = ap.parse_args()
    if args.n < 1 or (args.first_n is not None and args.first_n < 1):
        ap.error("-n and --first-n must be at least 1")
    text = json.dumps(measure_ray(args.n, SENTENCE, args.first_n), indent=2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray_serve.json").write_text(text)
    # Ray prints a line to stdout when serve.shutdown() kills its own controller; the file has only the JSON.
    print(text)
    print(f"JSON: {RESULTS / 'ray_serve.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
