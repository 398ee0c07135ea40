"""Throughput benchmark: closed-loop clients against `ember serve`, and in-process sentence_transformers.

`ember serve` (bundled models, default settings) takes, per endpoint (`openai`: /v1/embeddings on minilm,
`v2`: /v2/models/minilm/infer, `iris`: /v2/models/iris/infer; `grpc` and `grpc-iris`: KServe V2 gRPC ModelInfer on
minilm and iris, tensors in raw_input_contents) and client count N, N keep-alive connections that each send one
request (one sentence or one iris row), read the reply and send the next, for --duration seconds after --warmup
seconds. The clients are a raw asyncio HTTP/1.1 loop (gRPC: grpc.aio, one connection per client, messages
serialized once) in a process of their own (this script with --client): they neither share the server's event
loop nor take much of its cores. gRPC's req/s over HTTP's on the same model (grpc/v2, grpc-iris/iris) is reported
per client count. Once the server
has stopped, a fresh process times `SentenceTransformer.encode` of single sentences and of batches of N
(torch's default threads: every core). Prints a table and the issue's targets; writes bench/results/throughput.json.

Usage: python bench/throughput.py [--clients 1,8,32,128] [--duration 10] [--warmup 2] [--endpoints ...] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ember.ports import free_port
from ember.testing.models import minilm_dir

RESULTS = Path(__file__).resolve().parent / "results"
HOST = "127.0.0.1"

# Varied in length and vocabulary, and rotated per request, so no reply can come from a cache and the
# batches a server forms pad like real traffic does.
SENTENCES = [
    "The quarterly report shows revenue grew by twelve percent compared with last year.",
    "Please reset my password, I can no longer log in.", "How do I convert a PyTorch model to ONNX?",
    "The train to Amsterdam was delayed by forty minutes because of a signal failure.",
    "She planted tomatoes, basil and peppers along the south-facing wall of the garden.",
    "Our API returns a 503 error whenever the upstream cache is cold.", "I love pasta.",
    "What is the difference between a mutual fund and an exchange-traded fund?",
    "The museum's new exhibition covers two centuries of Japanese woodblock prints.",
    "Add two cups of flour and a pinch of salt.", "Kubernetes evicted the pod: the node ran out of memory.",
    "The patient reported mild headaches and dizziness after starting the new medication.",
    "A sudden thunderstorm forced the organisers to postpone the open-air concert.",
    "Is it possible to cancel my subscription and still keep access until the end of the month?",
    "The committee approved the budget after a long debate.", "The striker scored twice in the second half.",
    "Solar panels on the warehouse roof now cover about a third of its electricity use.",
    "Gradient checkpointing trades extra compute for a much smaller memory footprint during training.",
    "My package was marked as delivered, but it never arrived.", "Why is my sourdough bread so dense?",
    "The city council voted to extend the bike lane network into the northern suburbs.",
    "Researchers found that the enzyme breaks down plastic faster at higher temperatures.",
    "Which laptop has the best battery life for under a thousand dollars?", "This function returns None.",
    "The hotel room was clean and quiet, although the breakfast was disappointing.",
    "Interest rates are expected to remain unchanged.", "He spent the afternoon repairing the fence.",
    "The database migration failed halfway through and left two tables locked.",
    "Whales communicate over hundreds of kilometres using low-frequency songs.",
    "Can you recommend a good introduction to linear algebra?", "Children under twelve travel free.",
    "The airline apologised for the lost luggage and offered a travel voucher.",
    "Volunteers collected more than two tonnes of litter from the beach on Saturday.",
    "The startup raised forty million dollars to expand its battery recycling plants.",
    "I would like to change the delivery address for order number 48213.", "Do you like pizza?",
    "Ancient Roman concrete has survived for millennia thanks to self-healing lime clasts.",
    "The new firmware update fixes the Bluetooth pairing issue on older headphones.",
    "Farmers are worried that the dry spring will reduce this year's wheat harvest.",
    "Our team meets every Tuesday to review open pull requests and plan the sprint.",
    "The novel follows three generations of a family living through the industrial revolution.",
    "The vaccine trial enrolled twelve thousand participants across nine countries.",
    "Latency spikes appear every few minutes when the garbage collector runs.",
    "The orchestra performed Mahler's fifth symphony.", "What are the side effects of ibuprofen?",
    "The bridge will be closed to traffic for two weekends while the deck is resurfaced.",
    "The telescope captured detailed images of a galaxy thirteen billion light years away.",
    "Store the encryption keys in a hardware security module, not in the repository.",
    "Remote work changed how cities use their offices.", "Heavy snow closed the mountain pass overnight.",
]
IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.4, 3.2, 4.5, 1.5], [6.3, 3.3, 6.0, 2.5], [4.9, 3.0, 1.4, 0.2],
             [5.7, 2.8, 4.1, 1.3], [7.2, 3.6, 6.1, 2.5], [5.0, 3.4, 1.5, 0.2], [5.5, 2.4, 3.8, 1.1]]
ENDPOINTS: dict[str, tuple[str, str]] = {  # name -> (model, path)
    "openai": ("minilm", "/v1/embeddings"),
    "v2": ("minilm", "/v2/models/minilm/infer"),
    "iris": ("iris", "/v2/models/iris/infer"),
    "grpc": ("minilm", "/inference.GRPCInferenceService/ModelInfer"),
    "grpc-iris": ("iris", "/inference.GRPCInferenceService/ModelInfer"),
}
GRPC_TWIN = {"grpc": "v2", "grpc-iris": "iris"}   # each gRPC endpoint and the HTTP one it is compared with


def grpc_messages(endpoint: str) -> list[bytes]:
    """ModelInferRequest messages, serialized: the tensors in raw_input_contents, as tritonclient sends them."""
    import struct

    from ember.wire.grpc.grpc_service_pb2 import ModelInferRequest

    out = []
    if endpoint == "grpc":
        for s in SENTENCES:
            message = ModelInferRequest(model_name="minilm")
            message.inputs.add(name="text", datatype="BYTES", shape=[1])
            message.raw_input_contents.append(struct.pack("<I", len(s.encode())) + s.encode())
            out.append(message.SerializeToString())
        return out
    for row in IRIS_ROWS:
        message = ModelInferRequest(model_name="iris")
        message.inputs.add(name="features", datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(struct.pack("<4f", *row))
        out.append(message.SerializeToString())
    return out


def request_bodies(endpoint: str) -> list[bytes]:
    if endpoint in GRPC_TWIN:
        return request_bodies(GRPC_TWIN[endpoint])
    if endpoint == "openai":
        return [json.dumps({"model": "minilm", "input": s}).encode() for s in SENTENCES]
    if endpoint == "v2":
        return [json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [s]}]}).encode()
                for s in SENTENCES]
    return [json.dumps({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": row}]}).encode()
            for row in IRIS_ROWS]


def summarize(latencies: list[float]) -> dict[str, float]:
    """Nearest-rank percentiles, in seconds."""
    xs = sorted(latencies)
    if not xs:
        return {"n": 0}

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]

    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1]}


def _proc_stats() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime + cutime + cstime in ticks) for every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it exited while we looked
                continue
            out[int(entry.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    return out


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall, whole machine's busy CPU s, this process tree's CPU s). Reaped children's time is in
    their parent's cutime, so exited client processes and instances stay counted as ours."""
    stats, tick = _proc_stats(), os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ours, stack = 0, [os.getpid()]
    while stack:
        pid = stack.pop()
        ours += stats.get(pid, (0, 0))[1]
        stack.extend(children.get(pid, []))
    user, nice, system = (int(x) for x in Path("/proc/stat").read_text().split()[1:4])
    return time.perf_counter(), (user + nice + system) / tick, ours / tick


