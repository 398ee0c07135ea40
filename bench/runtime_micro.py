"""Micro-benchmark of the runtime adapters, in the zygote pattern the process layer uses.

For the bundled examples (MiniLM embedder, Iris python model) it measures, in one run:
- preload(): wall time of the heavy imports, each sample in a fresh interpreter (and, for scale,
  `import transformers` + BertModel in a fresh interpreter: what the plain-torch encoder avoids);
- load(): in a child forked from a process that only ran preload(), N forks; plus the child's private
  dirty memory after load and after its first request (weights are mmapped file pages, so not in it);
- infer(): single-sentence and 32-sentence-batch latency in a forked child on 1 and 2 intra-op threads
  (interleaved request by request, so a busy machine slows both alike);
- parity: cosine between ember's vectors and sentence_transformers' encode (same directory, offline).

Prints a table and writes JSON to bench/results/runtime_micro.json.
Usage: python bench/runtime_micro.py [-n 20] [--no-parity]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ember.runtimes import get_runtime
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract
from ember.wire.tensors import warmup_inputs

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20
SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "The new movie is awesome!",
    "naïve café, Straße, 東京は日本の首都です。",
    "",
    "Serverless inference keeps a ladder of warm instances: hot, paused, template, zygote.",
    " ".join(f"word{i} is followed by another token" for i in range(120)),
]


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p95": p95, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def fresh_import_s(code: str, n: int) -> dict[str, float]:
    """Seconds `code` takes in a fresh interpreter that has already imported ember.runtimes."""
    script = (
        "import time, ember.runtimes as r, ember.wire.contract\n"
        f"t = time.perf_counter()\n{code}\nprint(time.perf_counter() - t)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    samples = []
    for _ in range(n):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        samples.append(float(done.stdout.split()[-1]))
    return stats(samples)


def private_dirty_mb() -> float:
    """This process's private dirty pages: memory a forked child owns alone (heap, copied-on-write pages).

    Private_Clean is left out on purpose: file pages (the mmapped weights) that only this child has
    touched count as private clean, yet they are page cache that any other process reading the file shares.
    """
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Private_Dirty"].split()[0]) * 1024 / MB


def in_child(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `work` in a forked child (the zygote pattern) and return what it reports."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            message = {"ok": True, **work()}
        except BaseException as err:
            message = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        os.write(write_end, json.dumps(message).encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 16):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks))
    if not result.pop("ok"):
        raise RuntimeError(result["error"])
    return result


def load_in_forks(contract: ModelContract, n: int) -> dict[str, Any]:
    runtime = get_runtime(contract.runtime)

    def work() -> dict[str, Any]:
        before = private_dirty_mb()
        t0 = time.perf_counter()
        model = runtime.load(contract)
        load_s = time.perf_counter() - t0
        loaded = private_dirty_mb()
        model.infer(warmup_inputs(contract))
        after = private_dirty_mb()
        return {"load_s": load_s, "dirty_load_mb": loaded - before, "dirty_first_request_mb": after - before}

    runs = [in_child(work) for _ in range(n)]
    return {key: stats([r[key] for r in runs]) for key in runs[0]}


def latency_in_fork(contract: ModelContract, inputs: dict[str, np.ndarray], n: int) -> dict[str, Any]:
    """Request latency on 1 and on 2 intra-op threads, interleaved in one child so both see the same load."""
    runtime = get_runtime(contract.runtime)
    torch = sys.modules.get("torch")
    counts = (1, 2) if torch is not None else (1,)

    def work() -> dict[str, Any]:
        model = runtime.load(contract)
        samples: dict[int, list[float]] = {t: [] for t in counts}
        for i in range(n + 5):
            for threads in counts:
                if torch is not None:
                    torch.set_num_threads(threads)
                t0 = time.perf_counter()
                model.infer(inputs)
                if i >= 5:  # the first requests warm up
                    samples[threads].append(time.perf_counter() - t0)
        return {f"{t}t": stats(v) for t, v in samples.items()}

    return in_child(work)


def text_batch(items: list[str]) -> dict[str, np.ndarray]:
    arr = np.empty(len(items), dtype=object)
    arr[:] = [s.encode() for s in items]
    return {"text": arr}


def parity(contract: ModelContract) -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    model = get_runtime(contract.runtime).load(contract)
    got = model.infer(text_batch(SENTENCES))["embedding"]
    reference = SentenceTransformer(str(contract.weights_path()), device="cpu", local_files_only=True)
    want = reference.encode(SENTENCES, convert_to_numpy=True)
    cos = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return {"min": float(cos.min()), "mean": float(cos.mean()), "max_abs_diff": float(np.abs(got - want).max())}


def bench_model(name: str, preload_code: str, inputs: dict[str, dict[str, np.ndarray]], n: int) -> dict[str, Any]:
    contract = load_contract(example_contracts_dir() / f"{name}.yaml")
    out: dict[str, Any] = {"preload_s": fresh_import_s(preload_code, max(3, n // 4))}
    get_runtime(contract.runtime).preload()  # this process is now the zygote
    out["fork_load"] = load_in_forks(contract, n)
    for label, batch in inputs.items():
        for threads, latency in latency_in_fork(contract, batch, 5 * n).items():
            out[f"infer_{label}_{threads}_s"] = latency
    return out


def print_table(results: dict[str, Any]) -> None:
    print(f"{'model':8} {'measure':34} {'p50':>10} {'p95':>10}")
    for model, res in results["models"].items():
        rows = [("preload() fresh interpreter (ms)", res["preload_s"], 1e3)]
        rows += [("load() in fork after preload (ms)", res["fork_load"]["load_s"], 1e3)]
        rows += [("child private dirty: load (MB)", res["fork_load"]["dirty_load_mb"], 1)]
        rows += [("child private dirty: +1st req (MB)", res["fork_load"]["dirty_first_request_mb"], 1)]
        rows += [(k.removeprefix("infer_").removesuffix("_s") + " infer (ms)", v, 1e3)
                 for k, v in res.items() if k.startswith("infer_")]
        for label, s, scale in rows:
            print(f"{model:8} {label:34} {s['p50'] * scale:10.2f} {s['p95'] * scale:10.2f}")
    if "transformers_import_s" in results:
        t = results["transformers_import_s"]["p50"]
        p = results["models"]["minilm"]["preload_s"]["p50"]
        print(f"import transformers+BertModel: {t * 1e3:.0f} ms = {t / p:.1f}x the embedding preload()")
    if "parity" in results:
        print("parity vs sentence_transformers: " + ", ".join(f"{k} {v:.6g}" for k, v in results["parity"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20, help="forks per load measurement (latency: 5n requests)")
    parser.add_argument("--no-parity", action="store_true", help="skip the sentence_transformers comparison")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    iris_one = {"features": np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32)}
    results: dict[str, Any] = {"cpus": os.cpu_count(), "n": args.n, "models": {}}
    # The python runtime first: this process has not imported torch yet.
    results["models"]["iris"] = bench_model("iris", "r.get_runtime('python').preload()", {"one": iris_one}, args.n)
    minilm_inputs = {"one": text_batch([SENTENCES[0]]), "batch32": text_batch((SENTENCES * 5)[:32])}
    results["models"]["minilm"] = bench_model(
        "minilm", "r.get_runtime('sentence-transformers').preload()", minilm_inputs, args.n
    )
    results["transformers_import_s"] = fresh_import_s("from transformers import BertModel", 3)
    if not args.no_parity:
        results["parity"] = parity(load_contract(example_contracts_dir() / "minilm.yaml"))

    print_table(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runtime_micro.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS / 'runtime_micro.json'}")


if __name__ == "__main__":
    main()
