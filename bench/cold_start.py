"""Cold-start benchmark: time to first response on each rung of the ladder, through the gateway.

One run measures, for the bundled MiniLM embedder served by a real `ember serve`:
- time to first response (client-side, one sentence, V2 REST) of requests that land on each
  rung: hot, paused, template fork, zygote fork (N samples each; the `Ember-Rung` response
  header proves where each one landed);
- an in-process call of the same model (same runtime, one thread) for the gateway's overhead,
  against hot requests from the standard library's http.client and from httpx;
- the naive baseline: a fresh `python` that imports sentence_transformers, loads the model and
  embeds one sentence (time to that embedding);
- memory: the PSS that each extra replica adds to the whole ember process tree, and each
  replica's private memory (USS), against the template's PSS;
- Ray Serve with min_replicas=0 on the same model, when the optional `bench` extra is installed.
Prints a table and writes JSON to bench/results/cold_start.json.

Usage: python bench/cold_start.py [-n 20] [--naive-n 3] [--no-ray] [--sandbox on|off]
(--sandbox: the server's flag; the JSON is then cold_start-sandbox-{on,off}.json, to compare the two.)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ember.node import procinfo
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
SENTENCE = "The cold start is the enemy of serverless inference."
MB = 1 << 20

# One variant of the example contract per rung: the knobs make each request land where we want.
VARIANTS: dict[str, dict[str, Any]] = {
    "hot": {"pause_after_s": 3600, "max_idle_s": 3600, "keep_template": True},
    "paused": {"pause_after_s": 0.1, "max_idle_s": 3600, "keep_template": True},
    "template": {"pause_after_s": 0.1, "max_idle_s": 0.1, "keep_template": True},
    "zygote": {"pause_after_s": 0.1, "max_idle_s": 0.1, "keep_template": False},
}
# Time between samples: long enough for the lifecycle tick to pause or recycle the instance.
SETTLE_S = {"hot": 0.0, "paused": 0.6, "template": 0.8, "zygote": 0.8}
# The paused rung is compared with a hot instance left idle just as long: an idle process
# loses its CPU caches either way, and only the SIGSTOP/SIGCONT should count.
IDLE_HOT_SETTLE_S = SETTLE_S["paused"]


def pct(values: list[float]) -> dict[str, float]:
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]

    return {"n": len(xs), "p50": statistics.median(xs), "p95": q(0.95), "p99": q(0.99), "min": xs[0], "max": xs[-1]}


def write_variants(directory: Path, example: str = "minilm", hot_max_scale: int = 3) -> None:
    """One contract per rung (`{example}-{rung}.yaml`): the bundled example with the rung's idle knobs."""
    base = load_contract(example_contracts_dir() / f"{example}.yaml")
    weights = str(base.weights_path())
    for rung, scaling in VARIANTS.items():
        data = base.model_dump(mode="json", exclude={"source"})
        data.update(name=f"{example}-{rung}", weights=weights)
        data["scaling"] = {**data["scaling"], **scaling, "max_scale": hot_max_scale if rung == "hot" else 1}
        (directory / f"{example}-{rung}.yaml").write_text(json.dumps(data))