def other_cores(before: tuple[float, float, float]) -> float:
    """Cores used by processes outside this tree since `before`: another job on the machine makes a
    cell's numbers meaningless (two torch threads on two cores slow down many times over, not 2x)."""
    after = cpu_snapshot()
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]))


# ----- the load generator (--client): no ember or torch import, to stay small and cheap -----

async def read_status(reader: asyncio.StreamReader) -> int:
    """One response: status line and headers, then exactly Content-Length bytes of body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:  # uvicorn sends Content-Length for every non-streaming Response
        raise ValueError(f"no Content-Length in {head[:200]!r}")
    await reader.readexactly(length)
    return int(lines[0].split(b" ", 2)[1])


async def connection(port: int, requests: list[bytes], offset: int, window: tuple[float, float],
                     stats: dict[str, Any]) -> None:
    """One closed-loop client: send, read the whole reply, send the next, until the window ends."""
    t_end = window[1]
    reader, writer = await asyncio.open_connection(HOST, port)
    i = offset
    while (start := time.perf_counter()) < t_end:
        writer.write(requests[i % len(requests)])
        i += 1
        try:
            status = await read_status(reader)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status = -1  # a broken connection: count it and open a new one
            writer.close()
            reader, writer = await asyncio.open_connection(HOST, port)
        count(stats, str(status), start, time.perf_counter(), window)
    writer.close()


def count(stats: dict[str, Any], status: str, start: float, done: float, window: tuple[float, float]) -> None:
    """Completions inside the window count (throughput and latency alike); warm-up ones only by status."""
    t_measure, t_end = window
    bucket = stats["window"] if t_measure <= done <= t_end else stats["warmup"] if done < t_measure else None
    if bucket is not None:
        bucket[status] = bucket.get(status, 0) + 1
        if status == "200" and bucket is stats["window"]:
            stats["latencies"].append(done - start)


async def grpc_connection(port: int, requests: list[bytes], offset: int, window: tuple[float, float],
                          stats: dict[str, Any]) -> None:
    """One closed-loop gRPC client on a connection of its own (a local subchannel pool: channels to one address
    would otherwise share one); "200" counts an OK, any other status is counted by its code's name."""
    import grpc

    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=options) as channel:
        infer = channel.unary_unary(ENDPOINTS["grpc"][1])   # bytes in, bytes out: serialized once, parsed never
        i = offset
        while (start := time.perf_counter()) < window[1]:
            try:
                await infer(requests[i % len(requests)])
                status = "200"
            except grpc.aio.AioRpcError as err:
                status = err.code().name
            i += 1
            count(stats, status, start, time.perf_counter(), window)


