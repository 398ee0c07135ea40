"""Density: many models on one node, driven by an hour of the Azure Functions 2019 trace, against two ways users
run many models today.

The node: one `ember serve` with default settings (no flag but the models, its state directory and ports),
serving N copies of the bundled models (iris, MiniLM, SmolLM2) under their own names (`iris-01`, `minilm-07`,
...), each copy in a directory of its own under a temporary directory this bench makes (and removes) and with
weights of its own: one byte of each copy's weights changed (the lowest bits of a float, or of 4-bit quants),
so no two copies share a file or a digest. The trace drives them (`ember.testing.density`: functions picked
across the ranks of the window's invocations, each minute capped, placed at random in it, sped up) through real
HTTP requests, sent open-loop at their times: V2 infer for iris and MiniLM (first response: the whole answer),
a streamed chat of at most 8 tokens for SmolLM2 (first response: the first content chunk). Every request's rung
is its `Ember-Rung` header (`queued`: a 202, the request became a job). Every `--sample-s` the node's
`/ember/status` gives the PSS of its zygotes, templates and instances (and the gateway's own is read): the
node's memory over time, the instances and templates it holds.

Against, in the same run:
(a) always-on: one plain process per model (`python` that imports the runtime, loads the copy and answers one
    request, as ember's instances run it, with no sandbox or slice): two such processes of each kind are started
    one after another and measured (PSS, private USS) while both are up; N processes of a kind are then charged
    N x USS + the pages the two share once (sum of PSS - sum of USS: the libraries' and weights' file pages). That
    is computed from measured per-model memory, not N processes started.
(b) a fixed keep-alive of 5 minutes then a full cold start (Ollama's default `keep_alive`), simulated on the same
    arrivals (the times they were sent) with the full cold start measured in this run: the plain process's time
    from its start to its first answer (median of the two per kind); its hot latency is ember's hot-rung p50 of
    the kind in this run. Not modelled, in the baseline's favour: queueing on a loaded process, and Ollama's
    default cap of 3 loaded models on CPU (`OLLAMA_MAX_LOADED_MODELS`), which would evict.
Keep-alive times are wall seconds on both sides: the trace is replayed `--speedup` times faster, so ember's and
the baseline's keep-alives both see its idle gaps shortened as much.

Targets (issue 45): p99 first response <= 1 s for every model the trace calls; the node's memory <= 50% of
always-on's; full cold starts (rung `fetch`: nothing of the model kept) <= 0.5x the baseline's.

Prints the tables and writes bench/results/density.json (the commit, `uptime` before and after, every request).
Usage: python bench/density.py [--quick] [--hour 9] [--minutes 60] [--speedup 4] [--cap 10] [--mix ...]
       [--serve-arg=--keepalive --serve-arg=ladder ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ember.node import procinfo
from ember.sim.traces import load_azure2019_day
from ember.testing.density import (
    ModelLoad,
    fixed_keepalive,
    map_trace,
    nearest_rank,
    processes_mb,
    up_at,
)
from ember.testing.gguf_models import smollm2_path
from ember.testing.models import minilm_dir
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TRACE = REPO.parent / "shared" / "traces" / "azure-functions-2019" / "dev-a"
KEEP_S = 300.0   # Ollama's default keep_alive
MB = 1 << 20
KINDS = ("iris", "minilm", "smollm2")
SENTENCE = "Serverless economics is the long tail."
CHAT = '{"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}'
# The one request of each kind, as the plain process's inputs (a string: one BYTES element; a list: one FP32 row).
PLAIN_INPUTS: dict[str, dict[str, Any]] = {"iris": {"features": [5.1, 3.5, 1.4, 0.2]}, "minilm": {"text": SENTENCE},
                                           "smollm2": {"request": CHAT}}


# --- the models: copies with weights of their own ----------------------------------------------------------------

def _example(kind: str) -> dict[str, Any]:
    data: dict[str, Any] = load_contract(example_contracts_dir() / f"{kind}.yaml").model_dump(
        mode="json", exclude={"source"})
    return data


def _flip(path: Path, offset: int, copy: int) -> None:
    """XOR the byte at `offset` with a value of this copy's (1..255): the low bits of one weight."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (copy % 255 + 1)]))


