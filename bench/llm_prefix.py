"""Prefix rows of the LLM benchmark: time to first token after a ~500-token system prompt, when its KV is
computed (miss), found in the instance's prefix cache (hit), or restored from a weight-store snapshot (a new
load of a contract that declares the prefix in its warmup section, then its warm-up, as a template does it).

Runs in its own process, in process (the runtime, no HTTP: the three cases differ only inside the instance),
on one thread as an instance runs, with a weight-store root of its own (the conversion linked in). Prints one
JSON line. Usage: python bench/llm_prefix.py [-n 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.node.child import set_threads
from ember.wire.contract import example_contracts_dir, load_contract

SYSTEM = ("You are the support assistant of a mountain railway. Timetables change with the seasons; trains run "
          "every thirty minutes in summer and every hour in winter. Tickets are sold at the valley station and "
          "online; children under six travel free. Dogs are welcome on a lead. The summit has a restaurant, a "
          "viewing platform and a small museum about the railway's construction in 1898. ") * 6
QUESTIONS = ["When is the last train down?", "Can I bring my dog?", "Is there food at the top?",
             "How much is a child's ticket?", "When was the railway built?", "Do trains run in winter?",
             "Where do I buy tickets?", "Is the museum open on Mondays?"]


def request(system: str, question: str) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                         "temperature": 0, "max_tokens": 1}).encode()
    return {"request": arr}


def ttft(model: Any, system: str, question: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    reply = next(iter(model.stream(request(system, question))))
    return time.perf_counter() - t0, int(reply["prompt_tokens"][0]), int(reply["cached_tokens"][0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=5)
    args = parser.parse_args()
    set_threads(1)
    from ember.runtimes.gguf_convert import converted_dir
    from ember.runtimes.llm import LLMRuntime, _store
    from ember.runtimes.llm_snapshot import snapshot_name
    from ember.store.config import default_root

    base = load_contract(example_contracts_dir() / "smollm2.yaml")
    gguf = base.weights_path()
    assert gguf is not None
    converted = converted_dir(gguf.resolve(), default_root(), "float32")
    warm = json.dumps({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                       "max_tokens": 1, "temperature": 0})
    declared = base.model_copy(update={"warmup": base.warmup.model_copy(update={"inputs": {"request": (warm,)}})})
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ember-prefix-") as tmp:
        root = Path(tmp)
        (root / "converted").mkdir()
        os.symlink(converted, root / "converted" / converted.name)
        runtime = LLMRuntime(cache_root=root)
        first = runtime.load(declared)                # computes the declared prefix and saves its snapshot
        cold = runtime.load(base)
        cold.infer(request("Warm the kernels.", "Hi"))  # the first forward pass of a process is slower
        misses = [ttft(cold, f"({i}) " + SYSTEM, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.n)]
        hot = runtime.load(base)
        hot.infer(request(SYSTEM, "Hi"))              # the first request with this system prompt: computes it
        hits = [ttft(hot, SYSTEM, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.n)]
        restored = []
        for i in range(args.n):   # a new load each time: the cache comes from the store, then the contract's
            model = runtime.load(declared)   # warmup request runs, as in a template (it hits the restored prefix)
            model.infer({"request": np.array([warm.encode()], dtype=object)})
            restored.append(ttft(model, SYSTEM, QUESTIONS[i % len(QUESTIONS)]))
        ids = first.declared_prefixes()[0]
        with _store(root) as store:
            name = snapshot_name(converted.name, ids, first.options.snapshot_encoding)
            stored = store.manifest(name).logical_bytes
        out = {"miss": misses, "hit": hits, "restored": restored, "prefix_tokens": len(ids),
               "snapshot_bytes": stored, "encoding": first.options.snapshot_encoding,
               "fp32_bytes": len(ids) * first.decoder.kv.bytes_per_token}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)   # torch's interpreter exit takes seconds


if __name__ == "__main__":
    main()