async def drive(spec: dict[str, Any]) -> dict[str, Any]:
    model, path = ENDPOINTS[spec["endpoint"]]
    stats: dict[str, Any] = {"window": {}, "warmup": {}, "latencies": []}
    t0 = time.perf_counter()
    window = (t0 + spec["warmup"], t0 + spec["warmup"] + spec["duration"])
    if spec["endpoint"] in GRPC_TWIN:
        messages = grpc_messages(spec["endpoint"])
        tasks = [asyncio.ensure_future(grpc_connection(spec["grpc_port"], messages, k * 7, window, stats))
                 for k in range(spec["clients"])]
    else:
        head = f"POST {path} HTTP/1.1\r\nHost: {HOST}:{spec['port']}\r\nContent-Type: application/json\r\n"
        # Encoded once: the client's per-request work is one write and one parse.
        requests = [f"{head}Content-Length: {len(b)}\r\n\r\n".encode() + b
                    for b in request_bodies(spec["endpoint"])]
        tasks = [asyncio.ensure_future(connection(spec["port"], requests, k * 7, window, stats))
                 for k in range(spec["clients"])]
    # Past the window, a stuck request is abandoned rather than holding the whole run.
    finished, pending = await asyncio.wait(tasks, timeout=spec["warmup"] + spec["duration"] + 60)
    for task in pending:
        task.cancel()
    failures = [repr(t.exception()) for t in finished if t.exception() is not None]
    ok = stats["window"].get("200", 0)
    return {"endpoint": spec["endpoint"], "model": model, "clients": spec["clients"],
            "duration_s": spec["duration"], "rps": ok / spec["duration"], "status": stats["window"],
            "warmup_status": stats["warmup"], "latency_s": summarize(stats["latencies"]),
            "abandoned_connections": len(pending), "connection_failures": failures[:5]}