def _gguf_data_offset(path: Path) -> int:
    """Where the first quantized tensor's first block's quants begin (past its 4 bytes of scales)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.tensor_type.name.startswith("Q"))
    return int(tensor.data_offset) + 4


def make_copy(root: Path, name: str, kind: str, copy: int) -> Path:
    """The directory of model `name`, a copy of the bundled `kind` with one weight changed; its contract file."""
    where = root / name
    where.mkdir(parents=True)
    data = _example(kind)
    data["name"] = name
    if kind == "iris":
        shutil.copytree(example_contracts_dir() / "iris_softmax", where / "iris_softmax")
        weights = where / "iris_softmax" / "iris.npz"
        arrays = dict(np.load(weights))
        first = next(k for k, v in arrays.items() if v.dtype.kind == "f")
        arrays[first] = arrays[first] + np.float32(1e-6 * copy)
        np.savez(weights, **arrays)
    elif kind == "minilm":
        shutil.copytree(minilm_dir(), where / "model")
        safetensors = where / "model" / "model.safetensors"
        _flip(safetensors, safetensors.stat().st_size - 4, copy)
        data["weights"] = str(where / "model")
    else:
        gguf = where / "model.gguf"
        shutil.copyfile(smollm2_path(), gguf)
        _flip(gguf, _gguf_data_offset(gguf), copy)
        data["weights"] = str(gguf)
    contract = where / f"{name}.yaml"
    contract.write_text(json.dumps(data))
    return contract


# --- requests ------------------------------------------------------------------------------------------------------

async def _v2(client: httpx.AsyncClient, url: str, model: str, kind: str) -> tuple[int, str, float]:
    if kind == "iris":
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]}
    else:
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}]}
    t0 = time.monotonic()
    r = await client.post(f"{url}/v2/models/{model}/infer", json=body)
    return r.status_code, r.headers.get("ember-rung", "?"), time.monotonic() - t0


def _content(event: str) -> bool:
    """Whether a chat chunk carries text; RuntimeError for an error event."""
    data = json.loads(event)
    if "error" in data:
        raise RuntimeError(str(data["error"])[:200])
    choices = data.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def _chat(client: httpx.AsyncClient, url: str, model: str) -> tuple[int, str, float]:
    body = {**json.loads(CHAT), "model": model, "stream": True}
    t0 = time.monotonic()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        rung, first = r.headers.get("ember-rung", "?"), math.inf
        async for line in r.aiter_lines():
            if line.startswith(": ember-rung "):
                rung = line.split()[-1]
            if first == math.inf and line.startswith("data: {") and _content(line[6:]):
                first = time.monotonic() - t0
        return r.status_code, rung, first


async def _one(client: httpx.AsyncClient, url: str, load: ModelLoad, at: float, t0: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    sent = time.monotonic() - t0
    try:
        status, rung, first = await (_chat(client, url, load.name) if load.kind == "smollm2"
                                     else _v2(client, url, load.name, load.kind))
    except (httpx.HTTPError, RuntimeError) as err:
        status, rung, first = 0, f"error: {type(err).__name__}: {err}"[:120], math.inf
    if status == 202:
        rung, first = "queued", math.inf
    elif status not in (0, 200):
        rung, first = f"error: {status}", math.inf
    return {"model": load.name, "kind": load.kind, "at": round(at, 4), "sent": round(sent, 4),
            "first_s": round(first, 5) if first < math.inf else first, "rung": rung}


async def replay(url: str, loads: list[ModelLoad], t0: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return list(await asyncio.gather(*(_one(client, url, m, float(a), t0) for m in loads for a in m.arrivals)))


# --- the node over time --------------------------------------------------------------------------------------------

class Sampler(threading.Thread):
    """Every `every_s`: the node's PSS (gateway, zygotes, templates, instances) and what it holds, per kind."""

    def __init__(self, server: EmberServer, kinds: dict[str, str], t0: float, every_s: float) -> None:
        super().__init__(daemon=True)
        self.server, self.kinds, self.t0, self.every_s = server, kinds, t0, every_s
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._halt.is_set():
                with contextlib.suppress(httpx.HTTPError, ProcessLookupError):
                    self.samples.append(self.sample(client))
                self._halt.wait(self.every_s)

    def sample(self, client: httpx.Client) -> dict[str, Any]:
        assert self.server.proc is not None
        status = client.get(self.server.url + "/ember/status").json()
        gateway = procinfo.memory_of(self.server.proc.pid).pss_bytes / MB
        zygotes = sum(z["pss_bytes"] or 0 for z in status["node"]["zygotes"]) / MB
        out: dict[str, Any] = {"t": time.monotonic() - self.t0, "gateway_mb": gateway, "zygotes_mb": zygotes,
                               "templates_mb": 0.0, "instances_mb": 0.0, "busy_mb": 0.0, "templates": {},
                               "instances": {}}
        for m in status["models"]:
            kind = self.kinds.get(m["name"])
            if kind is None:
                continue
            if m["template"]:
                out["templates_mb"] += (m["template"]["pss_bytes"] or 0) / MB
                out["templates"][kind] = out["templates"].get(kind, 0) + 1
            for inst in m["instances"]:
                pss = (inst["pss_bytes"] or 0) / MB
                out["instances_mb"] += pss
                out["busy_mb"] += pss if inst["inflight"] else 0.0
                key = f"{kind}:{inst['state']}"
                out["instances"][key] = out["instances"].get(key, 0) + 1
        out["node_mb"] = gateway + zygotes + out["templates_mb"] + out["instances_mb"]
        out["idle_mb"] = out["node_mb"] - out["busy_mb"]
        return out

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and every process below it, with those of the children they reaped."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry.name))
    ticks, stack = 0, [root]
    while stack:
        pid = stack.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[11:15])   # utime, stime, cutime, cstime
        stack.extend(children.get(pid, []))
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_deployed(server: EmberServer, names: set[str], timeout_s: float) -> float:
    """Seconds until every model is READY with its template; RuntimeError naming those that are not."""
    began = time.monotonic()
    while True:
        models = {m["name"]: m for m in server.status()["models"] if m["name"] in names}
        missing = sorted(n for n in names if n not in models or not models[n]["state"].startswith("READY")
                         or not models[n]["template"])
        if not missing:
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise RuntimeError(f"not deployed in {timeout_s:.0f} s: {missing[:5]} ({len(missing)} in all)")
        time.sleep(1.0)