def infer_once(client: httpx.Client, model: str) -> tuple[float, str]:
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}],
            "outputs": [{"name": "embedding"}]}
    t0 = time.perf_counter()
    r = client.post(f"/v2/models/{model}/infer", json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed, r.headers.get("ember-rung", "?")


def sample_rung(client: httpx.Client, rung: str, n: int, settle_s: float | None = None) -> dict[str, Any]:
    model = f"minilm-{rung}"
    infer_once(client, model)  # brings up the first instance and warms the path
    times: list[float] = []
    wrong = 0
    while len(times) < n and wrong < n:
        time.sleep(SETTLE_S[rung] if settle_s is None else settle_s)
        elapsed, landed = infer_once(client, model)
        if landed == rung:
            times.append(elapsed)
        else:
            wrong += 1
    return {**pct(times), "misplaced": wrong}


def load_in_process() -> Callable[[], object]:
    """The same runtime in this process, one thread, as an instance runs it: returns one call."""
    import numpy as np
    import torch

    from ember.runtimes import get_runtime

    torch.set_num_threads(1)
    contract = load_contract(example_contracts_dir() / "minilm.yaml")
    runtime = get_runtime(contract.runtime)
    runtime.preload()
    model = runtime.load(contract)
    inputs = {"text": np.array([SENTENCE.encode()], dtype=object)}
    for _ in range(5):
        model.infer(inputs)
    return lambda: model.infer(inputs)


class RawClient:
    """The lightest real HTTP/1.1 client (the standard library's, one keep-alive connection): what
    is left over an in-process call is the gateway's, not a client library's."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.last_instance = ""

    def infer(self, model: str) -> tuple[float, str]:
        body = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}],
                           "outputs": [{"name": "embedding"}]})
        t0 = time.perf_counter()
        self.conn.request("POST", f"/v2/models/{model}/infer", body=body,
                          headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - t0
        assert response.status == 200, response.status
        self.last_instance = response.getheader("ember-instance", "")
        return elapsed, response.getheader("ember-rung", "?")


def sample_hot(server: EmberServer, client: httpx.Client, call: Callable[[], object],
               n: int) -> dict[str, dict[str, Any]]:
    """Hot requests (two clients) and in-process calls in alternating blocks of 10, so all three
    see the same machine load while each keeps its own caches warm within a block. The in-process
    calls run on the core of the instance that served the last block (the autoscaler may add one
    under a closed loop): cores of a shared VM differ by more than the overhead."""
    raw = RawClient(str(client.base_url).rstrip("/"))
    raw.infer("minilm-hot")
    anywhere = os.sched_getaffinity(0)
    times: dict[str, list[float]] = {"in_process": [], "hot_raw": [], "hot": []}
    wrong = 0
    while len(times["hot"]) < n and wrong < n:
        pids = {i["id"]: i["pid"] for i in _instances(server)[0]}
        pid = pids.get(raw.last_instance)
        os.sched_setaffinity(0, os.sched_getaffinity(pid) if pid is not None else anywhere)
        time.sleep(0.01)  # past the instance's and the gateway's polling (idle_poll_us): the core is idle again
        for _ in range(10):
            t0 = time.perf_counter()
            call()
            times["in_process"].append(time.perf_counter() - t0)
        os.sched_setaffinity(0, anywhere)
        for name, infer in (("hot_raw", raw.infer), ("hot", lambda m: infer_once(client, m))):
            for _ in range(10):
                elapsed, landed = infer("minilm-hot")
                if landed == "hot":
                    times[name].append(elapsed)
                else:
                    wrong += 1
    raw.conn.close()
    return {k: {**pct(v), "misplaced": wrong} if k != "in_process" else pct(v) for k, v in times.items()}


NAIVE = """
import time, sys
t0 = time.perf_counter()
from sentence_transformers import SentenceTransformer
m = SentenceTransformer(sys.argv[1], device="cpu")
m.encode([sys.argv[2]])
print("EMBEDDED", flush=True)
"""


def time_to_marker(script: str, args: list[str], marker: bytes) -> float | None:
    """Seconds from starting `python -c script args...` until it prints a line starting with `marker`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith(marker):
                return time.perf_counter() - t0
        return None
    finally:
        proc.kill()
        proc.wait()


def naive(n: int) -> dict[str, float]:
    weights = str(load_contract(example_contracts_dir() / "minilm.yaml").weights_path())
    times = [time_to_marker(NAIVE, [weights, SENTENCE], b"EMBEDDED") for _ in range(n)]
    return pct([t for t in times if t is not None])


def tree_pss(root: int) -> int:
    """PSS of every process below `root` (the node's zygotes, templates and instances; the
    gateway's own heap grows with its first concurrent requests and is not a replica's cost)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, stack = 0, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        with contextlib.suppress(Exception):  # a process may exit while we walk
            total += procinfo.memory_of(pid).pss_bytes
        stack.extend(children.get(pid, []))
    return total


def memory(server: EmberServer, client: httpx.Client) -> dict[str, Any]:
    """Add replicas of minilm-hot one at a time and measure what each adds to the node's PSS.

    The template's PSS is taken first, with no replica and no other process mapping the weights
    (each sharer takes a part of the shared pages' PSS, so it would shrink with every replica).

    Bursts of the benchmark's one-sentence request from k threads at once make the server start
    a k-th replica (target concurrency 1); each step is measured once it holds. (Big batches
    would measure the activations a replica keeps for reuse, not what replication costs.)
    """
    import concurrent.futures as cf

    assert server.proc is not None
    template_pss = _instances(server)[1]
    counts, totals = [len(_instances(server)[0])], [tree_pss(server.proc.pid)]
    for replicas in (1, 2, 3):
        with cf.ThreadPoolExecutor(replicas) as pool:
            clients = [httpx.Client(base_url=server.url, timeout=120) for _ in range(replicas)]
            for _ in range(50):
                if len(_instances(server)[0]) >= replicas:
                    break
                list(pool.map(lambda c: [infer_once(c, "minilm-hot") for _ in range(4)], clients))
            for c in clients:
                c.close()
        time.sleep(0.3)
        counts.append(len(_instances(server)[0]))
        totals.append(tree_pss(server.proc.pid))
    insts = _instances(server)[0]
    # Per added replica: the step's PSS growth over the replicas it added (a step may add none).
    per = [(b - a) / (n1 - n0) for a, b, n0, n1 in zip(totals, totals[1:], counts, counts[1:], strict=False)
           if n1 > n0]
    uss = [i["uss_bytes"] for i in insts]
    return {"template_pss_mb": template_pss / MB, "replicas": counts,
            "extra_replica_tree_pss_mb": [d / MB for d in per],
            "extra_replica_vs_template": [d / template_pss for d in per],
            "replica_uss_mb": [u / MB for u in uss], "replica_uss_vs_template": [u / template_pss for u in uss]}


def _instances(server: EmberServer) -> tuple[list[dict[str, Any]], int]:
    model = {m["name"]: m for m in server.status()["models"]}["minilm-hot"]
    return model["instances"], model["template"]["pss_bytes"]


def ray_serve(n: int) -> dict[str, Any]:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return {"skipped": "ray[serve] is not installed (pip install -e '.[bench]')"}
    from bench_ray import measure_ray

    result: dict[str, Any] = measure_ray(n, SENTENCE)
    return result


def memory_in_subprocess(models: Path, state: Path, sandbox: str | None) -> dict[str, Any]:
    """The memory phase from a process that never imported torch: this one has (for the in-process
    call), and every library page it maps would take a share of the replicas' PSS."""
    flags = ["--sandbox", sandbox] if sandbox else []
    proc = subprocess.run([sys.executable, __file__, "--memory-only", str(models), str(state), *flags],
                          capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def memory_only(models: Path, state: Path, sandbox: str | None) -> None:
    flags = ("--sandbox", sandbox) if sandbox else ()
    with EmberServer(state, "--models", str(models), "--cpu-slots", "3", "--log-level", "warning", *flags) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        print(json.dumps(memory(server, client)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20, help="samples per rung (default 20)")
    ap.add_argument("--naive-n", type=int, default=3, help="naive cold starts (each ~13 s; default 3)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--sandbox", choices=("on", "off"), help="the server's --sandbox (default: the server's default)")
    ap.add_argument("--memory-only", nargs=2, metavar=("MODELS", "STATE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_only:
        memory_only(Path(args.memory_only[0]), Path(args.memory_only[1]), args.sandbox)
        return
    results: dict[str, Any] = {"n": args.n, "machine": {"cpus": os.cpu_count()}, "sandbox": args.sandbox}
    sandbox = ("--sandbox", args.sandbox) if args.sandbox else ()
    call = load_in_process()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        write_variants(models)
        with EmberServer(Path(tmp) / "state", "--models", str(models), "--cpu-slots", "6",
                         "--log-level", "warning", *sandbox) as server, \
                httpx.Client(base_url=server.url, timeout=120) as client:
            hot = sample_hot(server, client, call, max(args.n, 100))
            results["in_process"], results["hot_raw_client"] = hot["in_process"], hot["hot_raw"]
            results["rungs"] = {"hot": hot["hot"], **{rung: sample_rung(client, rung, args.n)
                                                     for rung in VARIANTS if rung != "hot"}}
            results["hot_after_idle"] = sample_rung(client, "hot", args.n, IDLE_HOT_SETTLE_S)
        # Memory on a server with one model only, so the template's PSS is not split with other templates,
        # and with this process's own mapping of the weights released (it would take a share too).
        del call
        gc.collect()
        for other in models.glob("*.yaml"):
            if other.name != "minilm-hot.yaml":
                other.unlink()
        results["memory"] = memory_in_subprocess(models, Path(tmp) / "state2", args.sandbox)
        results["memory"]["bench_maps_weights"] = "model.safetensors" in Path("/proc/self/maps").read_text()
    results["naive"] = naive(args.naive_n)
    sys.path.insert(0, str(Path(__file__).parent))
    results["ray"] = {"skipped": "--no-ray"} if args.no_ray else ray_serve(args.n)
    results["ratios"] = ratios(results)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / (f"cold_start-sandbox-{args.sandbox}.json" if args.sandbox else "cold_start.json")
    out.write_text(json.dumps(results, indent=2))
    print_table(results)


def ratios(r: dict[str, Any]) -> dict[str, Any]:
    rungs, naive_p50 = r["rungs"], r["naive"]["p50"]
    out: dict[str, Any] = {
        "hot_gateway_overhead_p50_ms": (r["hot_raw_client"]["p50"] - r["in_process"]["p50"]) * 1e3,
        "hot_httpx_overhead_p50_ms": (rungs["hot"]["p50"] - r["in_process"]["p50"]) * 1e3,
        "paused_over_hot_p95_ms": (rungs["paused"]["p95"] - r["hot_after_idle"]["p95"]) * 1e3,
        "naive_over_rung_p50": {k: naive_p50 / v["p50"] for k, v in rungs.items()},
    }
    ray_first = r.get("ray", {}).get("first_request", {}).get("p50")
    if ray_first:
        out["ray_first_over_rung_p50"] = {k: ray_first / v["p50"] for k, v in rungs.items()}
    return out


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ember cold starts, MiniLM, through the gateway (N={r['n']} per rung)")
    for col in ("path", "p50 ms", "p95 ms", "p99 ms", "naive / p50"):
        t.add_column(col, justify="right" if col != "path" else "left")
    naive_p50 = r["naive"]["p50"]
    for name, row in [("in-process call", r["in_process"]), ("hot, http.client", r["hot_raw_client"]),
                      *[(f"rung: {k}", v) for k, v in r["rungs"].items()],
                      (f"hot, idle {IDLE_HOT_SETTLE_S:g}s first", r["hot_after_idle"]),
                      (f"naive (N={r['naive']['n']})", r["naive"])]:
        t.add_row(name, f"{row['p50'] * 1e3:.1f}", f"{row['p95'] * 1e3:.1f}", f"{row['p99'] * 1e3:.1f}",
                  f"{naive_p50 / row['p50']:.0f}x")
    ray = r["ray"]
    if "first_request" in ray:
        for k in ("first_request", "warm_request"):
            row = ray[k]
            t.add_row(f"ray serve: {k.replace('_', ' ')}", f"{row['p50'] * 1e3:.1f}", f"{row['p95'] * 1e3:.1f}",
                      f"{row['p99'] * 1e3:.1f}", f"{naive_p50 / row['p50']:.1f}x")
    console = Console(width=120)
    console.print(t)
    q = r["ratios"]
    m = r["memory"]
    console.print(f"hot: gateway overhead over an in-process call, p50: {q['hot_gateway_overhead_p50_ms']:.2f} ms "
                  f"with http.client, {q['hot_httpx_overhead_p50_ms']:.2f} ms with httpx (the rung rows' client)")
    console.print(f"paused over hot (both idle {IDLE_HOT_SETTLE_S:g}s first), p95: "
                  f"{q['paused_over_hot_p95_ms']:.2f} ms")
    console.print(f"template PSS (no replica yet) {m['template_pss_mb']:.0f} MB; each replica adds to the node's PSS: "
                  + ", ".join(f"{d:.1f} MB ({x:.0%})" for d, x in zip(m["extra_replica_tree_pss_mb"],
                                                                 m["extra_replica_vs_template"], strict=True))
                  + "; replica private (USS): "
                  + ", ".join(f"{u:.1f} MB ({x:.0%})" for u, x in zip(m["replica_uss_mb"],
                                                                    m["replica_uss_vs_template"], strict=True)))
    if "first_request" in ray:
        fr = q["ray_first_over_rung_p50"]
        console.print("ray first request at zero / ember rung p50: "
                      + ", ".join(f"{k} {v:.0f}x" for k, v in fr.items()))
    else:
        console.print(f"ray serve: {ray.get('skipped')}")
    console.print(f"JSON: {RESULTS}/cold_start*.json")


if __name__ == "__main__":
    main()