def client_main(spec: dict[str, Any]) -> None:
    try:
        import uvloop  # a cheaper event loop leaves more of the cores to the server

        run: Callable[[Any], dict[str, Any]] = uvloop.run
        loop = "uvloop"
    except ImportError:
        run, loop = asyncio.run, "asyncio"
    print(json.dumps({**run(drive(spec)), "loop": loop}))


# ----- in-process baselines (--baseline): a separate process, run after the server has stopped -----


def timed_calls(call: Callable[[int], object], duration: float, warmup: float) -> list[float]:
    """Seconds per call(k), k counting up, for `duration` seconds after `warmup` seconds of calls."""
    k, times = 0, []
    t0 = time.perf_counter()
    while (start := time.perf_counter()) < t0 + warmup + duration:
        call(k)
        k += 1
        if start >= t0 + warmup:
            times.append(time.perf_counter() - start)
    return times


def baseline_main(spec: dict[str, Any]) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu", local_files_only=True)
    out: dict[str, Any] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "sizes": {}}
    for n in spec["sizes"]:
        def encode(k: int, n: int = n) -> object:
            batch = [SENTENCES[(k * n + j) % len(SENTENCES)] for j in range(n)]
            # batch_size=n: one forward pass per call, the batch a server would form from n clients.
            return model.encode(batch, batch_size=n, convert_to_numpy=True, show_progress_bar=False)

        before = cpu_snapshot()
        times = timed_calls(encode, spec["duration"], spec["warmup"])
        out["sizes"][str(n)] = {"batch": n, "calls": len(times), "sentences_per_s": n * len(times) / sum(times),
                                "call_s": summarize(times), "other_cores": other_cores(before)}
    print(json.dumps(out))


# ----- the orchestrator -----