# --- plain processes: always-on memory and the full cold start ----------------------------------------------------

PLAIN = r"""
import json, sys
import numpy as np
from ember.runtimes import get_runtime, replies_of
from ember.wire.contract import load_contract
c = load_contract(sys.argv[1])
runtime = get_runtime(c.runtime)
runtime.preload()
model = runtime.load(c)
inputs = {k: np.array([v.encode()], dtype=object) if isinstance(v, str) else np.array([v], dtype=np.float32)
          for k, v in json.loads(sys.argv[2]).items()}
for _ in replies_of(model, inputs):
    pass
print("READY", flush=True)
sys.stdin.read()
"""


def plain_processes(kind: str, contracts: list[Path]) -> dict[str, Any]:
    """Two plain processes of `kind`, started one after the other: each one's time to its first answer, and
    their memory while both are up."""
    procs, cold_s = [], []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        for contract in contracts[:2]:
            began = time.monotonic()
            p = subprocess.Popen([sys.executable, "-c", PLAIN, str(contract), json.dumps(PLAIN_INPUTS[kind])],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            procs.append(p)
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith(b"READY"):
                raise RuntimeError(f"plain {kind} process: no answer (exit {p.wait()})")
            cold_s.append(time.monotonic() - began)
        time.sleep(1.0)
        mem = [procinfo.memory_of(p.pid) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    uss = [m.uss_bytes / MB for m in mem]
    shared = sum(m.pss_bytes for m in mem) / MB - sum(uss)
    return {"cold_s": cold_s, "uss_mb": statistics.mean(uss), "shared_mb": shared,
            "pss_mb": [m.pss_bytes / MB for m in mem], "rss_mb": [m.rss_bytes / MB for m in mem]}


# --- the summary ---------------------------------------------------------------------------------------------------

def latency_row(first_s: list[float]) -> dict[str, Any]:
    return {"n": len(first_s), "p50_ms": 1e3 * nearest_rank(first_s, 50), "p99_ms": 1e3 * nearest_rank(first_s, 99)}


def grouped(requests: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[float]] = {}
    for r in requests:
        groups.setdefault(r[key], []).append(r["first_s"])
    return {k: latency_row(v) for k, v in sorted(groups.items())}


def fixed_baseline(loads: list[ModelLoad], requests: list[dict[str, Any]], plain: dict[str, Any],
                   hot_s: dict[str, float], end_s: float, times: np.ndarray) -> dict[str, Any]:
    """(b) on the arrivals as sent: full cold starts, first responses, and its memory at `times`."""
    latencies: list[float] = []
    per_model, cold, cold_later = {}, 0, 0
    up = {k: np.zeros(len(times)) for k in plain}
    for m in loads:
        sent = np.sort([r["sent"] for r in requests if r["model"] == m.name])
        out = fixed_keepalive(sent, KEEP_S, statistics.median(plain[m.kind]["cold_s"]), hot_s[m.kind], end_s)
        latencies += out.latency_s.tolist()
        cold += int(out.cold.sum())
        cold_later += int(out.cold[1:].sum())
        up[m.kind] += up_at(out.loaded, times)
        if len(sent):
            per_model[m.name] = latency_row(out.latency_s.tolist())
    memory = sum((processes_mb(up[k], plain[k]["uss_mb"], plain[k]["shared_mb"]) for k in plain),
                 np.zeros(len(times)))
    return {"full_cold_starts": cold, "full_cold_starts_after_first": cold_later, **latency_row(latencies),
            "models": per_model, "memory_mb": memory.tolist(), "hot_s": hot_s,
            "cold_s": {k: statistics.median(v["cold_s"]) for k, v in plain.items()}}


def summarize(loads: list[ModelLoad], requests: list[dict[str, Any]], samples: list[dict[str, Any]],
              plain: dict[str, Any], end_s: float) -> dict[str, Any]:
    kinds = {m.kind for m in loads}
    count = {k: sum(m.kind == k for m in loads) for k in kinds}
    always_on = sum(float(processes_mb(count[k], plain[k]["uss_mb"], plain[k]["shared_mb"])) for k in kinds)
    # (b)'s hot latency: ember's hot-rung median of the kind (none: the median of its answered requests).
    hot_s = {}
    for k in kinds:
        hot = [r["first_s"] for r in requests if r["kind"] == k and r["rung"] == "hot"]
        answered = [r["first_s"] for r in requests if r["kind"] == k and r["first_s"] < math.inf]
        hot_s[k] = statistics.median(hot or answered or [0.0])
    times = np.array([s["t"] for s in samples])
    fixed = fixed_baseline(loads, requests, plain, hot_s, end_s, times)
    models = grouped(requests, "model")
    node = np.array([s["node_mb"] for s in samples])
    full = sum(r["rung"] == "fetch" for r in requests)
    return {
        "rungs": grouped(requests, "rung"), "kinds": grouped(requests, "kind"), "models": models,
        "models_called": len(models), "models_p99_within_1s": sum(v["p99_ms"] <= 1000 for v in models.values()),
        "fixed_models_p99_within_1s": sum(v["p99_ms"] <= 1000 for v in fixed["models"].values()),
        "all": latency_row([r["first_s"] for r in requests]),
        "node_mb_mean": float(node.mean()), "node_mb_max": float(node.max()),
        "idle_mb_mean": float(np.mean([s["idle_mb"] for s in samples])),
        "always_on_mb": always_on, "fixed": fixed, "full_cold_starts": full,
        "memory_ratio_mean": float(node.mean()) / always_on, "memory_ratio_max": float(node.max()) / always_on,
        "cold_ratio": full / fixed["full_cold_starts"] if fixed["full_cold_starts"] else math.nan,
    }


def timeline(samples: list[dict[str, Any]], fixed_mb: list[float], end_s: float, speedup: float,
             bins: int = 6) -> list[dict[str, Any]]:
    """Per part of the window: mean node and idle PSS, the (b) baseline's memory, instances and templates held."""
    t = np.array([s["t"] for s in samples])
    out = []
    for i in range(bins):
        a, b = end_s * i / bins, end_s * (i + 1) / bins
        idx = [j for j in range(len(t)) if a <= t[j] < b] or [int(np.argmin(np.abs(t - a)))]
        pick = [samples[j] for j in idx]
        out.append({"trace_min": [round(a * speedup / 60, 1), round(b * speedup / 60, 1)],
                    "node_mb": statistics.mean(s["node_mb"] for s in pick),
                    "idle_mb": statistics.mean(s["idle_mb"] for s in pick),
                    "fixed_mb": statistics.mean(fixed_mb[j] for j in idx),
                    "instances": statistics.mean(sum(s["instances"].values()) for s in pick),
                    "templates": statistics.mean(sum(s["templates"].values()) for s in pick)})
    return out


def _ms(x: float) -> str:
    return "inf" if x == math.inf else "n/a" if math.isnan(x) else f"{x:.0f}"


def report(r: dict[str, Any]) -> str:
    s, f = r["summary"], r["summary"]["fixed"]
    lines = [f"{r['models']} models ({r['mix']}), {r['requests']} requests: {r['trace']} hour {r['hour']} "
             f"({r['minutes']} min) x{r['speedup']:g}, cap {r['cap']}/min; commit {r['commit']}; "
             f"ember serve {' '.join(r['serve_args']) or '(default settings)'}",
             f"load before: {r['uptime_before']}", f"load after:  {r['uptime_after']}", "",
             f"{'rung':<12}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}"]
    for name, row in [*s["rungs"].items(), *((f"[{k}]", v) for k, v in s["kinds"].items()), ("all", s["all"]),
                      ("(b) fixed 5m", f)]:
        lines.append(f"{name:<12}{row['n']:>6}{_ms(row['p50_ms']):>9}{_ms(row['p99_ms']):>9}")
    lines += ["", f"{'trace min':<12}{'node MB':>9}{'idle MB':>9}{'(b) MB':>9}{'inst':>6}{'tmpl':>6}"]
    for b in r["timeline"]:
        lines.append(f"{b['trace_min'][0]:>4g}-{b['trace_min'][1]:<7g}{b['node_mb']:>9.0f}{b['idle_mb']:>9.0f}"
                     f"{b['fixed_mb']:>9.0f}{b['instances']:>6.1f}{b['templates']:>6.1f}")
    cold = f["cold_s"]
    lines += ["", f"always-on (a): {s['always_on_mb']:.0f} MB; ember node mean {s['node_mb_mean']:.0f} MB "
                  f"({100 * s['memory_ratio_mean']:.0f}%), max {s['node_mb_max']:.0f} MB "
                  f"({100 * s['memory_ratio_max']:.0f}%); (b) mean {np.mean(f['memory_mb']):.0f} MB",
              f"full cold starts: ember {s['full_cold_starts']}, (b) {f['full_cold_starts']} "
              f"({f['full_cold_starts_after_first']} after each model's first); measured full start: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(cold.items())),
              f"models with p99 first response <= 1 s: ember {s['models_p99_within_1s']} of {s['models_called']} "
              f"called; (b) {s['fixed_models_p99_within_1s']} of {s['models_called']}",
              f"deploy: {r['deploy_s']:.0f} s from the server's start until every model held its template; "
              f"the node's CPU over the replay: {r['node_cpu_s']:.0f} s in {r['replay_s']:.0f} s "
              f"({r['node_cpu_s'] / r['replay_s']:.2f} of {os.cpu_count()} cores)"]
    return "\n".join(lines)


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _mix(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        kind, _, n = part.partition("=")
        if kind not in KINDS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--mix: KIND=N,... with KIND one of {', '.join(KINDS)} and N >= 1, got {part!r}")
        mix[kind] = int(n)
    return mix


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    day = load_azure2019_day(args.trace)
    mix = _mix(args.mix)
    loads = map_trace(day.counts, day.functions, args.hour * 60, args.minutes, mix, args.cap, args.speedup, args.seed)
    contracts = {m.name: make_copy(root / "models", m.name, m.kind, i) for i, m in enumerate(loads, start=1)}
    print(f"{len(loads)} copies in {root}; plain processes ...", flush=True)
    plain = {k: plain_processes(k, [contracts[m.name] for m in loads if m.kind == k]) for k in mix}
    before = _uptime()
    flags = [x for c in contracts.values() for x in ("--models", str(c.parent))]
    server = EmberServer(root / "state", *flags, *args.serve_arg)
    began = time.monotonic()
    server.start(ready_timeout=600)
    try:
        wait_deployed(server, set(contracts), timeout_s=900)
        deploy_s = time.monotonic() - began
        print(f"deployed in {deploy_s:.0f} s; replaying {sum(len(m.arrivals) for m in loads)} requests ...",
              flush=True)
        assert server.proc is not None
        t0, cpu0 = time.monotonic(), tree_cpu_s(server.proc.pid)
        sampler = Sampler(server, {m.name: m.kind for m in loads}, t0, args.sample_s)
        sampler.start()
        requests = asyncio.run(replay(server.url, loads, t0))
        end_s = max(args.minutes * 60 / args.speedup, time.monotonic() - t0)
        sampler.stop()
        node_cpu_s = tree_cpu_s(server.proc.pid) - cpu0
    finally:
        server.stop()
        with contextlib.suppress(OSError):   # the node's log, outside the repository
            shutil.copyfile(server.log, Path(tempfile.gettempdir()) / f"density-serve-{server.port}.log")
    summary = summarize(loads, requests, sampler.samples, plain, end_s)
    return {"commit": _commit(), "uptime_before": before, "uptime_after": _uptime(), "trace": str(args.trace),
            "hour": args.hour, "minutes": args.minutes, "speedup": args.speedup, "cap": args.cap, "seed": args.seed,
            "mix": args.mix, "serve_args": args.serve_arg, "models": len(loads), "requests": len(requests),
            "deploy_s": deploy_s, "node_cpu_s": node_cpu_s, "replay_s": end_s, "plain": plain, "summary": summary,
            "timeline": timeline(sampler.samples, summary["fixed"]["memory_mb"], end_s, args.speedup),
            "functions": [{"model": m.name, "function": m.function, "window_invocations": m.window_invocations,
                           "requests": len(m.arrivals)} for m in loads],
            "samples": sampler.samples, "requests_sent": requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="an azure-functions-2019 day's directory (dev-a)")
    p.add_argument("--hour", type=int, default=9, help="the window starts at this hour of the day (0-23)")
    p.add_argument("--minutes", type=int, default=60, help="the window's length in trace minutes")
    p.add_argument("--speedup", type=float, default=4.0, help="replay this many times faster than the trace")
    p.add_argument("--cap", type=int, default=10, help="at most this many invocations of a function a trace minute")
    p.add_argument("--mix", default="iris=14,minilm=20,smollm2=6", help="models of each kind: KIND=N,...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=5.0, help="how often the node's memory is read")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="a flag for `ember serve`, repeatable (default: none, the default settings)")
    p.add_argument("--quick", action="store_true",
                   help="12 models (iris=4,minilm=6,smollm2=2), 10 trace minutes: a few minutes in all")
    p.add_argument("--out", type=Path, help="JSON (default bench/results/density[-quick].json)")
    args = p.parse_args()
    if args.quick:
        args.mix, args.minutes = "iris=4,minilm=6,smollm2=2", 10
    args.out = args.out or RESULTS / f"density{'-quick' if args.quick else ''}.json"
    root = Path(tempfile.mkdtemp(prefix="ember-density-"))
    root.chmod(0o755)   # the sandboxed models' own users read their copies
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, default=float))   # every request: one line, not one a field
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