def run_self(mode: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """This script in `mode` as a fresh process; its last stdout line is the JSON result."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, mode, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def jobs_queued(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ember_jobs_queued "):
            return float(line.split()[1])
    return 0.0


def drain(url: str, limit_s: float = 600) -> float:
    """Wait until the 202s' durable jobs have run, so they do not eat the next cell's cores."""
    t0 = time.perf_counter()
    while jobs_queued(url) > 0 and time.perf_counter() - t0 < limit_s:
        time.sleep(0.5)
    time.sleep(1.5)  # a job taken off the queue may still be running
    return time.perf_counter() - t0


def warm(url: str, endpoint: str) -> None:
    """A few sequential requests: the model's instance is up and hot before the first cell (a gRPC endpoint's model
    over HTTP)."""
    path = ENDPOINTS[GRPC_TWIN.get(endpoint, endpoint)][1]
    with httpx.Client(base_url=url, timeout=120) as client:
        for body in request_bodies(endpoint)[:5]:
            client.post(path, content=body, headers={"Content-Type": "application/json"}).raise_for_status()


def instances(url: str, model: str) -> int:
    models = httpx.get(url + "/ember/status", timeout=10).json()["models"]
    return sum(len(m["instances"]) for m in models if m["name"] == model)


def run_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ember.testing.server import EmberServer

    cells = []
    grpc_port = free_port()
    with tempfile.TemporaryDirectory(prefix="ember-throughput-", dir="/tmp") as tmp, \
            EmberServer(Path(tmp) / "state", "--log-level", "warning", "--grpc-port", str(grpc_port)) as server:
        for endpoint in args.endpoints:
            warm(server.url, endpoint)
        # Client counts outside, endpoints inside: the cells a ratio compares (grpc and v2 at 8 clients) run side by
        # side, so a change in the machine's other load between them is as small as it can be.
        for clients in args.clients:
            for endpoint in args.endpoints:
                spec = {"endpoint": endpoint, "port": server.port, "grpc_port": grpc_port, "clients": clients,
                        "duration": args.duration, "warmup": args.warmup}
                before = cpu_snapshot()
                cell = run_self("--client", spec, timeout=args.warmup + args.duration + 120)
                cell["other_cores"] = other_cores(before)
                cell["instances_after"] = instances(server.url, ENDPOINTS[endpoint][0])
                cell["drain_s"] = drain(server.url)
                cells.append(cell)
                print(f"  {endpoint:6} {clients:4} clients: {cell['rps']:8.1f} req/s  {cell['status']}", flush=True)
    return cells


def baseline_for(cell: dict[str, Any], baselines: dict[str, Any]) -> dict[str, Any] | None:
    """In-process single sentences for 1 client, a batch of N sentences for N clients (minilm only)."""
    if cell["model"] != "minilm":
        return None
    sizes: dict[str, Any] = baselines["sizes"]
    return sizes.get(str(cell["clients"]))


def target(name: str, measured: float | None, limit: float | None, at_least: bool, unit: str) -> dict[str, Any]:
    met = None if measured is None or limit is None else (measured >= limit if at_least else measured <= limit)
    return {"target": name, "measured": measured, "limit": limit, "unit": unit, "met": met}


def targets(cells: list[dict[str, Any]], baselines: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(c["endpoint"], c["clients"]): c for c in cells}
    out = []
    for endpoint in ("openai", "v2"):
        for n, what in ((1, "in-process single"), (8, "in-process batch of 8"), (32, "in-process batch of 32")):
            cell = by.get((endpoint, n))
            base = baseline_for(cell, baselines) if cell else None
            ratio = cell["rps"] / base["sentences_per_s"] if cell and base else None
            out.append(target(f"{endpoint}, {n} client(s): req/s >= 0.9x {what}", ratio, 0.9, True, "x"))
    below = [c for c in cells if c["clients"] < 128]
    accepted = sum(c["status"].get("202", 0) + c["warmup_status"].get("202", 0) for c in below)
    out.append(target("no 202 below 128 clients (all endpoints, warm-up included)",
                      accepted if below else None, 0, False, ""))
    for grpc_endpoint, http_endpoint in GRPC_TWIN.items():
        for n in (1, 8, 32):
            over_grpc, over_http = by.get((grpc_endpoint, n)), by.get((http_endpoint, n))
            ratio = over_grpc["rps"] / over_http["rps"] if over_grpc and over_http and over_http["rps"] else None
            out.append(target(f"{grpc_endpoint}, {n} client(s): req/s >= 0.9x {http_endpoint} (HTTP), same run",
                              ratio, 0.9, True, "x"))
    batch32 = baselines["sizes"].get("32", {}).get("call_s", {}).get("p50")
    for endpoint in ("openai", "v2"):
        one, many = by.get((endpoint, 1)), by.get((endpoint, 32))
        limit = 3 * one["latency_s"]["p50"] + batch32 if one and batch32 and one["latency_s"]["n"] else None
        p99 = many["latency_s"].get("p99") if many else None
        out.append(target(f"{endpoint}: p99 at 32 clients <= 3x 1-client p50 + in-process batch-of-32 compute",
                          p99 * 1e3 if p99 is not None else None, limit * 1e3 if limit else None, False, " ms"))
    return out


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")), platform.processor())
    def git(*cmd: str) -> bytes:
        return subprocess.run(["git", *cmd], capture_output=True, cwd=Path(__file__).parent).stdout.strip()

    # The tree is edited while benchmarks run: the diff's hash tells which uncommitted state was measured.
    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "cpu_model": model_name,
            "python": platform.python_version(), "torch": version("torch"),
            "sentence_transformers": version("sentence-transformers"), "platform": platform.platform(),
            "git": git("describe", "--always", "--dirty").decode(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "ember_diff_sha256": hashlib.sha256(git("diff", "HEAD", "--", "ember")).hexdigest()[:12]}


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


NOISY_CORES = 0.1  # other processes' CPU above this in a phase: its numbers are not this code's


def cells_table(r: dict[str, Any]) -> Any:
    from rich.table import Table

    b = r["baselines"]
    t = Table(title=f"ember throughput, closed-loop clients, {r['duration_s']:g} s per cell; req/s and latency "
                    f"count 200s only; in-process: sentence_transformers, {b['torch_threads']} torch threads")
    for col in ("endpoint", "clients", "req/s", "p50 ms", "p99 ms", "202s", "429s", "errors", "inst",
                "other cpu", "in-process sent/s", "ratio"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for c in r["cells"]:
        lat, st, base = c["latency_s"], c["status"], baseline_for(c, b)
        errors = sum(v for k, v in st.items() if k not in ("200", "202", "429"))
        base_rps = base["sentences_per_s"] if base else None
        base_label = f"{fmt(base_rps, '.1f')} ({'single' if c['clients'] == 1 else 'batch'})" if base else "—"
        t.add_row(c["endpoint"], str(c["clients"]), f"{c['rps']:.1f}", fmt(lat.get("p50"), ".1f", 1e3),
                  fmt(lat.get("p99"), ".1f", 1e3), str(st.get("202", 0)), str(st.get("429", 0)), str(errors),
                  str(c["instances_after"]), f"{c['other_cores']:.2f}", base_label,
                  fmt(c["rps"] / base_rps if base_rps else None, ".2f"))
    return t


def print_report(r: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(width=150)
    console.print(cells_table(r))
    sizes = r["baselines"]["sizes"]
    console.print("in-process compute per call (p50), by batch size: "
                  + ", ".join(f"{k}: {v['call_s']['p50'] * 1e3:.1f} ms" for k, v in sizes.items()))
    noisy = [f"{c['endpoint']}/{c['clients']}" for c in r["cells"] if c["other_cores"] > NOISY_CORES]
    noisy += [f"in-process/{k}" for k, v in sizes.items() if v["other_cores"] > NOISY_CORES]
    if noisy:
        console.print(f"[red]warning: other processes used > {NOISY_CORES} cores during {', '.join(noisy)}: "
                      "those numbers measure the machine's other load too; rerun on a quiet machine[/red]")
    for g in r["targets"]:
        verdict = {True: "[green]met[/green]", False: "[red]unmet[/red]", None: "[yellow]not measured[/yellow]"}
        measured, limit = (fmt(g[k], ".3g") + (g["unit"] if g[k] is not None else "") for k in ("measured", "limit"))
        console.print(f"target: {g['target']}: measured {measured}, limit {limit} -> {verdict[g['met']]}")
    console.print(f"JSON: {r['out']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,32,128", help="client counts (default 1,8,32,128)")
    ap.add_argument("--duration", type=float, default=10, help="measured seconds per cell (default 10)")
    ap.add_argument("--warmup", type=float, default=2, help="unmeasured seconds before each cell (default 2)")
    ap.add_argument("--endpoints", default="openai,v2,iris,grpc,grpc-iris",
                    help="subset of openai,v2,iris,grpc,grpc-iris (default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke run: clients 1,8, 3 s per cell")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/throughput.json; "
                                             "throughput_quick.json with --quick, so a smoke run keeps a real one)")
    ap.add_argument("--client", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.clients, args.duration = "1,8", 3.0
    args.clients = [int(n) for n in args.clients.split(",")]
    args.endpoints = [e for e in args.endpoints.split(",") if e]
    args.out = args.out or RESULTS / ("throughput_quick.json" if args.quick else "throughput.json")
    return args


def main() -> None:
    args = parse_args()
    if args.client:
        client_main(json.loads(args.client))
        return
    if args.baseline:
        baseline_main(json.loads(args.baseline))
        return
    print(f"ember serve, endpoints {args.endpoints}, clients {args.clients}, {args.duration:g} s per cell", flush=True)
    cells = run_cells(args)
    sizes = sorted({1, *args.clients})
    print(f"in-process baselines, sizes {sizes}, {args.duration:g} s each", flush=True)
    spec = {"sizes": sizes, "duration": args.duration, "warmup": args.warmup}
    baselines = run_self("--baseline", spec, timeout=len(sizes) * (args.duration + args.warmup + 60) + 120)
    result = {"duration_s": args.duration, "warmup_s": args.warmup, "clients": args.clients,
              "machine": {**machine_info(), "baseline_torch_threads": baselines["torch_threads"]},
              "cells": cells, "baselines": baselines, "targets": targets(cells, baselines), "out": str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_report(result)


if __name__ == "__main__":
    main()
